"""Which aten overloads DTensor's op dispatch reaches in this process, recorded as a run goes.

``install(directory)`` wraps DTensor's dispatcher once per process; every overload it then
dispatches is added to a process-wide set, whatever thread dispatches it (rank threads
included). ``flush()`` writes the set to ``directory/reach-<pid>.json`` (whole: a temp file
renamed over it) when it has grown since the last write, so it is cheap to call after each
test and each rank call; it is also called at exit. ``registered()`` is the set DTensor has a
sharding rule for in the running torch, against which a run's reach is measured.

Since torch 2.10 the dispatch entry point is C++, which calls back into ``OpDispatcher``'s
Python only where it needs to: the first time an op is met (a sharding-propagation cache
miss), for ops that always take the slow path, and for ops with a custom handler. Every op
a process dispatches takes one of these paths the first time, so wrapping them sees every
overload once, and the ops that hit the C++ cache afterwards cost nothing.

``$DISTCONF_REACH_DIR`` names the directory for a whole run (``harness run`` sets it): the
pytest plugin and the process runner's ranks call ``install_from_environment``.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV_VAR = "DISTCONF_REACH_DIR"
FILE_GLOB = "reach-*.json"
"""The reach files of a directory, one per process that dispatched a DTensor op."""

_CALLED_FROM_CPP = (
    "_unwrap_to_op_info_impl",
    "_propagate_op_sharding_dispatch_slow_path",
    "_dispatch_get_local_results_slow_path",
    "_dispatch_fast_path_python_tail",
)
"""``OpDispatcher`` methods taking ``(self, op_call, ...)`` that the C++ dispatch calls."""


class _Recorder:
    """The process's record: the overloads seen, and where and how much was last written."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.seen: dict[Any, str] = {}
        self.written = 0
        self.lock = threading.Lock()

    def add(self, op_call: Any) -> None:
        if op_call not in self.seen:
            with self.lock:
                self.seen[op_call] = str(op_call)

    def flush(self) -> bool:
        """Write the record if it grew since the last write; whether it wrote."""
        with self.lock:
            if len(self.seen) == self.written:
                return False
            names = sorted(set(self.seen.values()))
            self.written = len(self.seen)
        _write_whole(self.directory / f"reach-{os.getpid()}.json", _document(names))
        return True


_recorder: _Recorder | None = None
_install_lock = threading.Lock()


def install(directory: Path | str) -> None:
    """Record the overloads DTensor dispatches in this process into ``directory`` (made at
    the first write). Once per process: a later call changes nothing."""
    global _recorder
    with _install_lock:
        if _recorder is not None:
            return
        recorder = _Recorder(Path(directory))
        _wrap_dispatcher(recorder)
        _recorder = recorder
    atexit.register(flush)


def install_from_environment() -> bool:
    """``install`` into ``$DISTCONF_REACH_DIR`` when it is set; whether it is."""
    directory = os.environ.get(ENV_VAR)
    if not directory:
        return False
    install(directory)
    return True


def flush() -> bool:
    """Write this process's record if it grew since the last write; whether it wrote.
    Nothing without ``install``."""
    return _recorder.flush() if _recorder is not None else False


def dispatched() -> frozenset[str]:
    """The overloads recorded in this process so far (empty without ``install``)."""
    if _recorder is None:
        return frozenset()
    with _recorder.lock:
        return frozenset(_recorder.seen.values())


def registered() -> frozenset[str]:
    """The overloads DTensor has a sharding rule for in the running torch: the strategies,
    the single-dim strategies and the rules of its sharding propagator."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    tables = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")
    return frozenset(str(op) for table in tables for op in getattr(propagator, table))


def packet(overload: str) -> str:
    """The op an overload belongs to: ``aten.add`` of ``aten.add.Tensor``."""
    return overload.rpartition(".")[0] or overload


def _wrap_dispatcher(recorder: _Recorder) -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dispatch import OpDispatcher

    for name in _CALLED_FROM_CPP:
        method = getattr(OpDispatcher, name, None)
        if method is None:
            raise RuntimeError(
                f"torch.distributed.tensor._dispatch.OpDispatcher.{name} is gone: review "
                "harness.torchkit.reach for this torch version"
            )
        setattr(OpDispatcher, name, _recording_method(method, recorder))
    # The handlers the dispatcher holds now; those added later (loss_parallel's) call
    # unwrap_to_op_info, which is wrapped above.
    handlers: dict[Any, Callable[..., Any]] = DTensor._op_dispatcher._custom_op_handlers
    for op, handler in list(handlers.items()):
        handlers[op] = _recording_handler(handler, recorder)


def _recording_method(method: Callable[..., Any], recorder: _Recorder) -> Callable[..., Any]:
    @functools.wraps(method)
    def recording(self: Any, op_call: Any, *args: Any, **kwargs: Any) -> Any:
        recorder.add(op_call)
        return method(self, op_call, *args, **kwargs)

    return recording


def _recording_handler(handler: Callable[..., Any], recorder: _Recorder) -> Callable[..., Any]:
    @functools.wraps(handler)
    def recording(op_call: Any, *args: Any, **kwargs: Any) -> Any:
        recorder.add(op_call)
        return handler(op_call, *args, **kwargs)

    return recording


def _document(names: list[str]) -> str:
    import torch

    record = {"torch": torch.__version__, "pid": os.getpid(), "dispatched": names}
    return json.dumps(record, indent=1) + "\n"


def _write_whole(path: Path, text: str) -> None:
    """All or nothing: a reader never sees half a file (a temp beside it, renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        temp.write_text(text, encoding="utf-8")
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
