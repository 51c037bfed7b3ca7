"""Blind faults in FSDP2's training knobs: custom gradient divide factors and sum-only
reductions, HSDP's replicate all-reduce, gradient accumulation across micro-batches, resharding
to a smaller post-forward group and explicit prefetching, MixedPrecisionPolicy's input and
output casts, meta-device initialisation and lazy re-padding of sharded parameters.

Written blind, as a held-out set: by a contributor who read upstream's bug reports and
torch's source but not distconf's suites, strategies or specs, each fault standing for a
real upstream bug or bug class (the comment above it). Each bites only on the path its bug
lived on (a custom divide factor, HSDP, several micro-batches, an int reshard_after_forward,
a mistargeted prefetch, output_dtype, keyword inputs, an unevenly sharded parameter).

Against the suites as they were before (distconf 019c70d; `mutate --suite optim_parity,hsdp,
state_dict,fsdp_init,zero,tp --profile dev --seed 1`), 9 of these 12 survived:
custom_divide_factor_all_reduce_averaged, force_sum_ignores_divide_factor,
single_rank_shard_divide_factor_dropped, partial_reduce_added_after_all_reduce,
unsynced_reduce_dtype_grad_replaced, post_forward_rank_div_not_mod,
mistargeted_prefetch_survives_backward, root_output_dtype_not_cast, forward_kwargs_not_cast:
no property turned a divide factor, held an all-reduce, resharded to an int, prefetched, cast
an output or called the model with a keyword. The knob properties (optim.knobs.*, the
mixed-precision property's per-module policies with micro-batches) catch all twelve at the
ci profile; at the dev profile's two examples per world size six still pass unnoticed.

Each patch was written for torch 2.13: a target that is gone raises FaultError when applied.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from harness.faults._patch import Fault, Patch, rewritten

_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param"
_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
_STATE = "torch.distributed.fsdp._fully_shard._fsdp_state"
_INIT = "torch.distributed.fsdp._fully_shard._fsdp_init"
_FULLY_SHARD = "torch.distributed.fsdp._fully_shard._fully_shard"

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]
DivideFactors = tuple[float | None, float | None, Any, Any]


# --- gradient divide factors -----------------------------------------------------------------


def _divide_factors_edited(
    edit: Callable[[DivideFactors, dict[str, Any]], DivideFactors],
) -> Wrap:
    """A wrap of ``_get_gradient_divide_factors`` whose result passes through ``edit(result,
    arguments)`` (the arguments by name)."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def _get_gradient_divide_factors(
            reduce_scatter_group: Any,
            all_reduce_group: Any,
            reduce_dtype: Any,
            device_type: str = "",
            factor: float | None = None,
            force_sum_reduction_for_comms: bool = False,
        ) -> DivideFactors:
            arguments = {
                "reduce_scatter_group": reduce_scatter_group,
                "all_reduce_group": all_reduce_group,
                "reduce_dtype": reduce_dtype,
                "device_type": device_type,
                "factor": factor,
                "force_sum_reduction_for_comms": force_sum_reduction_for_comms,
            }
            result: DivideFactors = original(**arguments)
            return edit(result, arguments)

        return _get_gradient_divide_factors

    return wrap


def _custom_factor_all_reduce_averaged(
    result: DivideFactors, arguments: dict[str, Any]
) -> DivideFactors:
    pre, post, reduce_scatter_op, _ = result
    if arguments["factor"] is None or arguments["all_reduce_group"] is None:
        return result
    if pre is not None or post is not None:  # the sum-only path scales by hand
        return result
    from torch.distributed import ReduceOp

    # The replicate all-reduce keeps averaging although the custom factor already covers it.
    return pre, post, reduce_scatter_op, ReduceOp.AVG


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


# --- gradient accumulation -------------------------------------------------------------------

# HSDP with set_requires_all_reduce(False): the partial reduce-scatter output of earlier
# micro-batches is added after the last micro-batch's all-reduce instead of before it.
_PARTIAL_AFTER_ALL_REDUCE_EDITS = (
    (
        "                reduce_output += partial_reduce_output\n",
        "                pass\n",
    ),
    (
        "                all_reduce_input = reduce_output\n",
        "                if partial_reduce_output is not None:\n"
        "                    reduce_output += partial_reduce_output\n"
        "                all_reduce_input = reduce_output\n",
    ),
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


# --- resharding ------------------------------------------------------------------------------


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


# --- mixed precision -------------------------------------------------------------------------


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


# --- initialisation and re-padding -----------------------------------------------------------

# FSDPParam.reset_sharded_param without its idempotency check: lazy init re-pads an unevenly
# sharded parameter into a new tensor although it is already padded.
_REPAD_ALWAYS_EDIT = (
    "    if local_tensor.size() != padded_sharded_size and not same_local_tensor:\n",
    "    same_local_tensor = False\n"
    "    if local_tensor.size() != padded_sharded_size and not same_local_tensor:\n",
)

# FSDPParam.reset_sharded_param after nn.Module._apply (to_empty, .to(...)): the padded copy
# becomes the all-gather source, but the DTensor parameter keeps its old local tensor.
_PADDED_NOT_REBOUND_EDIT = (
    "    if updated_local_tensor:\n",
    "    if updated_local_tensor and self.pin_memory:\n",
)


FAULTS = (
    # https://github.com/pytorch/pytorch/issues/155903 (set_reduce_scatter_divide_factor is
    # inconsistent between FSDP and HSDP: on HSDP the replicate all-reduce still averaged).
    Fault(
        id="hsdp.custom_divide_factor_all_reduce_averaged",
        area="hsdp",
        bug_class="divide factor applied twice: a custom factor plus the replicate average",
        summary="with set_gradient_divide_factor on HSDP, the replicate all-reduce uses "
        "ReduceOp.AVG instead of SUM, so gradients are divided by the custom factor and again "
        "by the replicate size; FSDP, HSDP without a custom factor and the sum-only path are "
        "unaffected",
        patches=(
            Patch(
                f"{_COLLECTIVES}:_get_gradient_divide_factors",
                _divide_factors_edited(_custom_factor_all_reduce_averaged),
            ),
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
                _divide_factors_edited(_fp16_postdivide_by_whole_factor),
            ),
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
    ),
    # https://github.com/pytorch/pytorch/pull/125484 ("we need to perform an accumulation step
    # after reduce-scatter and before all-reduce. If not, then the preceding microbatch's
    # gradients will not be contributed across the replica group"); API in #126166.
    Fault(
        id="hsdp.partial_reduce_added_after_all_reduce",
        area="hsdp",
        bug_class="gradient accumulation: earlier micro-batches never synchronised",
        summary="HSDP with set_requires_all_reduce(False) on earlier micro-batches adds their "
        "reduce-scattered partial sums after the last micro-batch's replicate all-reduce, so "
        "each replica keeps its own earlier micro-batches",
        patches=(
            Patch(f"{_PARAM_GROUP}:foreach_reduce", rewritten(*_PARTIAL_AFTER_ALL_REDUCE_EDITS)),
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
    ),
    # https://github.com/pytorch/pytorch/pull/163130 and
    # https://github.com/pytorch/torchtitan/issues/1136 (a state dict taken before the first
    # forward went stale: lazy init re-padded the local tensors).
    Fault(
        id="fsdp.lazy_init_repads_cached_params",
        area="state_dict",
        bug_class="stale reference: an idempotent re-initialisation that reallocates",
        summary="FSDP2's lazy init re-pads every unevenly sharded parameter into a new local "
        "tensor even when it is already padded, so a state_dict() (or any reference to the "
        "local shards) taken before the first forward stops tracking training",
        patches=(Patch(f"{_PARAM}:FSDPParam.reset_sharded_param", rewritten(_REPAD_ALWAYS_EDIT)),),
    ),
    # https://github.com/pytorch/pytorch/pull/120351 ("[FSDP2] Added initial meta-device init
    # support": _apply must pad new local tensors and use the padded ones).
    Fault(
        id="fsdp.meta_init_padded_copy_not_rebound",
        area="fsdp_init",
        bug_class="two copies of one parameter: updates go to one, the collective reads the other",
        summary="after to_empty()/_apply on an FSDP2 module, an unevenly sharded parameter's "
        "padded copy becomes the all-gather source but the DTensor parameter keeps its old "
        "local tensor, so reset_parameters() and optimizer steps never reach forward",
        patches=(
            Patch(f"{_PARAM}:FSDPParam.reset_sharded_param", rewritten(_PADDED_NOT_REBOUND_EDIT)),
        ),
    ),
)
