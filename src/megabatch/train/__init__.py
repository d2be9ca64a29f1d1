"""The training loop and its parts."""

from .loop import run

__all__ = ["run"]
