"""DTensor's output shapes computed once per process, not once per rank thread.

Before choosing a sharding for an op it has not met, DTensor runs the op on fake tensors of
its inputs' *global* shapes (``ShardingPropagator._propagate_tensor_meta_non_cached``) to
learn the global shape, stride and dtype of its output. That result depends on the op, its
inputs' global shapes, strides and dtypes, the device type and its other arguments, never on
the rank or the mesh; but DTensor's caches are keyed by the mesh, which on rank threads is a
different one in every thread, so every rank of a thread World ran the same fake op (a fifth
of a rank's CPU time in optimizer, state-dict and program checks, each rank paying it again).

While ``install``\\ ed (the thread runner installs it with its process group), the result is
kept in one table for the process, keyed by exactly those inputs, and the first rank to meet
a key computes it while the others wait for it. The sharding decision itself is still made by
every rank on its own mesh: only the fake run of the op is shared. Arguments the key cannot
describe exactly (symbolic sizes, tensors, objects of other types), a fake mode already active
(tracing) or a fake run that raises leave the call to torch, uncached.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_MAX_ENTRIES = 1 << 15
"""Entries kept before the table is emptied (a ci run of three suites meets about 8,000)."""
_WAIT_SECONDS = 5.0
"""How long a rank waits for another rank computing the same key, before computing it
itself (a fake op takes milliseconds)."""
_PLAIN = (type(None), bool, int, float, complex, str)

_lock = threading.Lock()
_users = 0
_original: Callable[..., Any] | None = None
_table: dict[Any, Any] = {}
_pending: dict[Any, threading.Event] = {}
_UNCACHEABLE = object()
# torch's names the key needs, bound by ``install`` (this module imports no torch before it).
_torch: dict[str, Any] = {}


def install() -> None:
    """Share DTensor's fake shape propagation between the threads of this process, for one
    more user until it calls ``uninstall``."""
    global _users, _original
    import torch
    from torch._guards import detect_fake_mode
    from torch.distributed._functional_collectives import _are_we_tracing
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    with _lock:
        _users += 1
        if _original is not None:
            return
        _torch.update(
            detect_fake_mode=detect_fake_mode,
            are_we_tracing=_are_we_tracing,
            spec=DTensorSpec,
            atoms=(*_PLAIN, torch.dtype, torch.device, torch.layout, torch.memory_format),
            sequences=(list, tuple, torch.Size),
        )
        original = ShardingPropagator.__dict__.get("_propagate_tensor_meta_non_cached")
        if not callable(original):
            raise RuntimeError(
                "torch.distributed.tensor._sharding_prop.ShardingPropagator no longer has "
                "_propagate_tensor_meta_non_cached: review harness.torchkit.tensor_meta for "
                "this torch version"
            )
        _original = original
        ShardingPropagator._propagate_tensor_meta_non_cached = _shared  # type: ignore[method-assign]


def uninstall() -> None:
    """One user fewer; the last puts torch's own method back and empties the table."""
    global _users, _original
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    with _lock:
        if _users == 0:
            return
        _users -= 1
        if _users or _original is None:
            return
        ShardingPropagator._propagate_tensor_meta_non_cached = _original  # type: ignore[method-assign]
        _original = None
        _table.clear()


def clear() -> None:
    """Forget every shape computed so far."""
    with _lock:
        _table.clear()


def installed() -> bool:
    return _original is not None


def _shared(self: Any, op_schema: Any) -> Any:
    original = _original
    assert original is not None, "tensor_meta._shared called while uninstalled"
    key = _key_of(op_schema)
    if key is None:
        return original(self, op_schema)
    while True:
        with _lock:
            if key in _table:
                return _handed(_table[key])
            waiting = _pending.get(key)
            if waiting is None:
                mine = _pending[key] = threading.Event()
                break
        # Another rank is computing this key: wait for it, then look again; past the wait
        # (it raised, or is slow), compute it here.
        if not waiting.wait(_WAIT_SECONDS) or key not in _table:
            return original(self, op_schema)
    try:
        result = original(self, op_schema)
        with _lock:
            if len(_table) >= _MAX_ENTRIES:
                _table.clear()
            _table[key] = result
        return _handed(result)
    finally:
        with _lock:
            del _pending[key]
        mine.set()


def _handed(result: Any) -> Any:
    """A caller's own copy of a list (TensorMeta and tuples are immutable)."""
    return list(result) if isinstance(result, list) else result


def _key_of(op_schema: Any) -> Any:
    """What the fake run of ``op_schema`` depends on, or None where it cannot be told exactly
    (or a fake mode is active: torch.compile tracing, which torch never caches)."""
    if _torch["are_we_tracing"]() or _torch["detect_fake_mode"]() is not None:
        return None
    args = _describe(op_schema.args_schema)
    kwargs = _describe(op_schema.kwargs_schema)
    if args is _UNCACHEABLE or kwargs is _UNCACHEABLE:
        return None
    return (op_schema.op, args, kwargs)


def _describe(value: Any) -> Any:
    """A hashable description of an argument, exact in type (``1``, ``1.0`` and ``True``
    are different keys), or ``_UNCACHEABLE``."""
    kind = type(value)
    if kind in _torch["atoms"]:
        return (kind, value)
    if kind is _torch["spec"]:
        meta = value.tensor_meta
        if meta is None:
            return _UNCACHEABLE
        shape, stride = tuple(meta.shape), tuple(meta.stride)
        if not all(type(n) is int for n in (*shape, *stride)):
            return _UNCACHEABLE
        return ("spec", shape, stride, meta.dtype, value.mesh.device_type)
    if kind in _torch["sequences"]:
        items = tuple(_describe(v) for v in value)
        return _UNCACHEABLE if _UNCACHEABLE in items else (kind, items)
    if kind is dict:
        pairs = tuple((k, _describe(v)) for k, v in value.items())
        if any(type(k) is not str or v is _UNCACHEABLE for k, v in pairs):
            return _UNCACHEABLE
        return (dict, pairs)
    return _UNCACHEABLE
