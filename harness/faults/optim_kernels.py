"""Faults in optimizer kernels on DTensor parameters (SGD's momentum and weight decay, Adam's step
and AMSGrad on the foreach and fused paths) and in clip_grad_norm_'s total norm."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

from harness.faults._origin import WITH_THE_PROPERTY, blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import any_dtensor, is_dtensor
from harness.faults.held_out import FIRST, TRAINING_KNOBS


def _foreach_drops_weight_decay(original: Callable[..., Any]) -> Callable[..., Any]:
    def multi_tensor_sgd(params: list[Any], *args: Any, **kwargs: Any) -> Any:
        if params and is_dtensor(params[0]):
            kwargs["weight_decay"] = 0.0
        return original(params, *args, **kwargs)

    return multi_tensor_sgd


def _step_counted_twice(original: Callable[..., Any]) -> Callable[..., Any]:
    def adam_kernel(params: list[Any], grads: list[Any], *args: Any, **kwargs: Any) -> Any:
        result = original(params, grads, *args, **kwargs)
        if params and is_dtensor(params[0]):
            for step in args[3]:  # state_steps
                step.add_(1)
        return result

    return adam_kernel


def _local_total_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    def total_norm(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        from torch import Tensor
        from torch.distributed.tensor import DTensor

        listed = [tensors] if isinstance(tensors, Tensor) else list(tensors)
        local = [t.to_local() if isinstance(t, DTensor) else t for t in listed]
        return original(local, *args, **kwargs)

    return total_norm


def _fused_amsgrad_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    def _fused_adam(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("amsgrad") and any_dtensor(bound.arguments["params"]):
            # The DTensor fused kernel is called without the AMSGrad flag and its buffers: the
            # running maximum is allocated and checkpointed but never used.
            bound.arguments["amsgrad"] = False
            bound.arguments["max_exp_avg_sqs"] = []
        return original(*bound.args, **bound.kwargs)

    return _fused_adam


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
            and is_dtensor(params[0])
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
        if not (bound.arguments.get("amsgrad") and params and is_dtensor(params[0])):
            return original(*args, **kwargs)
        saved = [m.detach().clone() for m in maxima]
        result = original(*args, **kwargs)
        for m, old in zip(maxima, saved, strict=True):
            m.copy_(old)  # the running maximum was only a temporary
        return result

    return multi_tensor_adam


def _inf_norm_through_p_root(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_total_norm(tensors: Any, norm_type: float = 2.0, *args: Any, **kwargs: Any) -> Any:
        import torch

        total = original(tensors, norm_type, *args, **kwargs)
        listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if math.isinf(float(norm_type)) and any(is_dtensor(t) for t in listed):
            # The p-norm epilogue total ** (1 / p) applied to the inf-norm too: always 1.
            total = total ** (1.0 / float(norm_type))
        return total

    return get_total_norm


FAULTS: tuple[Fault, ...] = (
    Fault(
        id="optim.clip_norm_of_local_shards",
        area="optim",
        bug_class="a global reduction computed from the local shards only",
        summary="clip_grad_norm_ takes the total norm of each rank's local gradient shards "
        "instead of the whole (DTensor) gradients",
        patches=(Patch("torch.nn.utils.clip_grad:_get_total_norm", _local_total_norm),),
        origin=WITH_THE_PROPERTY,
    ),
    Fault(
        id="optim.foreach_drops_weight_decay",
        area="optim",
        bug_class="foreach and single-tensor kernels disagree (a term lost on one path)",
        summary="SGD's foreach kernel ignores weight_decay for DTensor parameters",
        patches=(Patch("torch.optim.sgd:_multi_tensor_sgd", _foreach_drops_weight_decay),),
        origin=WITH_THE_PROPERTY,
    ),
    Fault(
        id="optim.adam_step_counted_twice",
        area="optim",
        bug_class="an optimizer step counter advanced twice (bias correction off)",
        summary="Adam/AdamW's single-tensor and foreach kernels advance 'step' twice for "
        "DTensor parameters",
        patches=(
            Patch("torch.optim.adam:_single_tensor_adam", _step_counted_twice),
            Patch("torch.optim.adam:_multi_tensor_adam", _step_counted_twice),
        ),
        origin=WITH_THE_PROPERTY,
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
        origin=blind(
            FIRST,
            "https://github.com/pytorch/pytorch/pull/152833",
            "https://github.com/ml-explore/mlx/pull/473",
            survived_before=False,
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
        origin=blind(FIRST, "https://github.com/pytorch/pytorch/pull/4314", survived_before=False),
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
        origin=blind(
            FIRST, "https://github.com/meta-pytorch/torchrec/pull/3199", survived_before=True
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
        origin=blind(
            TRAINING_KNOBS,
            "https://github.com/pytorch/pytorch/pull/125369",
            "https://github.com/pytorch/pytorch/pull/4034",
            survived_before=False,
        ),
    ),
)
