"""The training loop and its parts."""

from ..distributed.health import RankLost
from .loop import NonFiniteError, run
from .preemption import PREEMPTED_EXIT, Preempted

__all__ = ["NonFiniteError", "PREEMPTED_EXIT", "Preempted", "RankLost", "run"]
