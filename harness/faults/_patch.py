"""Faults and the reversible patches they are made of."""

from __future__ import annotations

import importlib
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.errors import FaultError

Undo = Callable[[], None]
_MISSING = object()


@dataclass(frozen=True)
class Patch:
    """Replace ``target`` (``"package.module:Owner.attribute"``) with ``wrap(original)``.

    Patch where the name is *looked up*: a module that did ``from x import f`` keeps its own
    reference, so the target is that module's ``f``, not ``x.f``. A ``staticmethod`` stays one.
    """

    target: str
    wrap: Callable[[Any], Any]

    def apply(self) -> Undo:
        owner, name = self._resolve()
        raw = inspect.getattr_static(owner, name)
        own = name in vars(owner)
        replacement = self.wrap(getattr(owner, name))
        if isinstance(raw, staticmethod):
            replacement = staticmethod(replacement)
        setattr(owner, name, replacement)

        def undo() -> None:
            if own:
                setattr(owner, name, raw)
            else:
                delattr(owner, name)

        return undo

    def _resolve(self) -> tuple[Any, str]:
        module_name, _, path = self.target.partition(":")
        if not module_name or not path:
            raise FaultError(f"target={self.target!r} must look like 'package.module:Owner.name'")
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError as exc:
            raise FaultError(f"{self.target}: cannot import {module_name} ({exc})") from None
        *owners, name = path.split(".")
        for part in owners:
            owner = getattr(owner, part, _MISSING)
            if owner is _MISSING:
                raise FaultError(_gone(self.target, part))
        if inspect.getattr_static(owner, name, _MISSING) is _MISSING:
            raise FaultError(_gone(self.target, name))
        return owner, name


def forcing_argument(name: str, value: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
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


def rewritten(*edits: tuple[str, str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
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


def _gone(target: str, part: str) -> str:
    import torch

    return (
        f"{target}: {part!r} does not exist in torch {torch.__version__}; the fault was "
        "written for torch 2.13 and must be updated to where this torch does the same work"
    )


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injectable defect of torch's distributed stack."""

    id: str
    area: str
    """The catalogue area it breaks (suites of that area run first)."""
    bug_class: str
    """The real-world class of bug it stands for."""
    summary: str
    """What the patch does, precisely."""
    patches: tuple[Patch, ...]

    def apply(self) -> Undo:
        """Apply every patch (all or none); return the function that reverts them."""
        undos: list[Undo] = []
        try:
            for patch in self.patches:
                undos.append(patch.apply())
        except BaseException:
            _revert(undos)
            raise
        _clear_torch_caches()

        def undo() -> None:
            _revert(undos)
            _clear_torch_caches()

        return undo


def _revert(undos: list[Undo]) -> None:
    for undo in reversed(undos):
        undo()


def _clear_torch_caches() -> None:
    # Plans cached before the patch would bypass it (and cached plans made under it would
    # outlive it).
    from harness.torchkit import internals

    internals.clear_dtensor_plan_caches()
