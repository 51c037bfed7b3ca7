"""distconf: property-based conformance checks for PyTorch's distributed training stack.

The public API: ``open_world`` gives a World of ranks (threads or processes), ``World.run(fn,
*args)`` runs ``fn(ctx, *args)`` on every rank with ``ctx`` a ``RankContext``, and a failure
on any rank raises ``RankFailure`` with every rank's status. ``Worlds`` serves a session's
Worlds by size. Every error distconf raises on purpose is a ``DistconfError``; a value it does
not accept is an ``InvalidArgument``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from harness.errors import DistconfError, InvalidArgument, WorldStartError

if TYPE_CHECKING:
    from harness.runners import AllRanksSkipped, RankFailure, RankOutcome, World, Worlds, open_world
    from harness.torchkit.context import RankContext

# Importing ``harness`` (every ``harness.x`` import does) loads only the errors: ``specs``
# use them and must stay light; the rest loads on first use.
_LAZY = {
    "AllRanksSkipped": "harness.runners",
    "RankFailure": "harness.runners",
    "RankOutcome": "harness.runners",
    "World": "harness.runners",
    "Worlds": "harness.runners",
    "open_world": "harness.runners",
    "RankContext": "harness.torchkit.context",
}

__all__ = [
    "AllRanksSkipped",
    "DistconfError",
    "InvalidArgument",
    "RankContext",
    "RankFailure",
    "RankOutcome",
    "World",
    "WorldStartError",
    "Worlds",
    "open_world",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
