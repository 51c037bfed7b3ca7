"""The wraps and helpers that faults of several areas share: a ``Patch.wrap`` forcing an
argument, one recompiling torch's own source with edits, one editing FSDP2's gradient divide
factors; whether tensors are DTensors. Nothing here imports torch until a patch is applied."""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

from harness.errors import FaultError

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]
DivideFactors = tuple[float | None, float | None, Any, Any]
"""What FSDP2's ``_get_gradient_divide_factors`` returns: pre- and post-divide factors, the
reduce-scatter and the all-reduce ops."""


def forcing_argument(name: str, value: Any) -> Wrap:
    """A ``Patch.wrap`` that calls the original with argument ``name`` set to ``value``,
    however the caller passed it (positionally, by keyword or not at all)."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        def forced(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.arguments[name] = value
            return original(*bound.args, **bound.kwargs)

        return forced

    return wrap


def rewritten(*edits: tuple[str, str]) -> Wrap:
    """A ``Patch.wrap`` that recompiles a function (or method) from its own source with each
    ``old`` line replaced by ``new`` (each ``old`` must occur exactly once), in the function's
    own module globals (decorators are re-applied; the module itself is not touched)."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        function = inspect.unwrap(original)
        source = textwrap.dedent(inspect.getsource(function))
        for old, new in edits:
            if source.count(old) != 1:
                raise FaultError(
                    f"{function.__module__}.{function.__qualname__}: expected exactly one "
                    f"occurrence of {old.strip()!r} in torch's source; the fault was written "
                    "for torch 2.13 and must be updated"
                )
            source = source.replace(old, new)
        namespace: dict[str, Any] = {}
        code = compile(source, inspect.getsourcefile(function) or "<fault>", "exec")
        exec(code, function.__globals__, namespace)  # recompiling torch's own code
        recompiled: Callable[..., Any] = namespace[function.__name__]
        return recompiled

    return wrap


def divide_factors_edited(
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


def is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def any_dtensor(tensors: Iterable[Any]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(t, DTensor) for t in tensors)
