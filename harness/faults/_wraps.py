"""The wraps and helpers that faults of several areas share: a ``Patch.wrap`` forcing an
argument, one recompiling torch's own source with edits, one editing FSDP2's gradient divide
factors, one editing entries of a table keyed by op; a copy of a function seeing other
globals; whether tensors are DTensors. Nothing here imports torch until a patch is
applied."""

from __future__ import annotations

import inspect
import re
import textwrap
import types
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


def rewritten(*edits: tuple[str, str], undecorated: bool = False) -> Wrap:
    """A ``Patch.wrap`` that recompiles a function (or method) from its own source with each
    ``old`` line replaced by ``new`` (each ``old`` must occur exactly once), in the function's
    own module globals (decorators are re-applied, or dropped with ``undecorated``: a
    registering decorator would register the copy for good; the module itself is not
    touched)."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        function = inspect.unwrap(original)
        source = textwrap.dedent(inspect.getsource(function))
        if undecorated:
            start = re.search(r"^def ", source, re.MULTILINE)
            source = source[start.start() if start else 0 :]
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


def table_entries_edited(
    ops: Callable[[], Iterable[Any]], edit: Callable[[Any], Any]
) -> Callable[[dict[Any, Any]], dict[Any, Any]]:
    """A ``Patch.wrap`` of a table keyed by op (a sharding propagator's strategies, schema
    infos): a copy whose entry for each op of ``ops()`` (resolved when the patch is applied)
    is ``edit(entry)``; an op absent from the table is a ``FaultError``."""

    def wrap(original: dict[Any, Any]) -> dict[Any, Any]:
        table = dict(original)
        for op in ops():
            if op not in table:
                raise FaultError(
                    f"{op} has no entry in the table; the fault was written for torch 2.13 "
                    "and must be updated"
                )
            table[op] = edit(table[op])
        return table

    return wrap


def with_globals(function: Callable[..., Any], **names: Any) -> Callable[..., Any]:
    """A copy of ``function`` that sees ``names`` in place of its module's globals of the same
    names (the module itself is not touched)."""
    copy = types.FunctionType(
        function.__code__,
        {**function.__globals__, **names},
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy
