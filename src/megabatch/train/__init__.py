"""The training loop and its parts."""

from ..distributed.health import RankLost
from .trainer.loop import NonFiniteError, run
from .trainer.stops import PREEMPTED_EXIT, Preempted

__all__ = ["NonFiniteError", "PREEMPTED_EXIT", "Preempted", "RankLost", "run"]
