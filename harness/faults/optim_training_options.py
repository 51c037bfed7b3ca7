"""Faults in the options of a training run around the optimizer step, written blind in the
training options set: FSDP2's gradient-sync switches and mixed-precision reduction, DDP's join
and PowerSGD hook, RAdam's and Rprop's foreach kernels, clip_grad_value_, lr schedulers resumed
with last_epoch, and activation checkpointing (autocast in the recomputation, inputs that do
not require grad). Each bites only on the path its upstream bug lived on. Nothing here imports
torch until a fault is applied."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._origin import blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import forcing_argument, rewritten
from harness.faults.held_out import TRAINING_OPTIONS

_FSDP = "torch.distributed.fsdp._fully_shard"
_DDP = "torch.nn.parallel.distributed"
_POWERSGD = "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook"
_CLIP = "torch.nn.utils.clip_grad"
_SCHED = "torch.optim.lr_scheduler"
_CKPT = "torch.utils.checkpoint"
_WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"


# --- FSDP2 ----------------------------------------------------------------------------------

# set_requires_gradient_sync(True) (recurse=True by default) re-enables the module it is called
# on only: submodules left disabled by an earlier set_requires_gradient_sync(False) stay so.
_SYNC_NOT_RECURSED_ON_ENABLE = (
    "modules = list(self_module.modules()) if recurse else [self_module]",
    "modules = (\n"
    "        list(self_module.modules())\n"
    "        if recurse and not requires_gradient_sync\n"
    "        else [self_module]\n"
    "    )",
)

# The reduce-scatter / all-reduce of a parameter group runs in the gradients' own dtype (the
# param_dtype) instead of MixedPrecisionPolicy.reduce_dtype.
_REDUCE_DTYPE_DROPPED = (
    "self._reduce_dtype,\n",
    "None,\n",
)


# --- DDP ------------------------------------------------------------------------------------

# PowerSGD's iteration counter counts every bucket instead of one per iteration.
_ITER_PER_BUCKET = (
    "if bucket.is_last():",
    "if bucket is not None:",
)


# --- optimizers, clipping, lr schedulers ----------------------------------------------------

_RADAM_EPS_DROPPED = (
    "torch._foreach_add_(buffer, eps)",
    "pass",
)
_RPROP_MAXIMIZE_PREV = (
    "torch._foreach_neg_(grouped_prevs)",
    "pass",
)
_CLIP_VALUE_MIN_DROPPED = (
    "torch._foreach_clamp_min_(cast(list[Tensor], grads), -clip_value)",
    "pass",
)
_RESUME_BASE_LRS_FROM_LR = (
    'optimizer, "initial_lr"',
    'optimizer, "initial_lr" if last_epoch == -1 else "lr"',
)


# --- activation checkpointing ---------------------------------------------------------------

# The reentrant recomputation re-enters the forward's CPU autocast state only when it also
# restores the RNG state (preserve_rng_state=True).
_AUTOCAST_TIED_TO_RNG = (
    'torch.amp.autocast("cpu", **ctx.cpu_autocast_kwargs)',
    'torch.amp.autocast("cpu", **(ctx.cpu_autocast_kwargs if ctx.preserve_rng_state '
    'else {"enabled": False}))',
)


def _no_grad_inputs_detached(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        import torch
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
        from torch.utils._pytree import tree_leaves

        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if (
            self.checkpoint_impl == CheckpointImpl.NO_REENTRANT
            and torch.is_grad_enabled()
            and not any(t.requires_grad for t in tensors)
        ):
            # The reentrant limitation on the non-reentrant path: with no input requiring
            # grad, the checkpointed region is run without recording a graph, so its
            # parameters get no gradient (the output no longer requires grad).
            with torch.no_grad():
                return original(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return forward


FAULTS: tuple[Fault, ...] = (
    # https://github.com/pytorch/pytorch/pull/124318 ([FSDP2] Fixed set_requires_gradient_sync's
    # recurse arg: "The recurse argument was not being respected"). Mechanism: recurse not
    # respected, on the re-enabling call.
    Fault(
        id="fsdp.gradient_sync_reenabled_without_recurse",
        area="optim",
        bug_class="a setter's recurse flag not respected: a collective skipped for good",
        summary="FSDPModule.set_requires_gradient_sync(True) (recurse=True) re-enables "
        "gradient reduction on the module it is called on only: after a "
        "set_requires_gradient_sync(False) window (gradient accumulation without "
        "communication), the nested fully_shard modules never reduce-scatter again, so their "
        "sharded gradients stay None/stale and their unsharded gradients keep accumulating; "
        "runs that never disable sync, and the root's own parameters, are untouched",
        patches=(
            Patch(
                f"{_FSDP}._fully_shard:FSDPModule.set_requires_gradient_sync",
                rewritten(_SYNC_NOT_RECURSED_ON_ENABLE),
            ),
        ),
        origin=blind(
            TRAINING_OPTIONS,
            "https://github.com/pytorch/pytorch/pull/124318",
            survived_before=False,
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/190626 and
    # https://github.com/pytorch/pytorch/pull/190627 ([FSDP2] MixedPrecisionPolicy reduce_dtype
    # not applied to a gradient reduction: "half of the 2D reduction still happened in bf16").
    # Mechanism: the reduction runs in the gradient's own (param) dtype.
    Fault(
        id="fsdp.reduce_dtype_ignored_in_reduce_scatter",
        area="optim",
        bug_class="mixed precision: a reduction run in the low-precision dtype",
        summary="with MixedPrecisionPolicy(param_dtype=bf16/fp16, reduce_dtype=fp32), FSDP2 "
        "reduce-scatters (and HSDP all-reduces) the gradients in param_dtype instead of "
        "reduce_dtype, then casts the result up: the sharded gradients carry the rounding of "
        "a low-precision sum; policies without a param_dtype, or with reduce_dtype equal to "
        "it, are untouched",
        patches=(
            Patch(
                f"{_FSDP}._fsdp_param_group:FSDPParamGroup.post_backward",
                rewritten(_REDUCE_DTYPE_DROPPED),
            ),
        ),
        origin=blind(
            TRAINING_OPTIONS,
            "https://github.com/pytorch/pytorch/issues/190626",
            "https://github.com/pytorch/pytorch/pull/190627",
            survived_before=False,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/42577 (Join-based API to support DDP uneven
    # inputs: gradients divided by the static world size, where the previous version divided
    # by the effective one) and https://github.com/pytorch/pytorch/issues/38174. Mechanism:
    # the divide_by_initial_world_size choice lost.
    Fault(
        id="ddp.join_divides_by_active_ranks",
        area="optim",
        bug_class="gradient scaling: the data-parallel mean taken over the wrong count",
        summary="DistributedDataParallel.join() (Join([ddp])) ignores "
        "divide_by_initial_world_size=True (the default): once a rank has run out of inputs, "
        "the ranks still training divide the all-reduced gradients by the number of ranks "
        "not yet joined instead of the initial world size, so late steps are scaled up; even "
        "inputs (no rank joins early) and divide_by_initial_world_size=False are untouched",
        patches=(
            Patch(
                f"{_DDP}:_DDPJoinHook.__init__",
                forcing_argument("divide_by_initial_world_size", False),
            ),
        ),
        origin=blind(
            TRAINING_OPTIONS,
            "https://github.com/pytorch/pytorch/pull/42577",
            "https://github.com/pytorch/pytorch/issues/38174",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/53010 ([Gradient Compression] is_the_last_bucket_
    # to_allreduce: "To determine the boundary between different iterations in a DDP
    # communication hook") and https://github.com/pytorch/pytorch/issues/63210 (GradBucket
    # .is_last() returned is-first). Mechanism: the iteration boundary misdetected.
    Fault(
        id="ddp.powersgd_iter_counted_per_bucket",
        area="optim",
        bug_class="an iteration counter advanced per bucket: a warm-up phase cut short",
        summary="PowerSGDState.maybe_increase_iter counts every bucket as an iteration, so "
        "with k gradient buckets (a small bucket_cap_mb, or a large model) powerSGD_hook / "
        "batched_powerSGD_hook start lossy low-rank compression after start_powerSGD_iter / "
        "k iterations instead of start_powerSGD_iter (vanilla all-reduce before that); a "
        "single bucket is untouched",
        patches=(
            Patch(f"{_POWERSGD}:PowerSGDState.maybe_increase_iter", rewritten(_ITER_PER_BUCKET)),
        ),
        origin=blind(
            TRAINING_OPTIONS,
            "https://github.com/pytorch/pytorch/pull/53010",
            "https://github.com/pytorch/pytorch/issues/63210",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/92551 ([optim][radam] fix eps discrepancy for
    # foreach: "eps was not being used at all in the mta/foreach impl") and
    # https://github.com/pytorch/pytorch/pull/70230. Mechanism: the bug re-introduced.
    Fault(
        id="optim.radam_foreach_eps_dropped",
        area="optim",
        bug_class="foreach and single-tensor kernels disagree (a term dropped on one path)",
        summary="RAdam's foreach kernel divides by sqrt(v_t) instead of sqrt(v_t) + eps in "
        "the rectified step, so parameters with small second moments (zero gradient "
        "entries) take huge or non-finite steps; the single-tensor kernel and unrectified "
        "(early) steps are untouched",
        patches=(Patch("torch.optim.radam:_multi_tensor_radam", rewritten(_RADAM_EPS_DROPPED)),),
        origin=blind(
            TRAINING_OPTIONS,
            "https://github.com/pytorch/pytorch/pull/92551",
            "https://github.com/pytorch/pytorch/pull/70230",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/105193 ([optim][rprop] minimize intermediates for
    # foreach: the maximize negation moved from the grads to the signs while prevs' memory was
    # reused for the grads) and https://github.com/pytorch/pytorch/issues/106221. Mechanism:
    # one of the two negations lost in that refactor.
    Fault(
        id="optim.rprop_foreach_maximize_prev_not_negated",
        area="optim",
        bug_class="maximize applied on one of two uses of the gradient",
        summary="Rprop's foreach kernel with maximize=True keeps the un-negated gradient as "
        "prev and as the step direction: parameters move to minimize, and the next step's "
        "sign test is inverted; maximize=False and the single-tensor kernel are untouched",
        patches=(Patch("torch.optim.rprop:_multi_tensor_rprop", rewritten(_RPROP_MAXIMIZE_PREV)),),
        origin=blind(
            TRAINING_OPTIONS,
            "https://github.com/pytorch/pytorch/pull/105193",
            "https://github.com/pytorch/pytorch/issues/106221",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/91846 (Foreach gradient clipping) and
    # https://github.com/pytorch/pytorch/pull/91384 (Foreach clamp_min clamp_max). Mechanism:
    # the foreach rewrite of clip_grad_value_ keeps one of its two clamps.
    Fault(
        id="optim.clip_grad_value_foreach_lower_bound_dropped",
        area="optim",
        bug_class="foreach and per-tensor paths disagree (a clamp lost on one path)",
        summary="clip_grad_value_ on the foreach path (foreach=None with plain CPU tensors, "
        "or foreach=True) clamps gradients from above only: entries below -clip_value are "
        "left as they are; foreach=False clamps both ways",
        patches=(
            Patch(f"{_CLIP}:clip_grad_value_", rewritten(_CLIP_VALUE_MIN_DROPPED)),
            Patch("torch.nn.utils:clip_grad_value_", rewritten(_CLIP_VALUE_MIN_DROPPED)),
        ),
        origin=blind(
            TRAINING_OPTIONS,
            "https://github.com/pytorch/pytorch/pull/91846",
            "https://github.com/pytorch/pytorch/pull/91384",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/60265 (LR Scheduler bug when resuming training
    # from checkpoint: the new scheduler takes the lr already in the optimizer's param groups
    # as its starting point) and https://github.com/pytorch/pytorch/issues/65342. Mechanism:
    # the base lrs of a resumed scheduler read from the current lr, not initial_lr.
    Fault(
        id="optim.scheduler_resume_base_lrs_from_current_lr",
        area="optim",
        bug_class="LR schedule: a resumed schedule anchored on the decayed lr",
        summary="an lr scheduler constructed with last_epoch >= 0 (resuming) takes its "
        "base_lrs from each group's current lr instead of its initial_lr, so closed-form "
        "schedules (LambdaLR, MultiplicativeLR's first step, CosineAnnealingLR, PolynomialLR, "
        "...) restart from an already decayed lr; last_epoch=-1, and a load_state_dict after "
        "construction (which restores base_lrs), are untouched",
        patches=(Patch(f"{_SCHED}:LRScheduler.__init__", rewritten(_RESUME_BASE_LRS_FROM_LR)),),
        origin=blind(
            TRAINING_OPTIONS,
            "https://github.com/pytorch/pytorch/issues/60265",
            "https://github.com/pytorch/pytorch/issues/65342",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/71169 (Propagate full autocast state to
    # CheckpointFunction's forward-inside-backward) and
    # https://github.com/pytorch/pytorch/pull/172802 ([AC] respect fwd device context during
    # recompute). Mechanism: the recomputation does not re-enter the forward's autocast state
    # (here: when it does not restore the RNG state either).
    Fault(
        id="ac.reentrant_recompute_autocast_tied_to_rng",
        area="optim",
        bug_class="activation checkpointing: recomputation under a different autocast state",
        summary="reentrant checkpoint (use_reentrant=True, CheckpointImpl.REENTRANT) with "
        "preserve_rng_state=False recomputes the region without the forward's CPU autocast: "
        "under torch.autocast('cpu', bf16) the gradients are those of an fp32 region, not "
        "of the bf16 one the forward ran (no error: reentrant checkpoint checks no "
        "metadata); preserve_rng_state=True and runs without autocast are untouched",
        patches=(
            Patch(
                f"{_CKPT}:CheckpointFunction.backward",
                rewritten(_AUTOCAST_TIED_TO_RNG, undecorated=True),
            ),
        ),
        origin=blind(
            TRAINING_OPTIONS,
            "https://github.com/pytorch/pytorch/pull/71169",
            "https://github.com/pytorch/pytorch/pull/172802",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/6884 (checkpoint inputs that do not require
    # grad), https://github.com/InternLM/xtuner/pull/2048 ("the reentrant checkpoint receives
    # no tensor requiring gradients ... all trainable parameters keep grad=None") and
    # https://github.com/deepspeedai/DeepSpeed/pull/4118. Mechanism: the reentrant limitation
    # re-created on the non-reentrant path of checkpoint_wrapper / apply_activation_checkpointing.
    Fault(
        id="ac.wrapper_no_grad_inputs_params_dropped",
        area="optim",
        bug_class="activation checkpointing: a region cut out of the autograd graph",
        summary="checkpoint_wrapper with CheckpointImpl.NO_REENTRANT (the default of "
        "apply_activation_checkpointing) called while no tensor input requires grad (the "
        "first checkpointed layer of a model, frozen embeddings): the region runs without "
        "recording a graph, so its parameters get no gradient (grad stays None) while the "
        "rest of the model trains; inputs that require grad are untouched",
        patches=(Patch(f"{_WRAPPER}:CheckpointWrapper.forward", _no_grad_inputs_detached),),
        origin=blind(
            TRAINING_OPTIONS,
            "https://github.com/pytorch/pytorch/issues/6884",
            "https://github.com/InternLM/xtuner/pull/2048",
            "https://github.com/deepspeedai/DeepSpeed/pull/4118",
            survived_before=False,
        ),
    ),
)
