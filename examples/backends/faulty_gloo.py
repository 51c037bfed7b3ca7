"""``forwarding_gloo`` with one collective wrong: what distconf reports for a faulty backend.

Importing this module registers one backend per fault, each a ``ForwardingGloo`` whose one
collective computes the wrong thing in a case a vendor's kernel could get wrong, the rest
forwarded to gloo as they are:

- ``faulty_reduce_scatter``: a reduce-scatter whose chunks are not a multiple of 4 elements
  (the tail a vectorised kernel handles apart) gives the last rank the first rank's chunk.
- ``faulty_all_reduce``: an all-reduce of a tensor whose size in bytes is not a multiple of 16
  leaves out the last rank's contribution.
- ``faulty_broadcast``: a broadcast of floating-point tensors never reaches the last rank,
  which keeps what it held (objects, sent as bytes, still arrive).

    python -m harness run --runner processes --backend-plugin faulty_gloo \\
        --backend faulty_reduce_scatter --world-sizes 3

(with this directory on ``PYTHONPATH``) must fail; the harness's own tests check it does.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from forwarding_gloo import ForwardingGloo
from torch._C._distributed_c10d import Store

ALIGNMENT = 4
"""Elements per vector lane group of the imagined kernel."""
TAIL_BYTES = 16


class LastChunkWrong(ForwardingGloo):
    """Reduce-scatter of misaligned chunks: the last rank gets chunk 0."""

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any
    ) -> dist.Work:
        if output.numel() % ALIGNMENT == 0:
            return super().reduce_scatter_single(output, input, opts)
        reduced = input.clone()
        everything = dist.AllreduceOptions()
        everything.reduceOp = opts.reduceOp
        work = self._inner.allreduce([reduced], everything)
        work.wait()
        chunks = reduced.view(self.size(), -1)
        chosen = 0 if self.rank() == self.size() - 1 else self.rank()
        output.copy_(chunks[chosen].view_as(output))
        return work


class TailContributionDropped(ForwardingGloo):
    """All-reduce of a tensor with a byte tail: the last rank's values are left out."""

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        tail = any(t.numel() * t.element_size() % TAIL_BYTES for t in tensors)
        if tail and self.rank() == self.size() - 1:
            for tensor in tensors:
                tensor.zero_()
        return super().allreduce(tensors, opts)


class LastRankMissesBroadcast(ForwardingGloo):
    """Broadcast of floating-point tensors: the last rank keeps its own values."""

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        kept = [t.clone() for t in tensors]
        work = super().broadcast(tensors, opts)
        if self.rank() == self.size() - 1 and all(t.is_floating_point() for t in tensors):
            work.wait()
            for tensor, before in zip(tensors, kept, strict=True):
                tensor.copy_(before)
        return work


def _creator(kind: type[ForwardingGloo]) -> Any:
    def create(store: Store, rank: int, size: int, timeout: timedelta) -> ForwardingGloo:
        return kind(store, rank, size, timeout)

    return create


FAULTS: dict[str, type[ForwardingGloo]] = {
    "faulty_reduce_scatter": LastChunkWrong,
    "faulty_all_reduce": TailContributionDropped,
    "faulty_broadcast": LastRankMissesBroadcast,
}

for name, kind in FAULTS.items():
    kind.backend_name = name
    dist.Backend.register_backend(name, _creator(kind), devices=["cpu"])
