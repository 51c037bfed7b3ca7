"""Faults in the data-parallel wrappers (FSDP2, HSDP, DDP) and what they do around forward and
backward: how gradients are divided, reduced and accumulated (divide factors and reduce ops, the
replicate all-reduce, reduce_dtype, accumulation with and without sync), DDP's parameter and
buffer broadcasts, FSDP2's resharding after forward, prefetching and mixed-precision casts,
activation checkpointing of distributed regions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from harness.faults._origin import WITH_THE_PROPERTY, blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import (
    DivideFactors,
    any_dtensor,
    divide_factors_edited,
    forcing_argument,
    rewritten,
)
from harness.faults.held_out import FIRST, TRAINING_KNOBS

_CHECKPOINT = "torch.utils.checkpoint"
_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
_DDP = "torch.nn.parallel.distributed"
_FULLY_SHARD = "torch.distributed.fsdp._fully_shard._fully_shard"
_INIT = "torch.distributed.fsdp._fully_shard._fsdp_init"
_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param"
_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
_STATE = "torch.distributed.fsdp._fully_shard._fsdp_state"


def _summed_gradients(original: Callable[..., Any]) -> Callable[..., Any]:
    def divide_factors(*args: Any, **kwargs: Any) -> Any:
        from torch.distributed import ReduceOp

        pre, _post, rs_op, ar_op = original(*args, **kwargs)
        if rs_op == ReduceOp.AVG:
            rs_op = ReduceOp.SUM
        return pre, None, rs_op, ar_op

    return divide_factors


def _replicate_axis_ignored(original: Callable[..., Any]) -> Callable[..., Any]:
    def divide_factors(
        reduce_scatter_group: Any, all_reduce_group: Any, *args: Any, **kwargs: Any
    ) -> Any:
        from torch.distributed import ReduceOp

        pre, post, rs_op, ar_op = original(reduce_scatter_group, None, *args, **kwargs)
        if all_reduce_group is None:
            return pre, post, rs_op, ar_op
        return pre, post, rs_op, ReduceOp.SUM

    return divide_factors


def _unsynced_grads_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    def post_backward(self: Any, *args: Any) -> Any:
        result = original(self, *args)
        if not self.reduce_grads:
            for fsdp_param in self.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                if hasattr(fsdp_param, "_unsharded_param"):
                    fsdp_param.unsharded_param.grad = None
        return result

    return post_backward


def _fp16_postdivide_by_whole_factor(
    result: DivideFactors, arguments: dict[str, Any]
) -> DivideFactors:
    pre, post, reduce_scatter_op, all_reduce_op = result
    if pre is None or post is None:
        return result
    # The post-divide uses the whole factor, forgetting the part already divided out before
    # the reduction.
    return pre, pre * post, reduce_scatter_op, all_reduce_op


def _custom_factor_ignored_when_summing(original: Callable[..., Any]) -> Callable[..., Any]:
    def _get_gradient_divide_factors(
        reduce_scatter_group: Any,
        all_reduce_group: Any,
        reduce_dtype: Any,
        device_type: str = "",
        factor: float | None = None,
        force_sum_reduction_for_comms: bool = False,
    ) -> DivideFactors:
        if force_sum_reduction_for_comms:
            factor = None  # falls back to the data-parallel size
        result: DivideFactors = original(
            reduce_scatter_group,
            all_reduce_group,
            reduce_dtype,
            device_type,
            factor,
            force_sum_reduction_for_comms,
        )
        return result

    return _get_gradient_divide_factors


_SINGLE_RANK_DIVIDE_EDIT = (
    "reduce_output.copy_(reduce_scatter_input / gradient_divide_factor)",
    "reduce_output.copy_(reduce_scatter_input)",
)


def _accumulated_grad_replaced(original: Callable[..., Any]) -> Callable[..., Any]:
    def accumulate_unsharded_grad_if_needed(self: Any) -> None:
        accumulated = self.unsharded_accumulated_grad
        if accumulated is None or self.unsharded_param.grad is None:
            return None
        # Assigned instead of accumulated: the reduce-dtype buffer keeps only the newest
        # micro-batch.
        self.unsharded_accumulated_grad = self.unsharded_param.grad.to(accumulated.dtype)
        self.unsharded_param.grad = None
        return None

    return accumulate_unsharded_grad_if_needed


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


def _no_broadcast(original: Callable[..., Any]) -> Callable[..., Any]:
    def sync_module_states(*args: Any, **kwargs: Any) -> None:
        return None

    return sync_module_states


def _buffers_not_synced(original: Callable[..., Any]) -> Callable[..., Any]:
    def sync_buffers(self: Any) -> None:
        return None

    return sync_buffers


def _post_forward_rank_div_not_mod(original: Callable[..., Any]) -> Callable[..., Any]:
    def _get_post_forward_mesh_info(reshard_after_forward: bool | int, mesh_info: Any) -> Any:
        post_forward = original(reshard_after_forward, mesh_info)
        if post_forward is None or post_forward is mesh_info:
            return post_forward
        # The rank inside the smaller post-forward group: rank // group_size (the index of the
        # group) instead of rank % group_size.
        post_forward.shard_mesh_rank = mesh_info.shard_mesh_rank // post_forward.shard_mesh_size
        return post_forward

    return _get_post_forward_mesh_info


def _mistargeted_unshard_kept(original: Callable[..., Any]) -> Callable[..., Any]:
    def finalize_backward(self: Any) -> None:
        pending = self._all_gather_result
        original(self)
        # A prefetched all-gather nobody waited on survives the end of backward, so the next
        # iteration's unshard is a no-op and copies out the parameters from before the step.
        self._all_gather_result = pending

    return finalize_backward


def _root_output_not_cast(original: Callable[..., Any]) -> Callable[..., Any]:
    def _post_forward(self: Any, module: Any, input: Any, output: Any) -> Any:
        policy = self._mp_policy
        if policy.output_dtype is None or self._state_ctx.iter_forward_root is not self:
            return original(self, module, input, output)
        # The root's post-forward (the one that ends the iteration's forward) skips the cast.
        self._mp_policy = dataclasses.replace(policy, output_dtype=None)
        try:
            return original(self, module, input, output)
        finally:
            self._mp_policy = policy

    return _post_forward


def _kwargs_not_cast(original: Callable[..., Any]) -> Callable[..., Any]:
    def _cast_forward_inputs(
        self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        cast_args, _ = original(self, args, {})
        return cast_args, kwargs

    return _cast_forward_inputs


def _is_distributed_region(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a checkpointed callable runs distributed state: DTensor inputs or parameters
    (tensor parallel), FSDP2 modules inside it, or inputs routed through an enclosing FSDP2
    module's pre-forward."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import FSDPModule

    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if any_dtensor(tensors):
        return True
    if any(
        t.grad_fn is not None and "RegisterPostBackward" in type(t.grad_fn).__name__
        for t in tensors
    ):
        return True
    if isinstance(fn, nn.Module):
        return any(isinstance(m, FSDPModule) for m in fn.modules()) or any_dtensor(fn.parameters())
    return False


def _rng_not_restored(original: Callable[..., Any]) -> Callable[..., Any]:
    def _checkpoint_without_reentrant_generator(
        fn: Any, preserve_rng_state: bool = True, *rest: Any, **kwargs: Any
    ) -> Any:
        # rest: context_fn, determinism_check, debug, early_stop, then the function's args
        if preserve_rng_state and _is_distributed_region(fn, tuple(rest[4:]), kwargs):
            # The recomputation draws fresh random numbers (new dropout masks): the RNG state
            # belongs to a distributed tracker and the forward's state is not replayed.
            preserve_rng_state = False
        return original(fn, preserve_rng_state, *rest, **kwargs)

    return _checkpoint_without_reentrant_generator


FAULTS: tuple[Fault, ...] = (
    Fault(
        id="fsdp.gradients_summed",
        area="optim",
        bug_class="gradient scaling: data-parallel gradients summed, never divided",
        summary="FSDP2 reduce-scatters gradients with SUM and skips the post-division",
        patches=(Patch(f"{_COLLECTIVES}:_get_gradient_divide_factors", _summed_gradients),),
        origin=WITH_THE_PROPERTY,
    ),
    Fault(
        id="hsdp.replicate_axis_not_divided",
        area="optim",
        bug_class="gradient scaling across mesh axes: the divide factor ignores one axis",
        summary="HSDP divides gradients by the shard-axis size only and sums over the "
        "replicate axis",
        patches=(Patch(f"{_COLLECTIVES}:_get_gradient_divide_factors", _replicate_axis_ignored),),
        origin=WITH_THE_PROPERTY,
    ),
    Fault(
        id="hsdp.replicate_all_reduce_skipped",
        area="optim",
        bug_class="a collective skipped on one mesh axis",
        summary="HSDP never all-reduces gradients over the replicate axis",
        patches=(
            Patch(f"{_PARAM_GROUP}:foreach_reduce", forcing_argument("all_reduce_group", None)),
        ),
        origin=WITH_THE_PROPERTY,
    ),
    Fault(
        id="fsdp.unsynced_grads_dropped",
        area="optim",
        bug_class="gradient accumulation without sync loses the earlier micro-batches",
        summary="FSDP2's post-backward with requires_gradient_sync=False discards the "
        "unsharded gradients instead of keeping them for the next backward",
        patches=(Patch(f"{_PARAM_GROUP}:FSDPParamGroup.post_backward", _unsynced_grads_dropped),),
        origin=WITH_THE_PROPERTY,
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
        origin=blind(FIRST, "https://github.com/pytorch/pytorch/pull/73535", survived_before=True),
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
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/issues/190626", survived_before=False
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/155915 (set_force_sum_reduction_for_comms; it
    # reworked set_reduce_scatter_divide_factor's logic after PreMulSum bugs #155903/#155904).
    Fault(
        id="fsdp.force_sum_ignores_divide_factor",
        area="optim",
        bug_class="a custom knob dropped on one code path",
        summary="with set_force_sum_reduction_for_comms(True), FSDP2 ignores "
        "set_gradient_divide_factor and post-divides by the data-parallel size instead",
        patches=(
            Patch(
                f"{_COLLECTIVES}:_get_gradient_divide_factors",
                _custom_factor_ignored_when_summing,
            ),
        ),
        origin=blind(
            TRAINING_KNOBS, "https://github.com/pytorch/pytorch/pull/155915", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/106034 (FSDP's fp16 pre-/post-divide bookkeeping
    # across the two HSDP reductions) and https://github.com/pytorch/pytorch/issues/78774.
    Fault(
        id="fsdp.fp16_postdivide_whole_factor",
        area="optim",
        bug_class="split scaling: the pre-divided part divided out again afterwards",
        summary="when gradients are reduced in float16 (MixedPrecisionPolicy(reduce_dtype="
        "float16) or float16 parameters), FSDP2 pre-divides by ~sqrt(N) but post-divides by "
        "the whole factor N, so gradients come out pre_factor times too small",
        patches=(
            Patch(
                f"{_COLLECTIVES}:_get_gradient_divide_factors",
                divide_factors_edited(_fp16_postdivide_by_whole_factor),
            ),
        ),
        origin=blind(
            TRAINING_KNOBS,
            "https://github.com/pytorch/pytorch/pull/106034",
            "https://github.com/pytorch/pytorch/issues/78774",
            survived_before=False,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/167178 ("fully_shard's gradient_divide_factor
    # isn't currently respected when the sharding degree = 1"; the shortcut came with #159598).
    Fault(
        id="fsdp.single_rank_shard_divide_factor_dropped",
        area="optim",
        bug_class="a scale factor lost on a shortcut path",
        summary="when the reduce-scatter group has one rank (HSDP with shard size 1, a "
        "one-rank FSDP mesh), foreach_reduce copies the gradient without dividing by "
        "set_gradient_divide_factor",
        patches=(Patch(f"{_PARAM_GROUP}:foreach_reduce", rewritten(_SINGLE_RANK_DIVIDE_EDIT)),),
        origin=blind(
            TRAINING_KNOBS, "https://github.com/pytorch/pytorch/pull/167178", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/125191 ("[FSDP2] Accumulated in reduce_dtype if
    # not syncing grads": the unsharded gradient is kept in a separate reduce-dtype buffer).
    Fault(
        id="fsdp.unsynced_reduce_dtype_grad_replaced",
        area="optim",
        bug_class="gradient accumulation: a buffer assigned instead of accumulated",
        summary="with set_requires_gradient_sync(False) and a reduce_dtype different from "
        "param_dtype, each micro-batch's unsharded gradient replaces the reduce-dtype "
        "accumulation buffer, so only the last micro-batch is reduced",
        patches=(
            Patch(
                f"{_PARAM}:FSDPParam.accumulate_unsharded_grad_if_needed",
                _accumulated_grad_replaced,
            ),
        ),
        origin=blind(
            TRAINING_KNOBS, "https://github.com/pytorch/pytorch/pull/125191", survived_before=True
        ),
    ),
    Fault(
        id="ddp.init_broadcast_skipped",
        area="optim",
        bug_class="a collective skipped: replicas never synchronised at construction",
        summary="DistributedDataParallel's constructor skips broadcasting rank 0's "
        "parameters and buffers",
        patches=(Patch("torch.nn.parallel.distributed:_sync_module_states", _no_broadcast),),
        origin=WITH_THE_PROPERTY,
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
        origin=blind(
            FIRST,
            "https://github.com/pytorch/pytorch/issues/63917",
            "https://github.com/pytorch/pytorch/issues/63916",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/118017 (reshard_after_forward as an int: the
    # post-forward submesh built by hand from the shard group; its review discusses the manual
    # rank arithmetic).
    Fault(
        id="fsdp.post_forward_rank_div_not_mod",
        area="optim",
        bug_class="index arithmetic: rank // group_size for rank % group_size",
        summary="with an int reshard_after_forward=k, each rank's index in its post-forward "
        "group is shard_rank // k instead of shard_rank % k, so it keeps another rank's chunk "
        "after forward and backward re-all-gathers wrong parameters",
        patches=(
            Patch(f"{_FULLY_SHARD}:_get_post_forward_mesh_info", _post_forward_rank_div_not_mod),
            Patch(f"{_INIT}:_get_post_forward_mesh_info", _post_forward_rank_div_not_mod),
        ),
        origin=blind(
            TRAINING_KNOBS, "https://github.com/pytorch/pytorch/pull/118017", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/137348 ("[FSDP2] Fixed mistargeted backward
    # prefetch": an unshard without a wait makes the next iteration's unshard a no-op).
    Fault(
        id="fsdp.mistargeted_prefetch_survives_backward",
        area="optim",
        bug_class="stale buffer: a pending all-gather outlives the optimizer step",
        summary="an all-gather prefetched in backward (set_modules_to_backward_prefetch) for a "
        "module whose backward already ran is not cleared at the end of backward; the next "
        "forward of that module uses the parameters from before the optimizer step",
        patches=(
            Patch(f"{_PARAM_GROUP}:FSDPParamGroup.finalize_backward", _mistargeted_unshard_kept),
        ),
        origin=blind(
            TRAINING_KNOBS, "https://github.com/pytorch/pytorch/pull/137348", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/118223 (FSDP2 mixed precision: output_dtype casts
    # each FSDP module's forward output) and https://github.com/NVIDIA-NeMo/Automodel/pull/3657
    # (output_dtype handled at one boundary only).
    Fault(
        id="fsdp.root_output_dtype_not_cast",
        area="optim",
        bug_class="mixed precision: a cast skipped on one path",
        summary="MixedPrecisionPolicy(output_dtype=...) is applied to every FSDP module's "
        "output except the root's, whose output stays in param_dtype",
        patches=(Patch(f"{_STATE}:FSDPState._post_forward", _root_output_not_cast),),
        origin=blind(
            TRAINING_KNOBS,
            "https://github.com/pytorch/pytorch/pull/118223",
            "https://github.com/NVIDIA-NeMo/Automodel/pull/3657",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/90620 (MixedPrecision casting "forward arguments
    # and keyword arguments"; FSDP1's input cast once missed kwargs).
    Fault(
        id="fsdp.forward_kwargs_not_cast",
        area="optim",
        bug_class="mixed precision: inputs cast positionally only",
        summary="with cast_forward_inputs and a param_dtype, FSDP2 casts floating-point "
        "positional forward inputs but passes keyword-argument tensors through uncast",
        patches=(Patch(f"{_STATE}:FSDPState._cast_forward_inputs", _kwargs_not_cast),),
        origin=blind(
            TRAINING_KNOBS, "https://github.com/pytorch/pytorch/pull/90620", survived_before=True
        ),
    ),
    # https://github.com/pytorch/torchtitan/issues/1323 ("Why preserve_rng_state=False in
    # activation checkpointing") and https://github.com/allenai/OLMo-core/pull/828 (recompute
    # drew fresh dropout masks, so gradients were taken for another sample than the loss).
    Fault(
        id="ac.distributed_recompute_rng_not_restored",
        area="optim",
        bug_class="activation checkpointing: RNG state not replayed in the recomputation",
        summary="non-reentrant checkpoint (torch.utils.checkpoint, checkpoint_wrapper) of a "
        "tensor-parallel or FSDP2-wrapped region does not restore the forward's RNG state "
        "before recomputing, so dropout draws new masks and gradients are wrong",
        patches=(
            Patch(f"{_CHECKPOINT}:_checkpoint_without_reentrant_generator", _rng_not_restored),
        ),
        origin=blind(
            TRAINING_KNOBS,
            "https://github.com/pytorch/torchtitan/issues/1323",
            "https://github.com/allenai/OLMo-core/pull/828",
            survived_before=True,
        ),
    ),
)
