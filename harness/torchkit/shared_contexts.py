"""Process-wide torch context managers, shared by the rank threads of a process.

``loss_parallel()`` swaps DTensor's op handlers for the whole process (torch 2.13): entered
and left by every rank thread, one rank's exit removes the handlers under another rank's
cross-entropy (``KeyError: aten._log_softmax``). ``shared(key, factory)`` enters the context
once per process, at the first rank's entry, and leaves it at the last rank's exit, so a
check function uses it the same way whether its ranks are threads or processes (a rank
process is the only user in its process). The context is left only when no rank is
inside it; a rank that enters after the others left enters it anew.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

_lock = threading.Lock()
_entered: dict[str, tuple[AbstractContextManager[Any], int]] = {}


@contextlib.contextmanager
def shared(key: str, factory: Callable[[], AbstractContextManager[Any]]) -> Iterator[None]:
    """``factory()`` entered by the first of this process's users of ``key``, left by the
    last."""
    with _lock:
        if key in _entered:
            manager, users = _entered[key]
            _entered[key] = (manager, users + 1)
        else:
            manager = factory()
            manager.__enter__()
            _entered[key] = (manager, 1)
    try:
        yield
    finally:
        with _lock:
            manager, users = _entered[key]
            if users == 1:
                del _entered[key]
                manager.__exit__(None, None, None)
            else:
                _entered[key] = (manager, users - 1)


def loss_parallel() -> AbstractContextManager[None]:
    """``torch.distributed.tensor.parallel.loss_parallel()``, shared by the rank threads."""
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    return shared("loss_parallel", torch_loss_parallel)


def users(key: str) -> int:
    """How many users hold ``key`` entered in this process now."""
    with _lock:
        return _entered[key][1] if key in _entered else 0
