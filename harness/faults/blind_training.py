"""Blind faults in data-parallel training and optimizers: FSDP2/HSDP gradient bookkeeping and
mixed precision, DDP buffer sync, ZeroRedundancyOptimizer's partition and param-group sync,
optimizer kernels on DTensor parameters, clip_grad_norm_ with the infinity norm.

Written blind, as a held-out set: by a contributor who read upstream's bug reports and
torch's source but not distconf's suites, strategies or specs, each fault standing for a
real upstream bug or bug class (the comment above it). Run against the suites as they then
were, 3 of 10 survived; each survivor pointed at a weak property, strengthened in
general rather than aimed at the fault:
- clip_inf_norm_through_p_root: clipping measured the 2-norm only; now the 2-, 1- or inf-norm.
- sharded_grad_replaced_not_accumulated: micro-batches synced only the last; now after each
  too, the reduced gradients accumulated.
- forward_buffer_sync_skipped: no trained model had a buffer (optim.ddp.broadcast_buffers).

Each patch was written for torch 2.13: a target that is gone raises FaultError when applied.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

from harness.faults._patch import Fault, Patch, rewritten

_COMMON = "torch.distributed.fsdp._fully_shard._fsdp_common"
_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param"
_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
_ZERO = "torch.distributed.optim.zero_redundancy_optimizer"
_DDP = "torch.nn.parallel.distributed"


# --- helpers ---------------------------------------------------------------------------------


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


# --- FSDP2 -----------------------------------------------------------------------------------

# Offset bookkeeping in foreach_reduce: each parameter's slice of the reduce-scatter output is
# padded_unsharded_numel // world_size long, whatever its real shard size.
_OFFSET_EDIT = (
    "padded_sharded_numel = padded_unsharded_size.numel() // world_size",
    "padded_sharded_numel = fsdp_param.sharded_size.numel()",
)


def _sharded_grads_replaced(original: Callable[..., Any]) -> Callable[..., Any]:
    def foreach_reduce(fsdp_params: Any, *args: Any, **kwargs: Any) -> Any:
        for fsdp_param in fsdp_params:
            fsdp_param.sharded_param.grad = None
        return original(fsdp_params, *args, **kwargs)

    return foreach_reduce


def _reduce_dtype_clamped_to_orig(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_dtype_attrs(self: Any, mp_policy: Any) -> None:
        original(self, mp_policy)
        # "No cast needed" decided against the parameter's storage dtype instead of the
        # dtype gradients are computed in (param_dtype).
        if self.param_dtype is not None and self.reduce_dtype == self.orig_dtype:
            self.reduce_dtype = None

    return init_dtype_attrs


def _shard_rank_from_replicate_axis(original: Callable[..., Any]) -> Callable[..., Any]:
    def post_init(self: Any) -> None:
        original(self)
        self.shard_mesh_rank = self.replicate_mesh_rank

    return post_init


# --- DDP -------------------------------------------------------------------------------------


def _buffers_not_synced(original: Callable[..., Any]) -> Callable[..., Any]:
    def sync_buffers(self: Any) -> None:
        return None

    return sync_buffers


# --- ZeroRedundancyOptimizer -----------------------------------------------------------------


def _new_group_inserted_first(original: Callable[..., Any]) -> Callable[..., Any]:
    def add_param_group(self: Any, param_group: dict[str, Any]) -> None:
        before = len(self.optim.param_groups) if getattr(self, "initialized", False) else None
        original(self, param_group)
        groups = self.optim.param_groups if before is not None else []
        if before is not None and len(groups) == before + 1:
            # The local shard of the new group goes to the front, while every later
            # _sync_param_groups still pairs exposed and local groups by position.
            groups.insert(0, groups.pop())

    return add_param_group


def _param_group_options_not_overwritten(original: Callable[..., Any]) -> Callable[..., Any]:
    def sync_param_groups(src_param_groups: Any, dst_param_groups: Any) -> None:
        if len(src_param_groups) != len(dst_param_groups):
            raise AssertionError(
                "Mismatch between number of source and destination parameter groups"
            )
        for src, dst in zip(src_param_groups, dst_param_groups, strict=True):
            for attr in src:
                if attr != "params" and attr not in dst:
                    dst[attr] = src[attr]

    return sync_param_groups


# --- optimizer kernels -----------------------------------------------------------------------


def _dampened_first_momentum(original: Callable[..., Any]) -> Callable[..., Any]:
    def sgd_kernel(
        params: list[Any],
        grads: list[Any],
        momentum_buffer_list: list[Any],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if (
            params
            and _is_dtensor(params[0])
            and kwargs.get("momentum", 0) != 0
            and kwargs.get("dampening", 0) != 0
        ):
            import torch

            for i, buf in enumerate(momentum_buffer_list):
                if buf is None:
                    # Zero-initialised buffer: the first update becomes (1 - dampening) * grad
                    momentum_buffer_list[i] = torch.zeros_like(grads[i])
        return original(params, grads, momentum_buffer_list, *args, **kwargs)

    return sgd_kernel


def _amsgrad_max_not_stored(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def multi_tensor_adam(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        params = bound.arguments["params"]
        maxima = bound.arguments["max_exp_avg_sqs"]
        if not (bound.arguments.get("amsgrad") and params and _is_dtensor(params[0])):
            return original(*args, **kwargs)
        saved = [m.detach().clone() for m in maxima]
        result = original(*args, **kwargs)
        for m, old in zip(maxima, saved, strict=True):
            m.copy_(old)  # the running maximum was only a temporary
        return result

    return multi_tensor_adam


# --- clip_grad_norm_ -------------------------------------------------------------------------


def _inf_norm_through_p_root(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_total_norm(tensors: Any, norm_type: float = 2.0, *args: Any, **kwargs: Any) -> Any:
        import torch

        total = original(tensors, norm_type, *args, **kwargs)
        listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if math.isinf(float(norm_type)) and any(_is_dtensor(t) for t in listed):
            # The p-norm epilogue total ** (1 / p) applied to the inf-norm too: always 1.
            total = total ** (1.0 / float(norm_type))
        return total

    return get_total_norm


FAULTS = (
    # https://github.com/pytorch/pytorch/pull/174862 (bug class: foreach_reduce's flat_grad_offset
    # bookkeeping; that PR fixes the offset when a rank has no gradient for a parameter). Each
    # parameter's slice of the reduce-scatter output must advance by the *padded* shard numel.
    Fault(
        id="fsdp.reduce_offset_unpadded",
        area="uneven",
        bug_class="offset bookkeeping: a flat buffer walked with unpadded instead of padded sizes",
        summary="FSDP2's foreach_reduce advances the offset into the reduce-scatter output by "
        "the parameter's real (unpadded) shard numel, so on a rank whose shard of an unevenly "
        "sharded parameter is padded, every later parameter's gradient is read from the wrong "
        "place",
        patches=(Patch(f"{_PARAM_GROUP}:foreach_reduce", rewritten(_OFFSET_EDIT)),),
    ),
    # https://github.com/pytorch/pytorch/pull/73535 (FSDP1 with CPU offload "will use the
    # newly-reduced gradient instead of accumulating with any existing gradient").
    Fault(
        id="fsdp.sharded_grad_replaced_not_accumulated",
        area="optim",
        bug_class="gradient accumulation: a new reduced gradient replaces the existing one",
        summary="FSDP2's foreach_reduce drops any existing sharded .grad before reducing, so "
        "two backward passes without zero_grad leave only the last one's gradient",
        patches=(Patch(f"{_PARAM_GROUP}:foreach_reduce", _sharded_grads_replaced),),
    ),
    # https://github.com/pytorch/pytorch/issues/190626 (MixedPrecisionPolicy.reduce_dtype not
    # applied to one of FSDP2's gradient reductions, which then runs in bf16).
    Fault(
        id="fsdp.reduce_dtype_clamped_to_orig",
        area="optim",
        bug_class="mixed precision: reduce_dtype silently ignored (reduction in param_dtype)",
        summary="FSDPParam.init_dtype_attrs drops reduce_dtype when it equals the parameter's "
        "original dtype, so param_dtype=bf16, reduce_dtype=fp32 reduce-scatters gradients in "
        "bf16",
        patches=(Patch(f"{_PARAM}:FSDPParam.init_dtype_attrs", _reduce_dtype_clamped_to_orig),),
    ),
    # Bug class, no single issue (rank index taken from the wrong mesh axis / group; cf.
    # https://github.com/pytorch/pytorch/issues/63213 on group-local vs global ranks).
    Fault(
        id="hsdp.shard_rank_from_replicate_axis",
        area="hsdp",
        bug_class="rank index taken from the wrong mesh axis",
        summary="HSDP's mesh info takes the shard-group rank from the replicate axis, so ranks "
        "of a shard group keep the wrong chunks of every parameter",
        patches=(Patch(f"{_COMMON}:HSDPMeshInfo.__post_init__", _shard_rank_from_replicate_axis),),
    ),
    # https://github.com/pytorch/pytorch/issues/63917 ("if we completely remove DDP's
    # broadcast_buffers feature, the only test failures are related to timeout"); see also
    # https://github.com/pytorch/pytorch/issues/63916.
    Fault(
        id="ddp.forward_buffer_sync_skipped",
        area="optim",
        bug_class="a collective skipped: buffers never re-synchronised before forward",
        summary="DistributedDataParallel's pre-forward buffer sync (broadcast_buffers=True) "
        "does nothing, so buffers such as BatchNorm running stats diverge across ranks",
        patches=(Patch(f"{_DDP}:DistributedDataParallel._sync_buffers", _buffers_not_synced),),
    ),
    # https://github.com/pytorch/pytorch/issues/71347 (ZeRO's param-group support; the torch
    # source notes add_param_group "assumes that the call to the parent's add_param_group()
    # appends the new parameter group and preserves the previous parameter-group ordering").
    # Bug class: groups paired by position after their order diverged.
    Fault(
        id="zero.add_param_group_order_mismatch",
        area="zero",
        bug_class="parallel lists paired by position after their orders diverged",
        summary="ZeroRedundancyOptimizer.add_param_group puts the new group's local shard "
        "first in the local optimizer, so each step's _sync_param_groups gives the new "
        "parameters the first group's lr / weight_decay and the old ones the new group's",
        patches=(
            Patch(f"{_ZERO}:ZeroRedundancyOptimizer.add_param_group", _new_group_inserted_first),
        ),
    ),
    # https://github.com/pytorch/ignite/issues/545 (bug class: a wrapping optimizer whose exposed
    # param_groups are decoupled from the inner optimizer, so LR schedules are not applied).
    Fault(
        id="zero.param_group_options_not_synced",
        area="zero",
        bug_class="wrapper state not propagated: hyper-parameter changes never reach the "
        "inner optimizer",
        summary="ZeroRedundancyOptimizer._sync_param_groups only copies options missing from "
        "the destination, so lr / weight_decay changes made on zero.param_groups (e.g. by an "
        "LR scheduler) never reach the local optimizer",
        patches=(
            Patch(
                f"{_ZERO}:ZeroRedundancyOptimizer._sync_param_groups",
                _param_group_options_not_overwritten,
            ),
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/152833 (PyTorch's SGD skips dampening on the first
    # momentum step; a zero-initialised buffer, as in https://github.com/ml-explore/mlx/pull/473,
    # dampens it).
    Fault(
        id="optim.sgd_first_step_dampened",
        area="optim",
        bug_class="optimizer state initialisation: first momentum step dampened",
        summary="SGD's single-tensor and foreach kernels start DTensor parameters' momentum "
        "buffers at zero, so the first step uses (1 - dampening) * grad instead of grad",
        patches=(
            # the foreach kernel only: torch.distributed.optim scripts the single-tensor one at
            # import, and TorchScript cannot compile a wrapper taking *args
            Patch("torch.optim.sgd:_multi_tensor_sgd", _dampened_first_momentum),
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/4314 (AMSGrad in SparseAdam: "You aren't updating
    # the saved max_exp_avg_sq in here. You're only assigning it to a local").
    Fault(
        id="optim.foreach_amsgrad_max_not_stored",
        area="optim",
        bug_class="optimizer state not written back (a running maximum kept in a temporary)",
        summary="Adam/AdamW's foreach kernel uses max(max_exp_avg_sq, exp_avg_sq) for DTensor "
        "parameters but never stores the maximum, so AMSGrad degenerates to Adam",
        patches=(Patch("torch.optim.adam:_multi_tensor_adam", _amsgrad_max_not_stored),),
    ),
    # https://github.com/meta-pytorch/torchrec/pull/3199 ("inf" norm gradient clipping for
    # FSDP2: total_grad_norm ** (1.0 / norm_type) made the inf-norm always 1.0).
    Fault(
        id="optim.clip_inf_norm_through_p_root",
        area="optim",
        bug_class="special case lost: the p-norm formula applied to norm_type=inf",
        summary="clip_grad_norm_ / get_total_norm raise the inf-norm of DTensor gradients to "
        "the power 1/inf, so the total norm is always 1 and clipping uses it",
        patches=(Patch("torch.nn.utils.clip_grad:_get_total_norm", _inf_norm_through_p_root),),
    ),
)
