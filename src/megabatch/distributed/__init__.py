"""Process-group helpers and differentiable collectives."""

from .env import DistEnv, init_distributed
from .gather import all_gather_with_grad, check_equal_batch, gather_no_grad, global_mean_value
from .ring import RingExchange

__all__ = [
    "DistEnv",
    "all_gather_with_grad",
    "check_equal_batch",
    "gather_no_grad",
    "global_mean_value",
    "RingExchange",
    "init_distributed",
]
