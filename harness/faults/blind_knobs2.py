"""Blind faults in training knobs around the data-parallel wrappers: activation checkpointing
of distributed modules, Adam's fused AMSGrad on DTensor parameters, the distributed state-dict
API's optimizer-state initialisation (a tensor learning rate, a call between backward and step)
and shared parameters, ZeroRedundancyOptimizer's bucket views and DDP-overlap bucket sharding.

Written blind, as a held-out set: by a contributor who read upstream's bug reports and
torch's source but not distconf's suites, strategies or specs, each fault standing for a
real upstream bug or bug class (the comment above it). Each bites only on the path its bug
lived on.

Against the suites as they were before (distconf 019c70d, same command as blind_knobs), 5 of
these 7 survived: distributed_recompute_rng_not_restored (no model had dropout),
init_optim_state_zeroes_tensor_lr and init_optim_state_wipes_grads (no state dict was taken
inside a step or with a tensor lr), shared_param_loaded_per_alias and
trainability_change_not_rebucketed. Now caught: the recompute fault by
optim.knobs.checkpointing_dropout (on rank processes, and on threads in a world of one: rank
threads share one generator), the others by state_dict.resume.mid_step,
hsdp.fully_shard.save_load (tied weights) and zero.param_groups.frozen. At first
init_optim_state_zeroes_tensor_lr was caught only at the nightly profile (its path, a
stateless optimizer with a tensor lr at a point without gradients, was one draw in
twenty-five); since half the mid-step cases also take a state dict at every point of every
step, the ci profile catches it within 7 examples.

Each patch was written for torch 2.13: a target that is gone raises FaultError when applied.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from harness.faults._patch import Fault, Patch, forcing_argument

_CHECKPOINT = "torch.utils.checkpoint"
_STATE_DICT = "torch.distributed.checkpoint.state_dict"
_ZERO = "torch.distributed.optim.zero_redundancy_optimizer"


# --- helpers ---------------------------------------------------------------------------------


def _any_dtensor(tensors: Iterable[Any]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in tensors)


def _is_distributed_region(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a checkpointed callable runs distributed state: DTensor inputs or parameters
    (tensor parallel), FSDP2 modules inside it, or inputs routed through an enclosing FSDP2
    module's pre-forward."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import FSDPModule

    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if _any_dtensor(tensors):
        return True
    if any(
        t.grad_fn is not None and "RegisterPostBackward" in type(t.grad_fn).__name__
        for t in tensors
    ):
        return True
    if isinstance(fn, nn.Module):
        return any(isinstance(m, FSDPModule) for m in fn.modules()) or _any_dtensor(fn.parameters())
    return False


def _optimizer_state_untouched(optim: Any) -> bool:
    """``_init_optim_state``'s precondition: no optimizer state and no gradients yet."""
    if optim.state:
        return False
    return all(p.grad is None for group in optim.param_groups for p in group["params"])


# --- activation checkpointing ----------------------------------------------------------------


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


# --- optimizer flags -------------------------------------------------------------------------


def _fused_amsgrad_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def _fused_adam(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("amsgrad") and _any_dtensor(bound.arguments["params"]):
            # The DTensor fused kernel is called without the AMSGrad flag and its buffers: the
            # running maximum is allocated and checkpointed but never used.
            bound.arguments["amsgrad"] = False
            bound.arguments["max_exp_avg_sqs"] = []
        return original(*bound.args, **bound.kwargs)

    return _fused_adam


def _tensor_lr_zeroed_in_place(original: Callable[..., Any]) -> Callable[..., Any]:
    def _init_optim_state(optim: Any) -> None:
        import torch

        if _optimizer_state_untouched(optim):
            for group in optim.param_groups:
                lr = group.get("lr")
                if isinstance(lr, torch.Tensor):
                    # Zeroed in place for the dummy step, so the saved reference that is
                    # "restored" afterwards is the zeroed tensor itself.
                    lr.zero_()
        original(optim)

    return _init_optim_state


def _grads_wiped_mid_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def _init_optim_state(optim: Any) -> None:
        if not optim.state:
            # The "gradients already exist, leave them alone" early return is gone: the dummy
            # zero-gradient step runs between backward and step and clears the real gradients.
            for group in optim.param_groups:
                for param in group["params"]:
                    param.grad = None
        original(optim)

    return _init_optim_state


# --- shared parameters -----------------------------------------------------------------------


def _every_alias_loaded(original: Callable[..., Any]) -> Callable[..., Any]:
    def _split_optim_state_dict(model: Any, optim: Any, optim_state_dict: Any, info: Any) -> Any:
        shared = info.shared_params_mapping
        info.shared_params_mapping = {}  # every FQN of a shared parameter counts as its own
        try:
            return original(model, optim, optim_state_dict, info)
        finally:
            info.shared_params_mapping = shared

    return _split_optim_state_dict


# --- ZeroRedundancyOptimizer -----------------------------------------------------------------


def _trainability_frozen_at_construction(original: Callable[..., Any]) -> Callable[..., Any]:
    def _get_is_trainable_mask(self: Any) -> list[bool]:
        cached = getattr(self, "_is_trainable_mask", None)
        if cached is not None:
            # Trainability changes are never detected, so the bucket views are never rebuilt.
            return list(cached)
        mask: list[bool] = original(self)
        return mask

    return _get_is_trainable_mask


FAULTS = (
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
    ),
    # https://github.com/pytorch/pytorch/pull/125369 (DTensor fused Adam, fixing #124633) with
    # the AMSGrad bug class of https://github.com/pytorch/pytorch/pull/4034 (the running maximum
    # kept but not used).
    Fault(
        id="optim.fused_amsgrad_dropped_for_dtensor",
        area="optim",
        bug_class="an optimizer flag dropped on one kernel path",
        summary="Adam/AdamW(fused=True, amsgrad=True) on DTensor parameters call the fused "
        "kernel with amsgrad=False, so AMSGrad degenerates to Adam; foreach and single-tensor "
        "paths are unaffected",
        patches=(Patch("torch.optim.adam:_fused_adam", _fused_amsgrad_dropped),),
    ),
    # https://github.com/pytorch/pytorch/issues/139575 ("_init_optim_state() should respect
    # tensor-ness of lr").
    Fault(
        id="state_dict.init_optim_state_zeroes_tensor_lr",
        area="state_dict",
        bug_class="aliasing: a value saved by reference and mutated in place",
        summary="the first get_optimizer_state_dict / get_state_dict / set_*_state_dict on an "
        "optimizer with a tensor lr and no state zeroes the lr tensor in place for the dummy "
        "step and restores that same tensor, so training continues with lr 0",
        patches=(Patch(f"{_STATE_DICT}:_init_optim_state", _tensor_lr_zeroed_in_place),),
    ),
    # https://github.com/pytorch/pytorch/issues/164929 ("get_optimizer_state_dict modifies
    # optimizer state": the dummy initialisation step's side effects on a live optimizer).
    Fault(
        id="state_dict.init_optim_state_wipes_grads",
        area="state_dict",
        bug_class="a state-dict read with side effects: gradients cleared mid-step",
        summary="get_optimizer_state_dict / get_state_dict called between backward and step on "
        "an optimizer without state (first step, or a stateless SGD) runs its zero-gradient "
        "initialisation step anyway and clears the real gradients, so the step does nothing",
        patches=(Patch(f"{_STATE_DICT}:_init_optim_state", _grads_wiped_mid_step),),
    ),
    # https://github.com/pytorch/pytorch/issues/128011, fixed by
    # https://github.com/pytorch/pytorch/pull/128685 (set_optimizer_state_dict assumed every FQN
    # of a shared parameter is in the optimizer state dict).
    Fault(
        id="state_dict.shared_param_loaded_per_alias",
        area="state_dict",
        bug_class="tied parameters: one parameter counted once per name",
        summary="set_optimizer_state_dict / set_state_dict treat each FQN of a tied parameter "
        "as a parameter of its own when splitting the state dict, so loading the optimizer of "
        "a model with tied weights fails (missing state, or a param group one entry too long)",
        patches=(Patch(f"{_STATE_DICT}:_split_optim_state_dict", _every_alias_loaded),),
    ),
    # https://github.com/pytorch/pytorch/pull/52764 ("[ZeroRedundancyOptimizer] Pack parameters
    # in tensor views, handle training change").
    Fault(
        id="zero.trainability_change_not_rebucketed",
        area="zero",
        bug_class="stale cache: a layout not rebuilt when its inputs change",
        summary="ZeroRedundancyOptimizer(parameters_as_bucket_view=True) never notices "
        "requires_grad changes, so a parameter frozen at construction and unfrozen later is "
        "updated by its owner rank but, being outside every bucket, never broadcast",
        patches=(
            Patch(
                f"{_ZERO}:ZeroRedundancyOptimizer._get_is_trainable_mask",
                _trainability_frozen_at_construction,
            ),
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/62750 ("Add support for multiple ZeRO buckets per
    # DDP bucket": each assignment records its offset into the DDP bucket's gradients).
    Fault(
        id="zero.overlap_shard_bucket_offset_zero",
        area="zero",
        bug_class="offset bookkeeping: every slice read from the start of the buffer",
        summary="DDP + ZeroRedundancyOptimizer(overlap_with_ddp=True) with hook_with_zero_step"
        "(shard_buckets=True) records offset 0 for every assignment, so a rank owning the tail "
        "of a split DDP bucket steps its parameters with the head's gradients",
        patches=(
            Patch(
                f"{_ZERO}:ZeroRedundancyOptimizer._assign_bucket_subset_to_rank",
                forcing_argument("bucket_offset", 0),
            ),
        ),
    ),
)
