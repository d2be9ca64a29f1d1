"""The training loop and its parts."""

from .loop import NonFiniteError, run

__all__ = ["NonFiniteError", "run"]
