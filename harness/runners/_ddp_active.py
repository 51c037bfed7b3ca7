"""DDP's active module, kept per rank thread while thread Worlds are installed.

DDP marks the module whose forward is running in a class attribute
(``DistributedDataParallel._active_ddp_module``), which dynamo reads through
``_get_active_ddp_module`` to split a compiled graph at that module's gradient buckets.
Its comment says "the given thread", but the attribute is the process's, saved and restored
around each forward: rank threads interleaving their forwards leave a module behind (A
sets, B sets saving A, A restores none, B restores A), and every later compile in the
process splits its graph by a DDP module no longer running (``AssertionError: First bucket
should be smaller/equal to other buckets``). A rank process is the only rank in its process:
there the attribute is what torch meant.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

_local = threading.local()
_replaced: dict[str, Any] = {}


def install() -> None:
    """Keep DDP's active module per thread (once, until ``uninstall``)."""
    if _replaced:
        return
    for name in ("_inside_ddp_forward", "_get_active_ddp_module"):
        _replaced[name] = DistributedDataParallel.__dict__[name]
    DistributedDataParallel._inside_ddp_forward = _inside_ddp_forward  # type: ignore[method-assign]
    DistributedDataParallel._get_active_ddp_module = classmethod(_active_module)  # type: ignore[method-assign,assignment]


def uninstall() -> None:
    """Give DDP back its own methods."""
    for name, method in _replaced.items():
        setattr(DistributedDataParallel, name, method)
    _replaced.clear()


def _thread_forward(self: DistributedDataParallel) -> Iterator[None]:
    previous = getattr(_local, "module", None)
    _local.module = self
    try:
        yield
    finally:
        _local.module = previous


# Wrapped as torch wraps its own: dynamo skips the marking, and traces the forward inside it.
_inside_ddp_forward = contextlib.contextmanager(
    torch._disable_dynamo(_thread_forward, recursive=False)  # type: ignore[attr-defined]
)


def _active_module(cls: type) -> DistributedDataParallel | None:
    return getattr(_local, "module", None)
