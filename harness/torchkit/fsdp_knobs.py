"""The FSDP2 controls a case turns (``harness.cases.training.Knobs``) and its mixed-precision
policies (``Precision``), applied to a model ``harness.torchkit.training`` shards; the custom
collectives a case sets (``Comm`` implementations forwarding to torch's collectives as FSDP's
defaults do, so that training with them must be training without them)."""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, register_fsdp_forward_method
from torch.nn.parallel import DistributedDataParallel

from harness.cases.knobs import Knobs, Precision
from harness.cases.training import ParityCase
from harness.torchkit.checkpointing import checkpoint_layers
from harness.torchkit.dtensor import torch_dtype
from harness.torchkit.internals import fsdp_comm_interfaces


def checkpointed(model: nn.Sequential, knobs: Knobs) -> list[nn.Module]:
    """The modules ``fully_shard`` wraps one by one (each child with parameters: a Linear
    or a unit holding one), in model order, after the case's activation checkpointing,
    whose wrappers replace them in ``model``."""
    positions = [i for i, layer in enumerate(model) if next(layer.parameters(), None) is not None]
    if knobs.checkpoint is not None:
        checkpoint_layers(model, positions, knobs.checkpoint)
    return [model[i] for i in positions]


def layer_policies(case: ParityCase, count: int) -> list[MixedPrecisionPolicy]:
    """Each Linear's policy: its own compute dtype, float32 reduction."""
    precision = case.precision
    if precision is None:
        return [MixedPrecisionPolicy()] * count
    return [_policy(dtype, precision) for dtype in precision.layer_dtypes]


def root_policy(case: ParityCase) -> MixedPrecisionPolicy:
    """The root's policy: it casts the model's inputs and its output."""
    precision = case.precision
    if precision is None:
        return MixedPrecisionPolicy()
    output = precision.output_dtype
    uncast = {} if precision.root_casts_inputs else {"cast_forward_inputs": False}
    return MixedPrecisionPolicy(
        param_dtype=None if precision.root_dtype is None else torch_dtype(precision.root_dtype),
        reduce_dtype=torch_dtype(precision.reduce_dtype),
        output_dtype=None if output is None else torch_dtype(output),
        **uncast,
    )


def _policy(dtype: str, precision: Precision) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(
        param_dtype=torch_dtype(dtype), reduce_dtype=torch_dtype(precision.reduce_dtype)
    )


def set_knobs(root: nn.Module, layers: list[nn.Module], knobs: Knobs) -> None:
    """Every ``fully_shard`` module's gradient scaling and collectives, and the layers'
    prefetching."""
    modules = _fsdp_modules(root)
    for module in modules:
        if knobs.divide_factor is not None:
            if knobs.deprecated_spelling:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    module.set_reduce_scatter_divide_factor(knobs.divide_factor)
            else:
                module.set_gradient_divide_factor(knobs.divide_factor)
        if knobs.force_sum_reduction is not None:
            module.set_force_sum_reduction_for_comms(knobs.force_sum_reduction)
    set_comm_knobs(_as_fsdp(root), modules, knobs)
    sharded = [_as_fsdp(layer) for layer in layers]
    if knobs.reset_reshard_after_forward is not None:
        value, recurse = knobs.reset_reshard_after_forward
        _as_fsdp(root).set_reshard_after_forward(value, recurse=recurse)
    if knobs.first_layer_stays_sharded or knobs.first_layer_unshards:
        sharded[0].set_unshard_in_backward(knobs.first_layer_unshards)
    for layer, targets in zip(sharded, knobs.forward_prefetch, strict=False):
        layer.set_modules_to_forward_prefetch([sharded[i] for i in targets])
    for layer, targets in zip(sharded, knobs.backward_prefetch, strict=False):
        layer.set_modules_to_backward_prefetch([sharded[i] for i in targets])
    if knobs.forward_method is not None:
        register_fsdp_forward_method(root, knobs.forward_method)


def add_forward_method(model: nn.Sequential, knobs: Knobs) -> None:
    """Give ``model`` the case's second forward-like method (before it is sharded): its
    forward under another name, which runs the layers without the root's hooks until
    ``register_fsdp_forward_method`` registers it."""
    if knobs.forward_method is not None:
        setattr(model, knobs.forward_method, types.MethodType(nn.Sequential.forward, model))


def forward_of(wrapped: nn.Module, knobs: Knobs) -> Callable[..., Any]:
    """What a training step calls the model through: itself, or its registered method."""
    if knobs.forward_method is None or not isinstance(wrapped, FSDPModule):
        return wrapped
    method: Callable[..., Any] = getattr(wrapped, knobs.forward_method)
    return method


@contextlib.contextmanager
def micro_batch(wrapped: nn.Module, case: ParityCase, last: bool) -> Iterator[None]:
    """One micro-batch's forward and backward: fully_shard and DDP modules sync gradients
    across data-parallel ranks only on the ``last`` (or on each, if the case says so), and
    hold or mark what the case's knobs say (anything else syncs every time, which sums the
    same gradients)."""
    sync = case.sync_each_micro_batch or last
    if isinstance(wrapped, FSDPModule):
        knobs = case.knobs
        recurse = {} if knobs.recurse else {"recurse": False}
        wrapped.set_requires_gradient_sync(sync, **recurse)
        if knobs.hold_all_reduce:
            wrapped.set_requires_all_reduce(last, **recurse)
        if knobs.hold_reshard:
            wrapped.set_reshard_after_backward(last, **recurse)
        if knobs.mark_last_backward:
            wrapped.set_is_last_backward(last)
        if knobs.explicit_unshard:
            _unshard_all(wrapped, knobs.unshard_async)
        yield
    elif isinstance(wrapped, DistributedDataParallel) and not sync:
        with wrapped.no_sync():
            yield
    else:
        yield


def after_step(wrapped: nn.Module, case: ParityCase) -> None:
    """``reshard()`` every module after the optimizer step when the case unshards them."""
    if case.knobs.explicit_unshard and isinstance(wrapped, FSDPModule):
        for module in _fsdp_modules(wrapped):
            module.reshard()


def _unshard_all(root: nn.Module, async_op: bool) -> None:
    modules = _fsdp_modules(root)
    if not async_op:
        for module in modules:
            handle = module.unshard()
            assert handle is None, handle  # returns once unsharded
        return
    handles = [module.unshard(async_op=True) for module in modules]
    for handle in handles:
        if handle is not None:
            handle.wait()


def _fsdp_modules(root: nn.Module) -> list[FSDPModule]:
    return [module for module in root.modules() if isinstance(module, FSDPModule)]


def _as_fsdp(module: Any) -> FSDPModule:
    assert isinstance(module, FSDPModule), type(module)
    return module


# --- custom collectives ----------------------------------------------------------------------
_AllGather, _ReduceScatter = fsdp_comm_interfaces()


def _staging(
    size: Sequence[int | torch.SymInt], dtype: torch.dtype, device: torch.device, zeroed: bool
) -> torch.Tensor:
    make = torch.zeros if zeroed else torch.empty
    return make(*size, dtype=dtype, device=device)


@dataclass
class _OwnStaging:
    """A custom collective's ``allocate``: its staging buffers of its own, zeroed or not."""

    zeroed: bool = False

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return _staging(size, dtype, device, self.zeroed)


@dataclass
class ForwardingAllGather(_OwnStaging, _AllGather):  # type: ignore[misc,valid-type]  # torch ABC
    """``all_gather_single`` into a buffer of its own allocating."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Any:
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


@dataclass
class ForwardingReduceScatter(_OwnStaging, _ReduceScatter):  # type: ignore[misc,valid-type]  # torch ABC
    """``reduce_scatter_single`` with the op FSDP chose, from a buffer of its own
    allocating."""

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
