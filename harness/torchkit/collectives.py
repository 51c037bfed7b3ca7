"""Count the collectives one rank issues, per operation and process group, on any runner.

``with counting() as counts:`` on a rank records every collective that rank issues inside
the block as ``counts[(op, group_ranks)]``, e.g. ``("reduce_scatter", (0, 1))``. Two sources:

- the ``torch.distributed`` functions FSDP and user code call (``dist.all_reduce``,
  ``dist.reduce_scatter_single``, ...), as upstream's ``patch_allreduce`` does. Patching
  them per rank is racy when ranks are threads (one thread restores what another installed),
  so the wrappers are installed once for the process, reference-counted, and each wrapper
  counts into the *calling thread's* counter only. The threaded process group is a Python
  group that the dispatcher never sees, so a dispatch mode cannot count these on threads.
- the functional collectives DTensor issues (``_c10d_functional.all_reduce``, ...), through
  a ``TorchDispatchMode``. Dispatch modes are thread-local, so unlike ``CommDebugMode``
  (whose module tracker registers process-global hooks) it is safe on rank threads.

Only public ``torch.distributed`` attributes are patched; resolving a functional
collective's group name goes through ``harness.torchkit.internals``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from harness.torchkit import internals

CountKey = tuple[str, tuple[int, ...]]
"""(operation, global ranks of the group it ran on)."""

# torch.distributed function -> the operation it counts as.
C10D_OPS = {
    "all_reduce": "all_reduce",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather": "all_gather",
    "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
}
# Functional collective op names (both namespaces, with and without the in-place/out forms).
_FUNCTIONAL_OPS = {
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}
_FUNCTIONAL_NAMESPACES = ("_c10d_functional", "c10d_functional")
_GROUP_POSITION = {"all_reduce": 2, "broadcast": 2}
"""Positional index of ``group`` where it is not the fourth argument."""

_lock = threading.Lock()
_installed: dict[str, Callable[..., Any]] = {}
_users = 0
_local = threading.local()


def _active() -> list[Counter[CountKey]]:
    stack: list[Counter[CountKey]] | None = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _group_ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _note(op: str, group: Any) -> None:
    for counter in _active():
        counter[(op, _group_ranks(group))] += 1


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    op = C10D_OPS[name]
    position = _GROUP_POSITION.get(name, 3)

    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_local, "depth", 0)
        if depth == 0 and _active():
            group = kwargs.get("group", args[position] if len(args) > position else None)
            _note(op, group)
        _local.depth = depth + 1  # a collective built on another one counts once
        try:
            return original(*args, **kwargs)
        finally:
            _local.depth = depth

    counted.__distconf_counted__ = True  # type: ignore[attr-defined]
    return counted


def _install() -> None:
    global _users
    with _lock:
        _users += 1
        if _users > 1:
            return
        for name in C10D_OPS:
            # torch 2.11 has no reduce_scatter_single: count what this torch has
            original = getattr(dist, name, None)
            if original is None:
                continue
            _installed[name] = original
            setattr(dist, name, _wrap(name, original))


def _uninstall() -> None:
    global _users
    with _lock:
        _users -= 1
        if _users:
            return
        for name, original in _installed.items():
            # Someone patched on top of us (a fault injection): leave theirs in place.
            if getattr(getattr(dist, name), "__distconf_counted__", False):
                setattr(dist, name, original)
        _installed.clear()


class _FunctionalCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped torch
    """Counts functional collectives issued by this thread (DTensor's redistributions)."""

    def __init__(self, counts: Counter[CountKey]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts = counts

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # As CommDebugMode does: let DTensor desugar its op first; the functional
        # collectives it issues then come back through this mode as plain-tensor ops.
        if any(issubclass(t, torch.distributed.tensor.DTensor) for t in types):
            return NotImplemented
        namespace = getattr(func, "namespace", "")
        op = _FUNCTIONAL_OPS.get(func._overloadpacket.__name__)
        if namespace in _FUNCTIONAL_NAMESPACES and op is not None:
            group_name = args[-1] if args and isinstance(args[-1], str) else None
            ranks = internals.group_ranks_of_name(group_name) if group_name else ()
            self.counts[(op, ranks)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting() -> Iterator[Counter[CountKey]]:
    """Count the collectives this rank (thread) issues inside the block."""
    counts: Counter[CountKey] = Counter()
    _install()
    _active().append(counts)
    try:
        with _FunctionalCounter(counts):
            yield counts
    finally:
        stack = _active()
        del stack[next(i for i, c in enumerate(stack) if c is counts)]
        _uninstall()


def by_op(counts: Counter[CountKey]) -> dict[str, int]:
    """Totals per operation, whatever the group."""
    totals: Counter[str] = Counter()
    for (op, _), n in counts.items():
        totals[op] += n
    return dict(totals)
