"""Faults around the optimizer step of a training run: activation checkpointing of its layers,
DDP's options and communication hooks, gradient clipping and lr schedulers, and the kernels
of optimizers beyond SGD and Adam (Adamax, NAdam, ASGD). Each bites only on the path its
upstream bug lived on. Nothing here imports torch until a fault is applied."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from harness.faults._origin import blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import rewritten
from harness.faults.held_out import TRAINING_SURFACE

_CKPT = "torch.utils.checkpoint"
_WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks.default_hooks"
_DDP = "torch.nn.parallel.distributed"
_CLIP = "torch.nn.utils.clip_grad"
_SCHED = "torch.optim.lr_scheduler"


# --- activation checkpointing -------------------------------------------------------------


def _reentrant_rng_not_restored(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(ctx: Any, *args: Any) -> Any:
        # The forward stashed its RNG state, but the recomputation runs without forking and
        # restoring it: dropout inside the region draws fresh masks in the recompute.
        ctx.preserve_rng_state = False
        return original(ctx, *args)

    return backward


# In the recomputation, a cached (saved) SAC output of an op is handed to the invocation of
# that op whose slot comes last among the still-unconsumed saved ones (the entries are
# swapped, so every saved invocation still consumes exactly one entry).
_SAC_SWAP = (
    "entry = func_storage.get(idx)\n",
    "entry = func_storage.get(idx)\n"
    "    if entry is not None and entry is not _CONSUMED and entry is not _RECOMPUTE:\n"
    "        _last = max(i for i, e in func_storage.items()\n"
    "                    if e is not _CONSUMED and e is not _RECOMPUTE)\n"
    "        if _last != idx:\n"
    "            entry, func_storage[_last] = func_storage[_last], entry\n",
)

# Reentrant checkpoint_wrapper with keyword arguments: the packed kwargs are unpacked in the
# forward (run under no_grad) but dropped in the recomputation (run under enable_grad).
_KWARGS_DROPPED = (
    "unpacked_args, unpacked_kwargs = _unpack_kwargs(inputs, kwarg_keys)\n",
    "unpacked_args, unpacked_kwargs = _unpack_kwargs(inputs, kwarg_keys)\n"
    "            if torch.is_grad_enabled():\n"
    "                unpacked_kwargs = {}\n",
)


# --- DDP ------------------------------------------------------------------------------------


def _fp16_divided_twice(original: Callable[..., Any]) -> Callable[..., Any]:
    def _compress_hook(dtype: Any, process_group: Any, bucket: Any) -> Any:
        import torch
        import torch.distributed as dist

        fut = original(dtype, process_group, bucket)
        if dtype is not torch.float16 or torch.compiler.is_compiling():
            return fut
        world_size = dist.get_world_size(process_group)

        # The division was moved before the all-reduce (to avoid fp16 overflow) but the old
        # post-division in decompress was kept: the mean is divided by the world size again.
        def divide_again(f: Any) -> Any:
            return f.value().div_(world_size)

        return fut.then(divide_again)

    return _compress_hook


def _no_sync_marks(original: Callable[..., Any]) -> Callable[..., Any]:
    @contextlib.contextmanager
    def no_sync(self: Any) -> Any:
        with original(self):
            yield
        if self.static_graph:
            self._distconf_accumulated = True

    return no_sync


def _static_graph_unsynced(original: Callable[..., Any]) -> Callable[..., Any]:
    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not (
            self.static_graph
            and getattr(self, "_distconf_accumulated", False)
            and self._static_graph_delay_allreduce_enqueued
            and self.require_backward_grad_sync
        ):
            return original(self, *args, **kwargs)
        # The reducer's per-iteration bookkeeping went wrong in the no_sync window: the
        # syncing forward/backward no longer prepares the reducer, nothing is all-reduced.
        self.require_backward_grad_sync = False
        try:
            return original(self, *args, **kwargs)
        finally:
            self.require_backward_grad_sync = True

    return hook


# --- gradient clipping and LR schedulers --------------------------------------------------

_COEF_UNCLAMPED = (
    "torch._foreach_mul_(device_grads, clip_coef_clamped.to(device))",
    "torch._foreach_mul_(device_grads, clip_coef.to(device))",
)
_NONFINITE_NAN_ONLY = (
    "if error_if_nonfinite and torch.logical_or(total_norm.isnan(), total_norm.isinf()):",
    "if error_if_nonfinite and total_norm.isnan():",
)
_SEQUENTIAL_FIRST = (
    "idx = bisect_right(self._milestones, 0)",
    "idx = 0",
)


def _lambda_base_lrs_collapsed(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_lr(self: Any) -> Any:
        base_lrs = self.base_lrs
        # Every group's base lr is taken from the first param group.
        self.base_lrs = [base_lrs[0]] * len(base_lrs)
        try:
            return original(self)
        finally:
            self.base_lrs = base_lrs

    return get_lr


# --- optimizers ---------------------------------------------------------------------------

_ADAMAX_ABS_INPLACE = (
    "grouped_grads = torch._foreach_abs(grouped_grads)  # type: ignore[assignment]",
    "torch._foreach_abs_(grouped_grads)",
)
_NADAM_MU_TWICE = (
    "mu_product_next = _get_value(mu_product) * mu_next",
    "mu_product_next = _get_value(mu_product) * mu * mu_next",
)
_ASGD_FIRST_STEP_ETA = (
    "torch.as_tensor(lr / ((1 + lambd * lr * step) ** alpha), device=device)",
    "torch.as_tensor(lr / ((1 + lambd * lr * grouped_state_steps[0]) ** alpha), device=device)",
)
_ASGD_FIRST_STEP_MU = (
    "torch.as_tensor(1 / max(1, _get_value(step) - t0), device=device)",
    "torch.as_tensor(1 / max(1, _get_value(grouped_state_steps[0]) - t0), device=device)",
)


FAULTS: tuple[Fault, ...] = (
    # https://github.com/pytorch/pytorch/pull/14253 (preserve_rng_state: checkpointed dropout
    # lost bitwise parity because the recompute drew new random numbers) and
    # https://github.com/pytorch/pytorch/pull/91265 (RNG states not restored for reentrant
    # checkpointing in the composable API). Mechanism: the reentrant backward recomputes
    # without forking/restoring the forward's RNG state.
    Fault(
        id="ac.reentrant_recompute_rng_not_restored",
        area="optim",
        bug_class="activation checkpointing: RNG state not replayed in the recomputation",
        summary="reentrant checkpoint (use_reentrant=True, CheckpointImpl.REENTRANT) ignores "
        "preserve_rng_state in backward: CheckpointFunction.backward recomputes without "
        "restoring the forward's CPU/device RNG state, so random ops (dropout) in the region "
        "draw new masks and gradients are wrong; non-reentrant checkpoint is untouched",
        patches=(Patch(f"{_CKPT}:CheckpointFunction.backward", _reentrant_rng_not_restored),),
        origin=blind(
            TRAINING_SURFACE,
            "https://github.com/pytorch/pytorch/pull/14253",
            "https://github.com/pytorch/pytorch/pull/91265",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/175258 (SAC: all regions shared one FIFO queue
    # per op, so a skipped region made the recompute take the wrong cached entry; see the
    # comment on _sac_storage_key). Mechanism: a saved output is matched to the wrong
    # invocation of the same op in the recompute.
    Fault(
        id="ac.sac_cached_outputs_misordered",
        area="optim",
        bug_class="selective activation checkpointing: cached output matched to the wrong "
        "invocation",
        summary="in the recomputation of selective activation checkpointing "
        "(create_selective_checkpoint_contexts), an op whose outputs were saved "
        "(MUST_SAVE/PREFER_SAVE) at several invocations in one region gets them back in "
        "the wrong order (each saved invocation takes the last still-unconsumed saved entry "
        "of that op); with one saved invocation per op, or recompute-only policies, nothing "
        "changes",
        patches=(
            Patch(f"{_CKPT}:_CachedTorchDispatchMode.__torch_dispatch__", rewritten(_SAC_SWAP)),
        ),
        origin=blind(
            TRAINING_SURFACE,
            "https://github.com/pytorch/pytorch/issues/175258",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/84908 ([CheckpointWrapper] reentrant kwarg
    # support: kwargs packed into positional inputs and unpacked inside the checkpointed
    # function) and https://github.com/pytorch/pytorch/pull/80987 (kwargs for non-reentrant
    # checkpoint). Mechanism: the keyword arguments reach the forward but not the recompute.
    Fault(
        id="ac.wrapper_reentrant_kwargs_dropped_in_recompute",
        area="optim",
        bug_class="activation checkpointing: recomputation runs with different inputs",
        summary="checkpoint_wrapper with CheckpointImpl.REENTRANT called with keyword "
        "arguments: the forward sees them, but the backward recomputation calls the wrapped "
        "module without them (their defaults), so activations and gradients are those of "
        "another call; calls without kwargs and NO_REENTRANT are untouched",
        patches=(Patch(f"{_WRAPPER}:CheckpointWrapper.forward", rewritten(_KWARGS_DROPPED)),),
        origin=blind(
            TRAINING_SURFACE,
            "https://github.com/pytorch/pytorch/pull/84908",
            "https://github.com/pytorch/pytorch/pull/80987",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/57410 and
    # https://github.com/pytorch/pytorch/pull/59522 ([Gradient Compression] apply division
    # first to avoid overflow; "applied to both C++ and Python comm hooks"). Mechanism: the
    # division moved before the all-reduce, the old one after it left in place.
    Fault(
        id="ddp.fp16_compress_hook_divided_twice",
        area="optim",
        bug_class="gradient scaling: data-parallel mean divided by the world size twice",
        summary="DDP's fp16_compress_hook divides the fp16 bucket by the world size before "
        "the all-reduce and again after decompressing, so gradients are sum / world_size**2; "
        "bf16_compress_hook, allreduce_hook and the default reducer are untouched (a world "
        "of one is unaffected)",
        patches=(Patch(f"{_HOOKS}:_compress_hook", _fp16_divided_twice),),
        origin=blind(
            TRAINING_SURFACE,
            "https://github.com/pytorch/pytorch/pull/57410",
            "https://github.com/pytorch/pytorch/pull/59522",
            survived_before=False,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/187732 ([DDP] Fix static_graph=True + no_sync()
    # gradient accumulation regression: "silently stops all-reducing gradients from the
    # second iteration on") and https://github.com/huggingface/accelerate/issues/3679.
    Fault(
        id="ddp.static_graph_no_sync_stops_reducing",
        area="optim",
        bug_class="a collective skipped: gradient accumulation with static_graph stops syncing",
        summary="DistributedDataParallel(static_graph=True) after a no_sync() window (once "
        "the first iteration's delayed all-reduce has run): syncing forwards/backwards no "
        "longer prepare the reducer, so gradients stay rank-local from then on; "
        "static_graph=False and static graphs that never use no_sync are untouched (in torch "
        "2.13 unpatched, no_sync inside the very first static-graph iteration already fails "
        "with an expect_autograd_hooks_ assert, the crash half of the report)",
        patches=(
            Patch(f"{_DDP}:DistributedDataParallel.no_sync", _no_sync_marks),
            Patch(f"{_DDP}:DistributedDataParallel._pre_forward", _static_graph_unsynced),
            Patch(f"{_DDP}:DistributedDataParallel._post_forward", _static_graph_unsynced),
        ),
        origin=blind(
            TRAINING_SURFACE,
            "https://github.com/pytorch/pytorch/pull/187732",
            "https://github.com/huggingface/accelerate/issues/3679",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/60691 and
    # https://github.com/pytorch/pytorch/pull/61042 (clip_grad_norm_: the `if clip_coef < 1`
    # branch replaced by clamp(max=1.0) and an unconditional multiply). Mechanism: the clamp
    # lost on one (the foreach) path, so small gradients are scaled up.
    Fault(
        id="optim.clip_foreach_coef_unclamped",
        area="optim",
        bug_class="foreach and per-tensor paths disagree (a clamp lost on one path)",
        summary="clip_grad_norm_ / clip_grads_with_norm_ on the foreach path (foreach=True, or "
        "foreach=None with plain tensors) multiply gradients by max_norm / (total_norm + "
        "1e-6) unclamped, scaling them UP when the total norm is below max_norm; the "
        "per-tensor path (foreach=False, DTensor gradients with foreach=None) still clamps "
        "to 1",
        patches=(
            Patch(f"{_CLIP}:_clip_grads_with_norm_", rewritten(_COEF_UNCLAMPED)),
            Patch("torch.nn.utils:clip_grads_with_norm_", rewritten(_COEF_UNCLAMPED)),
        ),
        origin=blind(
            TRAINING_SURFACE,
            "https://github.com/pytorch/pytorch/issues/60691",
            "https://github.com/pytorch/pytorch/pull/61042",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/61042 (the NaN/Inf checks combined with
    # logical_or into one sync) and https://github.com/pytorch/pytorch/issues/60691.
    # Mechanism: the combined check keeps only one of its two halves.
    Fault(
        id="optim.clip_nonfinite_check_misses_inf",
        area="optim",
        bug_class="an error check weakened: a non-finite value let through",
        summary="with error_if_nonfinite=True, clip_grad_norm_ / get_total_norm raise for a "
        "NaN total norm only: an infinite total norm (an inf gradient, or overflow) is "
        "returned and the gradients are scaled by max_norm / inf (zeroed) silently",
        patches=(
            Patch(f"{_CLIP}:_get_total_norm", rewritten(_NONFINITE_NAN_ONLY)),
            Patch("torch.nn.utils:get_total_norm", rewritten(_NONFINITE_NAN_ONLY)),
        ),
        origin=blind(
            TRAINING_SURFACE,
            "https://github.com/pytorch/pytorch/pull/61042",
            "https://github.com/pytorch/pytorch/issues/60691",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/185872 and
    # https://github.com/pytorch/pytorch/pull/185986 (SequentialLR initializes with the wrong
    # learning rate when milestones contain 0). Mechanism: the fix reverted.
    Fault(
        id="optim.sequentiallr_zero_milestone_first_scheduler",
        area="optim",
        bug_class="LR schedule: off-by-one in which scheduler is active at step 0",
        summary="SequentialLR always performs the initial step of schedulers[0] and takes its "
        "lr as the starting lr, even when milestones contain 0 (so a later scheduler should "
        "already be active at step 0); milestones >= 1 are untouched",
        patches=(Patch(f"{_SCHED}:SequentialLR.__init__", rewritten(_SEQUENTIAL_FIRST)),),
        origin=blind(
            TRAINING_SURFACE,
            "https://github.com/pytorch/pytorch/issues/185872",
            "https://github.com/pytorch/pytorch/pull/185986",
            survived_before=True,
        ),
    ),
    # https://github.com/deepspeedai/DeepSpeed/pull/8171 ("Fix WarmupLR collapsing multi-group
    # base LRs to group 0's") and https://github.com/deepspeedai/DeepSpeed/pull/7969 (the same
    # collapse in WarmupCosineLR). Mechanism re-created in LambdaLR, torchtitan's warmup
    # scheduler.
    Fault(
        id="optim.lambdalr_base_lrs_collapsed_to_first_group",
        area="optim",
        bug_class="LR schedule: per-group values collapsed to the first param group's",
        summary="LambdaLR computes every param group's lr as lr_lambda(epoch) times the FIRST "
        "group's base lr, so later groups with a different initial lr get group 0's schedule; "
        "a single group, or groups with equal lrs, are untouched",
        patches=(Patch(f"{_SCHED}:LambdaLR.get_lr", _lambda_base_lrs_collapsed),),
        origin=blind(
            TRAINING_SURFACE,
            "https://github.com/deepspeedai/DeepSpeed/pull/8171",
            "https://github.com/deepspeedai/DeepSpeed/pull/7969",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/92706 ([optim][foreach] Do NOT inplace modify
    # gradients). Mechanism: Adamax's foreach path takes abs in place on the caller's grads.
    Fault(
        id="optim.adamax_foreach_mutates_grads",
        area="optim",
        bug_class="optimizer step mutates its input gradients in place",
        summary="Adamax's foreach kernel (no weight_decay, no maximize) applies abs_ and +eps "
        "in place on p.grad, so after step() every gradient is |grad| + eps (the step itself "
        "is right); single-tensor Adamax and the weight_decay/maximize foreach paths, which "
        "copy first, are untouched",
        patches=(Patch("torch.optim.adamax:_multi_tensor_adamax", rewritten(_ADAMAX_ABS_INPLACE)),),
        origin=blind(
            TRAINING_SURFACE, "https://github.com/pytorch/pytorch/pull/92706", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/92699 ([optim][NAdam] Fix discrepancy between mt
    # vs st impl: mu_product_next multiplied by mu although mu_product already contains it).
    # Mechanism: the single-tensor bug re-introduced.
    Fault(
        id="optim.nadam_single_tensor_mu_counted_twice",
        area="optim",
        bug_class="foreach and single-tensor kernels disagree (a factor applied twice)",
        summary="NAdam's single-tensor kernel (foreach=False, not capturable/differentiable) "
        "computes mu_product_next = mu_product * mu * mu_next, counting the current mu twice "
        "in the gradient term's bias correction; the foreach kernel is untouched",
        patches=(Patch("torch.optim.nadam:_single_tensor_nadam", rewritten(_NADAM_MU_TWICE)),),
        origin=blind(
            TRAINING_SURFACE, "https://github.com/pytorch/pytorch/pull/92699", survived_before=False
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/125440 ([optim] Fix: wrong ASGD implementation:
    # "ill assumption that every param will have the same step"; foreach and single-tensor
    # differed). Mechanism: the assumption re-introduced in the foreach kernel.
    Fault(
        id="optim.asgd_foreach_eta_from_first_step",
        area="optim",
        bug_class="per-parameter state computed from the first parameter's state",
        summary="ASGD's foreach kernel (not capturable) sets every parameter's new eta and mu "
        "from the FIRST parameter's step count in its device/dtype group, so parameters whose "
        "step differs (one that had no gradient in some steps) get another's eta/mu; the "
        "single-tensor kernel is untouched",
        patches=(
            Patch(
                "torch.optim.asgd:_multi_tensor_asgd",
                rewritten(_ASGD_FIRST_STEP_ETA, _ASGD_FIRST_STEP_MU),
            ),
        ),
        origin=blind(
            TRAINING_SURFACE, "https://github.com/pytorch/pytorch/pull/125440", survived_before=True
        ),
    ),
)
