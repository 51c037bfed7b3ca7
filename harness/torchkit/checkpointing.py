"""A case's activation checkpointing (``harness.cases.checkpointing.Checkpointing``) applied
to a model's layers, through the API the case names."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed._composable.checkpoint_activation import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from harness.cases.checkpointing import Checkpointing

_aten = torch.ops.aten
_MATMULS = [_aten.mm.default, _aten.addmm.default, _aten.bmm.default]

WRAPPED_ATTRIBUTE = "_checkpoint_wrapped_module"
"""The attribute a checkpointing wrapper holds its layer under: ``checkpoint_wrapper``'s,
which ``FunctionCheckpoint`` shares so that parameter names read the same under both."""


class FunctionCheckpoint(nn.Module):
    """Runs its layer through ``torch.utils.checkpoint.checkpoint`` with a case's options."""

    def __init__(self, layer: nn.Module, options: dict[str, Any]) -> None:
        super().__init__()
        setattr(self, WRAPPED_ATTRIBUTE, layer)
        self.options = options

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        layer = getattr(self, WRAPPED_ATTRIBUTE)
        return checkpoint(layer, *args, **self.options, **kwargs)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _save_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE


_POLICY_FUNCTIONS: dict[str, Callable[..., CheckpointPolicy]] = {
    "save_matmuls": _save_matmuls,
    "recompute_all": _recompute_all,
    "save_all": _save_all,
}
_POLICY_LISTS: dict[str, list[Any]] = {"save_matmuls": _MATMULS, "recompute_all": []}


def _context_fn(how: Checkpointing) -> Callable[[], Any] | None:
    if how.save is None:
        return None
    policy = _POLICY_LISTS[how.save] if how.policy_as_list else _POLICY_FUNCTIONS[how.save]

    def contexts() -> Any:
        return create_selective_checkpoint_contexts(  # type: ignore[no-untyped-call]
            policy, allow_cache_entry_mutation=how.allow_cache_entry_mutation
        )

    return contexts


def checkpoint_options(how: Checkpointing) -> dict[str, Any]:
    """What ``torch.utils.checkpoint.checkpoint`` receives but the implementation
    (``use_reentrant``): the non-reentrant options only where it is not reentrant."""
    options: dict[str, Any] = {"preserve_rng_state": how.preserve_rng_state}
    if not how.reentrant:
        options |= {
            "determinism_check": how.determinism_check,
            "early_stop": how.early_stop,
        }
    context_fn = _context_fn(how)
    return options if context_fn is None else {**options, "context_fn": context_fn}


def _wrapper_options(how: Checkpointing) -> dict[str, Any]:
    """``checkpoint_wrapper``'s: the implementation, and what it hands on to checkpoint."""
    impl = CheckpointImpl.REENTRANT if how.reentrant else CheckpointImpl.NO_REENTRANT
    return {"checkpoint_impl": impl, **checkpoint_options(how)}


def checkpoint_layers(model: nn.Sequential, layers: list[int], how: Checkpointing) -> None:
    """Checkpoints ``model``'s children at ``layers`` (indices into ``model``) as ``how``
    says, in place: a wrapping API replaces the child."""
    chosen = [layers[i] for i in how.layers]
    if how.api == "apply":
        _apply(model, chosen, how, every=len(chosen) == len(layers))
        return
    for index in chosen:
        layer = model[index]
        if how.api == "wrapper":
            model[index] = checkpoint_wrapper(layer, **_wrapper_options(how))
        elif how.api == "function":
            options = {"use_reentrant": how.reentrant, **checkpoint_options(how)}
            model[index] = FunctionCheckpoint(layer, options)
        else:
            composable_checkpoint(layer, **checkpoint_options(how))


def _apply(model: nn.Sequential, chosen: list[int], how: Checkpointing, every: bool) -> None:
    wrapper_fn = functools.partial(checkpoint_wrapper, **_wrapper_options(how))
    if every:
        policy = ModuleWrapPolicy({type(model[i]) for i in chosen})
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=wrapper_fn, auto_wrap_policy=policy
        )
        return
    targets = {id(model[i]) for i in chosen}
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrapper_fn, check_fn=lambda m: id(m) in targets
    )
