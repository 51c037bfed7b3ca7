"""Custom FSDP2 collectives (``FSDPModule.set_custom_all_gather`` and
``set_custom_reduce_scatter``): ``Comm`` implementations that forward to torch's collectives
as FSDP's defaults do, their staging buffers allocated empty or zeroed, so that training
with them must be training without them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from harness.cases.knobs import Knobs
from harness.torchkit.internals import fsdp_comm_interfaces

_AllGather, _ReduceScatter = fsdp_comm_interfaces()


def _staging(
    size: Sequence[int | torch.SymInt], dtype: torch.dtype, device: torch.device, zeroed: bool
) -> torch.Tensor:
    make = torch.zeros if zeroed else torch.empty
    return make(*size, dtype=dtype, device=device)


@dataclass
class ForwardingAllGather(_AllGather):  # type: ignore[misc,valid-type]  # torch ABC
    """``all_gather_single`` into a buffer of its own allocating."""

    zeroed: bool = False

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return _staging(size, dtype, device, self.zeroed)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Any:
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


@dataclass
class ForwardingReduceScatter(_ReduceScatter):  # type: ignore[misc,valid-type]  # torch ABC
    """``reduce_scatter_single`` with the op FSDP chose, from a buffer of its own
    allocating."""

    zeroed: bool = False

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return _staging(size, dtype, device, self.zeroed)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        return dist.reduce_scatter_single(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


def set_comm_knobs(root: FSDPModule, modules: Sequence[FSDPModule], knobs: Knobs) -> None:
    """The case's collective controls: reduce-scatter of unused parameters and a separate
    reduce-scatter group set on the root (recursing or not), custom collectives or
    process-group staging buffers on every module."""
    if knobs.reduce_scatter_unused is not None:
        value, recurse = knobs.reduce_scatter_unused
        root.set_reduce_scatter_unused_params(value, recurse=recurse)
    if knobs.separate_reduce_scatter is not None:
        enable, recurse = knobs.separate_reduce_scatter
        root.set_separate_reduce_scatter_group(enable, recurse=recurse)
    for module in modules:
        if knobs.group_allocates is not None:
            module.set_allocate_memory_from_process_group_for_comm(knobs.group_allocates)
        if knobs.custom_all_gather is not None:
            module.set_custom_all_gather(ForwardingAllGather(zeroed=knobs.custom_all_gather))
        if knobs.custom_reduce_scatter is not None:
            zeroed = knobs.custom_reduce_scatter
            module.set_custom_reduce_scatter(ForwardingReduceScatter(zeroed=zeroed))
