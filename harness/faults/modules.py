"""Faults in fully_shard's bookkeeping of managed modules and (tied) parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._patch import Fault, Patch

_INIT = "torch.distributed.fsdp._fully_shard._fsdp_init"


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


FAULTS = (
    Fault(
        id="fsdp.tied_param_managed_twice",
        area="fsdp_init",
        bug_class="shared-parameter dedup missing: a tied weight managed (and sharded) twice",
        summary="fully_shard's managed states list a parameter once per module that holds it",
        patches=(Patch(f"{_INIT}:_get_managed_states", _ties_not_deduplicated),),
    ),
    Fault(
        id="fsdp.nested_fully_shard_not_excluded",
        area="fsdp_init",
        bug_class="nested wrapping bookkeeping: modules of an inner fully_shard managed again",
        summary="the parent's fully_shard also manages modules an inner fully_shard owns",
        patches=(Patch(f"{_INIT}:_get_managed_modules", _nested_not_excluded),),
    ),
    Fault(
        id="fsdp.shared_module_managed_twice",
        area="fsdp_init",
        bug_class="shared-module dedup missing: a module reachable on two paths visited twice",
        summary="a submodule with two parents among the managed modules is listed twice",
        patches=(Patch(f"{_INIT}:_get_managed_modules", _shared_modules_twice),),
    ),
)
