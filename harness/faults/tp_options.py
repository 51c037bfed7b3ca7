"""Faults in the options of tensor parallelism's styles, written blind in the training options
set: PrepareModuleInput's keyword-argument layouts, SequenceParallel's replicated norm weights
and loss_parallel's mean over ignored targets. Each bites only on the path its upstream bug
lived on. Nothing here imports torch until a fault is applied."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._origin import blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import rewritten
from harness.faults.held_out import TRAINING_OPTIONS

_STYLE = "torch.distributed.tensor.parallel.style"
_LOSS = "torch.distributed.tensor.parallel.loss"

# PrepareModuleInput with input_kwarg_layouts: a keyword input is annotated with its input
# layout but never redistributed to its desired layout (positional inputs still are).
_KWARG_NOT_REDISTRIBUTED = (
    "kwarg_val, device_mesh, input_layout, desired_input_layout",
    "kwarg_val, device_mesh, input_layout, input_layout",
)


def _norm_grad_not_reduced(original: Callable[..., Any]) -> Callable[..., Any]:
    def _replicate_module_fn(self: Any, name: str, module: Any, device_mesh: Any) -> None:
        from torch.distributed.tensor import DTensor, Replicate

        original(self, name, module, device_mesh)

        def relabel(grad: Any) -> Any:
            # The weight's gradient over this rank's part of the sequence is a pending sum
            # (Partial) across the TP group; it is taken for the replicated gradient as it is,
            # so no rank ever adds in the other ranks' tokens.
            if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
                return DTensor.from_local(
                    grad.to_local(),
                    grad.device_mesh,
                    [Replicate()] * grad.device_mesh.ndim,
                    run_check=False,
                )
            return grad

        for param in module.parameters(recurse=False):
            if param.requires_grad:
                param.register_hook(relabel)

    return _replicate_module_fn


# loss_parallel's nll_loss forward (no class weights): the mean divides by every target,
# ignored ones (ignore_index) included.
_MEAN_COUNTS_IGNORED = (
    "total_weight = (target != ignore_index).sum().to(x)",
    "total_weight = x.new_full((), float(target.numel()))",
)


FAULTS: tuple[Fault, ...] = (
    # https://github.com/pytorch/pytorch/issues/128365 (DTensor keyword args to
    # PrepareModuleInput not handled correctly) and https://github.com/pytorch/pytorch/pull/124114
    # ([tp] add kwargs support to prepare_module_input). Mechanism: the kwargs path handles its
    # layouts differently from the positional path: the desired layout is not applied.
    Fault(
        id="tp.prepare_input_kwarg_not_redistributed",
        area="tp",
        bug_class="a layout annotation applied on one path (positional) but not another (kwargs)",
        summary="PrepareModuleInput(input_kwarg_layouts=..., desired_input_kwarg_layouts=...): "
        "a keyword input is wrapped with its input layout but not redistributed to its desired "
        "layout, so the module gets (with use_local_output=True) the local shard where it "
        "expects the replicated tensor, or (use_local_output=False) a DTensor of the input "
        "layout; positional inputs, and kwargs whose two layouts agree, are untouched",
        patches=(
            Patch(
                f"{_STYLE}:PrepareModuleInput._prepare_input_kwarg_fn",
                rewritten(_KWARG_NOT_REDISTRIBUTED),
            ),
        ),
        origin=blind(
            TRAINING_OPTIONS,
            "https://github.com/pytorch/pytorch/issues/128365",
            "https://github.com/pytorch/pytorch/pull/124114",
            survived_before=True,
        ),
    ),
    # https://github.com/NVIDIA/TransformerEngine/issues/435 (need all-reduce for norm weight
    # gradients with sequence parallel), https://github.com/NVIDIA/Megatron-LM/issues/443 and
    # https://github.com/EleutherAI/gpt-neox/pull/1259 (the LayerNorm all-reduce hook fixed).
    # Mechanism: the norm weights' gradients, partial over the sequence shards, are never
    # summed across the TP group.
    Fault(
        id="tp.sequence_parallel_norm_grad_not_reduced",
        area="tp",
        bug_class="a partial gradient relabelled replicated instead of all-reduced",
        summary="SequenceParallel: the gradient of a replicated norm weight/bias (a "
        "Partial('sum') over the sequence shards) is relabelled Replicate without the "
        "all-reduce, so each rank keeps the gradient of its own tokens only (full_tensor() "
        "gives rank 0's part; an optimizer step makes the replicas diverge); sharded "
        "parameters of the other styles are untouched",
        patches=(Patch(f"{_STYLE}:SequenceParallel._replicate_module_fn", _norm_grad_not_reduced),),
        origin=blind(
            TRAINING_OPTIONS,
            "https://github.com/NVIDIA/TransformerEngine/issues/435",
            "https://github.com/NVIDIA/Megatron-LM/issues/443",
            "https://github.com/EleutherAI/gpt-neox/pull/1259",
            survived_before=False,
        ),
    ),
    # https://github.com/PaddlePaddle/Paddle/pull/76033 and
    # https://github.com/PaddlePaddle/Paddle/issues/23708 (cross_entropy with ignore_index and
    # reduction='mean' divided by every sample rather than the non-ignored ones). Mechanism
    # re-created in loss_parallel's nll_loss.
    Fault(
        id="tp.loss_parallel_mean_counts_ignored",
        area="tp",
        bug_class="a mean's denominator counts masked-out elements",
        summary="under loss_parallel(), cross_entropy / nll_loss with reduction='mean' and no "
        "class weights divide by the number of targets, ignored ones (target == ignore_index) "
        "included, in the loss and in its gradient: the loss is scaled down by the ignored "
        "fraction; batches without an ignored target, sum/none and weighted losses are "
        "untouched",
        patches=(Patch(f"{_LOSS}:_nll_loss_forward", rewritten(_MEAN_COUNTS_IGNORED)),),
        origin=blind(
            TRAINING_OPTIONS,
            "https://github.com/PaddlePaddle/Paddle/pull/76033",
            "https://github.com/PaddlePaddle/Paddle/issues/23708",
            survived_before=True,
        ),
    ),
)
