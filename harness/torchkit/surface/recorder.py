"""The run-time recorder: which options each test passes to the inventoried callables, and
with which values.

``install(directory)`` wraps every callable of ``inventory()`` once per process, where it is
defined and wherever a loaded module holds it under any name (``from torch.distributed.fsdp
import fully_shard``, ``... import zeros as dtensor_zeros``); modules imported later take the
wrapped one from the module they import it from. ``begin(test)`` says which test the calls
that follow belong to (every thread's: rank threads call for the test the driver runs);
``flush()`` appends what was recorded since the last flush to
``directory/surface-<pid>.jsonl``, one line per test, so it is cheap to call after each test.

Only calls whose immediate caller is outside torch's package count: a call torch makes of
its own API (``AdamW`` calling ``Adam.__init__``, FSDP calling ``DTensor.to_local``) says
nothing of what a spec chose, and is passed straight through.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.torchkit.surface.inventory import CALLABLES, Api, callable_of, inventory, resolve
from harness.torchkit.surface.values import summary

ENV_VAR = "DISTCONF_SURFACE_DIR"
FILE_GLOB = "surface-*.jsonl"
"""The surface files of a directory, one per process that recorded."""
OUTSIDE_TESTS = "(outside tests)"
"""The test calls made before the first test or between tests are recorded under."""
RANK_PROCESSES = "(rank processes)"
"""The test a rank process's calls are recorded under: the driver's calls to a rank carry
no test, and every call a rank runs is some test's."""
MOST_VALUES = 16
"""Distinct values kept per option and test; the others are counted under ``OTHER``."""
OTHER = "(other values)"
_SCANNED = ("torch", "harness", "suites", "specs")
"""The loaded modules searched for references to a callable being wrapped."""


@dataclass
class Calls:
    """One callable's calls from outside torch in one test: how many, and per option the
    values passed explicitly (each with how many calls passed it)."""

    calls: int = 0
    options: dict[str, Counter[str]] = field(default_factory=dict)

    def add(self, passed: dict[str, str]) -> None:
        self.calls += 1
        for name, text in passed.items():
            values = self.options.setdefault(name, Counter())
            if text not in values and len(values) >= MOST_VALUES:
                text = OTHER
            values[text] += 1


class _Recorder:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.test = OUTSIDE_TESTS
        self.pending: dict[str, dict[str, Calls]] = {}
        self.lock = threading.Lock()
        self.writing = threading.Lock()
        """Held while a flush writes: a header before any record, lines never interleaved."""
        self.header_written = False

    def add(self, api: str, passed: dict[str, str]) -> None:
        with self.lock:
            per_api = self.pending.setdefault(self.test, {})
            per_api.setdefault(api, Calls()).add(passed)

    def flush(self) -> bool:
        with self.writing:
            with self.lock:
                pending, self.pending = self.pending, {}
            if not pending:
                return False
            lines = [] if self.header_written else [_header()]
            lines += [json.dumps({"test": t, "calls": _jsonable(c)}) for t, c in pending.items()]
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"surface-{os.getpid()}.jsonl"
            with path.open("a", encoding="utf-8") as file:
                file.write("".join(line + "\n" for line in lines))
            self.header_written = True
        return True


_recorder: _Recorder | None = None
_install_lock = threading.Lock()


def install(directory: Path | str) -> None:
    """Record the options passed to the inventoried callables in this process into
    ``directory`` (made at the first write). Once per process: a later call changes nothing."""
    global _recorder
    with _install_lock:
        if _recorder is not None:
            return
        recorder = _Recorder(Path(directory))
        _wrap_all(recorder)
        _recorder = recorder
    atexit.register(flush)


def install_from_environment() -> bool:
    """``install`` into ``$DISTCONF_SURFACE_DIR`` when it is set; whether it is."""
    directory = os.environ.get(ENV_VAR)
    if not directory:
        return False
    install(directory)
    return True


def begin(test: str) -> None:
    """The calls from now on are the test ``test``'s (nothing without ``install``)."""
    if _recorder is not None:
        with _recorder.lock:
            _recorder.test = test


def end() -> bool:
    """The test is over: write what it recorded; whether anything was written."""
    if _recorder is None:
        return False
    written = _recorder.flush()
    begin(OUTSIDE_TESTS)
    return written


def flush() -> bool:
    """Write what was recorded since the last write; whether anything was."""
    return _recorder.flush() if _recorder is not None else False


def recorded() -> dict[str, dict[str, Calls]]:
    """What was recorded and not yet written, per test and callable (for tests)."""
    if _recorder is None:
        return {}
    with _recorder.lock:
        return {test: dict(calls) for test, calls in _recorder.pending.items()}


def _wrap_all(recorder: _Recorder) -> None:
    apis = {api.key: api for api in inventory()}
    replacements: dict[int, Any] = {}
    for entry in CALLABLES:
        module, _, qualname = entry.path.partition(":")
        api = apis.get(f"{module}.{qualname}")
        resolved = resolve(entry.path)
        if api is None or resolved is None:
            continue
        owner, attribute = resolved
        wrapped = _wrapped_attribute(attribute, api, recorder)
        setattr(owner, qualname.rpartition(".")[2], wrapped)
        if not isinstance(attribute, type):  # a class is changed in place
            replacements[id(attribute)] = wrapped
    _replace_references(replacements)


def _replace_references(replacements: dict[int, Any]) -> None:
    """Point every loaded module's name for a wrapped callable at its wrapper."""
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(_SCANNED):
            continue
        for attribute, value in list(vars(module).items()):
            if id(value) in replacements and not isinstance(value, staticmethod | classmethod):
                setattr(module, attribute, replacements[id(value)])


def _wrapped_attribute(attribute: Any, api: Api, recorder: _Recorder) -> Any:
    """``attribute`` recording its calls: a class has its ``__init__`` wrapped in place."""
    function = callable_of(attribute)
    recording = _recording(function, api, recorder)
    if isinstance(attribute, type):
        attribute.__init__ = recording  # type: ignore[misc]
        return attribute
    if isinstance(attribute, staticmethod):
        return staticmethod(recording)
    if isinstance(attribute, classmethod):
        return classmethod(recording)
    return recording


def _recording(function: Callable[..., Any], api: Api, recorder: _Recorder) -> Callable[..., Any]:
    signature = inspect.signature(function)
    options = frozenset(option.name for option in api.options)
    key = api.key

    @functools.wraps(function)
    def recording(*args: Any, **kwargs: Any) -> Any:
        if not _called_by_torch(sys._getframe(1)):
            recorder.add(key, _passed(signature, options, args, kwargs))
        return function(*args, **kwargs)

    return recording


@functools.cache
def _internal_files() -> tuple[str, ...]:
    """torch's package, and this file: a wrapper calling a wrapped parent's ``__init__`` (a
    class inheriting it) is no call of a spec's."""
    import torch

    return (os.path.dirname(torch.__file__) + os.sep, __file__)


def _called_by_torch(frame: Any) -> bool:
    return str(frame.f_code.co_filename).startswith(_internal_files())


def _passed(
    signature: inspect.Signature, options: frozenset[str], args: Any, kwargs: Any
) -> dict[str, str]:
    """The options a call passes explicitly, positionally or by keyword, and their values."""
    try:
        arguments = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:  # the call itself is wrong: torch will say so; its keywords still count
        arguments = kwargs
    return {name: summary(value) for name, value in arguments.items() if name in options}


def _jsonable(calls: dict[str, Calls]) -> dict[str, Any]:
    return {
        api: {"calls": c.calls, "options": {n: dict(v) for n, v in c.options.items()}}
        for api, c in calls.items()
    }


def _header() -> str:
    import torch

    return json.dumps({"kind": "header", "torch": torch.__version__, "pid": os.getpid()})
