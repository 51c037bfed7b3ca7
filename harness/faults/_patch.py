"""Faults and the reversible patches they are made of."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.errors import FaultError, require
from harness.faults._origin import NOT_STATED, Origin

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
    origin: Origin = NOT_STATED
    """How it was written (``harness.faults.Origin``): with the property, or blind in a
    held-out set from upstream reports. A fault file's fault need not say: its origin is then
    "not stated", counted apart from distconf's own."""

    def __post_init__(self) -> None:
        require(isinstance(self.origin, Origin), "origin", self.origin, "a harness.faults.Origin")

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
