"""A collective backend written in Python that forwards every collective to gloo.

It is what a vendor's backend looks like to torch: a ``ProcessGroup`` subclass, created by
the function ``dist.Backend.register_backend`` names, called by DTensor, FSDP and DCP
through the same methods. Importing this module registers it as ``forwarding_gloo``:

    python -m harness run --runner processes --backend-plugin forwarding_gloo \\
        --backend forwarding_gloo

(with this directory on ``PYTHONPATH``). A vendor copies it, replaces ``_inner`` with their
library's calls, and runs the suites against it; ``faulty_gloo`` shows what distconf reports
when a collective computes the wrong thing.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

NAME = "forwarding_gloo"


class ForwardingGloo(dist.ProcessGroup):
    """Every collective of the group, forwarded to a gloo group on the same store."""

    backend_name = NAME

    def __init__(self, store: Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # stubs: (store, rank, size) only
        # torch's stubs name few of the bound gloo methods this forwards to
        self._inner: Any = dist.ProcessGroupGloo(store, rank, size, timeout)
        # Registered as the group's CPU backend, it gives torch what it reads from a C++
        # backend: the group's name and description, and the device types the group serves
        # (DCP's broadcast_from_rank0 picks its device from them). Collectives still come to
        # the methods below first.
        custom = dist.ProcessGroup.BackendType.CUSTOM
        self._register_backend(torch.device("cpu"), custom, self._inner)
        self._set_default_backend(custom)

    def getBackendName(self) -> str:
        return self.backend_name

    # --- what DTensor, FSDP and DCP call (torch's Python names for ProcessGroup methods) ---

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._inner.allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._inner.allreduce_coalesced(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._inner.reduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        return self._inner.broadcast(tensors, opts)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        return self._inner.allgather(outputs, inputs, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> dist.Work:
        return self._inner._allgather_base(output, input, opts)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        return self._inner.allgather_coalesced(outputs, inputs, opts)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        return _each(self.all_gather_single, outputs, inputs, opts)

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any
    ) -> dist.Work:
        return self._inner.reduce_scatter(outputs, inputs, opts)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any
    ) -> dist.Work:
        return self._inner._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        return _each(self.reduce_scatter_single, outputs, inputs, opts)

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        return self._inner.alltoall(outputs, inputs, opts)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        opts: Any,
    ) -> dist.Work:
        return self._inner.alltoall_base(output, input, output_splits, input_splits, opts)

    def gather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any
    ) -> dist.Work:
        return self._inner.gather(outputs, inputs, opts)

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any
    ) -> dist.Work:
        return self._inner.scatter(outputs, inputs, opts)

    def barrier(self, opts: Any) -> dist.Work:
        return self._inner.barrier(opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return self._inner.send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return self._inner.recv(tensors, src, tag)


def _each(
    collective: Callable[[torch.Tensor, torch.Tensor, Any], dist.Work],
    outputs: list[torch.Tensor],
    inputs: list[torch.Tensor],
    opts: Any,
) -> dist.Work:
    """A coalesced collective as one call per pair, all but the last waited for."""
    works = [collective(out, into, opts) for out, into in zip(outputs, inputs, strict=True)]
    for work in works[:-1]:
        work.wait()
    return works[-1]


def create(store: Store, rank: int, size: int, timeout: timedelta) -> ForwardingGloo:
    return ForwardingGloo(store, rank, size, timeout)


dist.Backend.register_backend(NAME, create, devices=["cpu"])
