"""Faults in fully_shard's initialisation: its bookkeeping of managed modules and (tied)
parameters, and meta-device initialisation of sharded parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._origin import WITH_THE_PROPERTY, blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import rewritten
from harness.faults.held_out import TRAINING_KNOBS

_INIT = "torch.distributed.fsdp._fully_shard._fsdp_init"
_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param"


def _ties_not_deduplicated(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_managed_states(modules: list[Any], ignored_params: Any = None) -> Any:
        params, buffers = original(modules, ignored_params)
        ignored, seen, again = ignored_params or set(), set(), []
        for module in modules:
            for _, param in module.named_parameters(recurse=False):
                if param in seen and param not in ignored:
                    again.append(param)
                seen.add(param)
        return params + again, buffers

    return get_managed_states


def _nested_not_excluded(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_managed_modules(
        root_modules: Any,
        ignored_params: Any = None,
        is_composable_fn: Any = None,
        get_state_fn: Any = None,
    ) -> Any:
        return original(root_modules, ignored_params, is_composable_fn, lambda module: None)

    return get_managed_modules


def _shared_modules_twice(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_managed_modules(root_modules: Any, *args: Any, **kwargs: Any) -> Any:
        modules: list[Any] = list(original(root_modules, *args, **kwargs))
        managed = set(modules)
        again = [
            child
            for module in modules
            for child in module.children()
            if child in managed and _parents(child, modules) > 1
        ]
        return list(dict.fromkeys(again)) + modules

    return get_managed_modules


def _parents(child: Any, modules: list[Any]) -> int:
    return sum(any(c is child for c in module.children()) for module in modules)


# FSDPParam.reset_sharded_param after nn.Module._apply (to_empty, .to(...)): the padded copy
# becomes the all-gather source, but the DTensor parameter keeps its old local tensor.
_PADDED_NOT_REBOUND_EDIT = (
    "    if updated_local_tensor:\n",
    "    if updated_local_tensor and self.pin_memory:\n",
)


FAULTS: tuple[Fault, ...] = (
    Fault(
        id="fsdp.tied_param_managed_twice",
        area="fsdp_init",
        bug_class="shared-parameter dedup missing: a tied weight managed (and sharded) twice",
        summary="fully_shard's managed states list a parameter once per module that holds it",
        patches=(Patch(f"{_INIT}:_get_managed_states", _ties_not_deduplicated),),
        origin=WITH_THE_PROPERTY,
    ),
    Fault(
        id="fsdp.nested_fully_shard_not_excluded",
        area="fsdp_init",
        bug_class="nested wrapping bookkeeping: modules of an inner fully_shard managed again",
        summary="the parent's fully_shard also manages modules an inner fully_shard owns",
        patches=(Patch(f"{_INIT}:_get_managed_modules", _nested_not_excluded),),
        origin=WITH_THE_PROPERTY,
    ),
    Fault(
        id="fsdp.shared_module_managed_twice",
        area="fsdp_init",
        bug_class="shared-module dedup missing: a module reachable on two paths visited twice",
        summary="a submodule with two parents among the managed modules is listed twice",
        patches=(Patch(f"{_INIT}:_get_managed_modules", _shared_modules_twice),),
        origin=WITH_THE_PROPERTY,
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
        origin=blind(
            TRAINING_KNOBS, "https://github.com/pytorch/pytorch/pull/120351", survived_before=False
        ),
    ),
)
