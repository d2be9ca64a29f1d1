"""Asynchronous ring exchange: send a block to the next rank, receive one from the previous."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .gather import group_rank, group_size


class RingExchange:
    """Posts P2P send/recv pairs around the ring of ``group``; ``start`` returns at once, so the
    caller computes on its current block while the next one travels."""

    def __init__(self, group=None):
        self.group = group
        self.world = group_size(group)
        rank = group_rank(group)
        to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = to_global((rank + 1) % self.world)
        self.prev = to_global((rank - 1) % self.world)

    def start(self, tensor: torch.Tensor) -> PendingBlock:
        """Send ``tensor`` to the next rank and receive a same-shaped one from the previous."""
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor.contiguous(), self.next, self.group),
            dist.P2POp(dist.irecv, received, self.prev, self.group),
        ]
        return PendingBlock(dist.batch_isend_irecv(ops), received)


class PendingBlock:
    """A block in flight; ``wait`` returns it once it has arrived."""

    def __init__(self, requests, received: torch.Tensor):
        self.requests, self.received = requests, received

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        return self.received
