"""``torch.compile`` for the compile suite: compiled callables cached per process by the
structure of what they compile, and a backend that counts the graphs it is handed.

A compile costs seconds, a call of a cached graph milliseconds: ``compiled`` keeps one
compiled callable per key (a program's structure and its mesh), so that examples of one
structure reuse it. Each callable is compiled from a code object of its own, so dynamo's
cache (kept on the code object) holds that key's graphs only: a graph compiled again for a
key it has seen is a recompilation (a guard failed), never another key's entry.

Dynamo's settings are process-wide (rank threads share them): ``configure`` sets them once
per process, the same for every rank. Shapes stay static (a recompilation must not turn a
structure's dims symbolic behind the check's back), and a key that ran past the recompile
limit raises, where dynamo would otherwise run the function eagerly, unseen.
"""

from __future__ import annotations

import itertools
import threading
import time
import types
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.cases.compile import refusal_kind

RECOMPILE_LIMIT = 16
"""Graphs one key may compile: a structure's guards fail only on what the structure does
not fix (a leaf's strides, say), a handful of times at most."""

_numbers = itertools.count()
_lock = threading.Lock()
_configured = False


@dataclass
class Compiled:
    """One key's compiled callable and what compiling it cost so far."""

    call: Callable[..., Any]
    graphs: int = 0
    """Graphs the backend was handed (one per dynamo compile: fullgraph gives one a call)."""
    refusal: str = ""
    """Why torch refused to compile it (``refusal_kind``: the message's first line)."""
    called: set[Hashable] = field(default_factory=set)
    """What it was called with so far, by structure (a key may leave part of a structure
    out: a call with one it has not seen must compile a graph of its own)."""


_cache: dict[Hashable, Compiled] = {}


def configure() -> None:
    """Dynamo's process-wide settings for the suite (see the module's docstring)."""
    global _configured
    with _lock:
        if _configured:
            return
        import torch._dynamo.config as config

        config.automatic_dynamic_shapes = False
        config.recompile_limit = RECOMPILE_LIMIT
        config.fail_on_recompile_limit_hit = True
        _configured = True


def compiled(key: Hashable, make: Callable[[], Callable[..., Any]], backend: str) -> Compiled:
    """The cached callable of ``key``, or ``make()`` compiled with ``backend`` (fullgraph)
    and cached under it."""
    configure()
    with _lock:
        held = _cache.get(key)
        if held is not None:
            return held
        entry = Compiled(call=lambda *args: None)
        _cache[key] = entry
    compiler = torch._dynamo.lookup_backend(backend)

    def counting(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        entry.graphs += 1
        return compiler(graph, example_inputs)

    entry.call = torch.compile(_own_code(make()), backend=counting, fullgraph=True)
    return entry


def cached(key: Hashable) -> bool:
    """Whether ``key`` has a compiled callable in this process."""
    with _lock:
        return key in _cache


def _own_code(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with a copy of its code object, so that dynamo caches its graphs apart."""
    assert isinstance(function, types.FunctionType), f"a Python function, got {function!r}"
    code = function.__code__.replace(co_name=f"{function.__code__.co_name}_{next(_numbers)}")
    copy = types.FunctionType(
        code, function.__globals__, code.co_name, function.__defaults__, function.__closure__
    )
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def refusal_of(error: BaseException) -> str | None:
    """``"<type>: <first line>"`` where ``error`` is torch refusing to compile (a graph
    break under fullgraph, an op dynamo cannot trace), else None."""
    kind = refusal_kind([cls.__name__ for cls in type(error).__mro__])
    if kind is None:
        return None
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{kind}: {first}"[:200]


@dataclass(frozen=True)
class Timed:
    """What one compiled call cost: the graphs compiled during it and its seconds."""

    graphs: int
    seconds: float


def timed(entry: Compiled, run: Callable[[], Any]) -> tuple[Any, Timed]:
    """``run()``'s result, and the graphs ``entry`` compiled while it ran and its seconds."""
    before, start = entry.graphs, time.perf_counter()
    result = run()
    return result, Timed(entry.graphs - before, time.perf_counter() - start)


@dataclass
class BlockGraphs:
    """The graphs the backend was handed for a model's compiled blocks."""

    graphs: int = 0


BLOCK_PREFIX = "._orig_mod.inner"
"""What compiling a block puts into its parameters' names (``torch.compile``'s wrapper, then
the block's own attribute): ``0._orig_mod.inner.weight`` is the model's ``0.weight``."""


def compile_blocks(model: torch.nn.Sequential, backend: str, counted: BlockGraphs) -> None:
    """Each child of ``model`` with parameters replaced by ``torch.compile(block, backend=...,
    fullgraph=True)`` of a block holding it; the graphs compiled counted into ``counted``.

    Each block's ``forward`` is a code object of its own, so dynamo's cache (kept on the code
    object) holds that block's graphs only: rank threads never share one, and the run's
    models never pile up in one cache past its recompile limit (``torch.compile`` of a
    Linear itself compiles one wrapper code object shared by every module of the process).
    Nothing is reused across models: dynamo guards on the module object, so each new model
    compiles its blocks anew whatever cache it found."""
    configure()
    compiler = torch._dynamo.lookup_backend(backend)

    def counting(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        counted.graphs += 1
        return compiler(graph, example_inputs)

    for position, child in enumerate(model):
        if next(child.parameters(), None) is None:
            continue
        forward = _own_code(_block_forward)
        block_class = type(f"Block{next(_numbers)}", (_Block,), {"forward": forward})
        compiled_block = torch.compile(block_class(child), backend=counting, fullgraph=True)
        assert isinstance(compiled_block, torch.nn.Module), "torch.compile of a module is one"
        model[position] = compiled_block


class _Block(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner


def _block_forward(self: _Block, x: torch.Tensor) -> Any:
    return self.inner(x)
