"""distconf: property-based conformance checks for PyTorch's distributed training stack.

The public API: ``open_world`` gives a World of ranks (threads or processes), ``World.run(fn,
*args)`` runs ``fn(ctx, *args)`` on every rank with ``ctx`` a ``RankContext``, and a failure
on any rank raises ``RankFailure`` with every rank's status. ``Worlds`` serves a session's
Worlds by size. Every error distconf raises on purpose is a ``DistconfError``; a value it does
not accept is an ``InvalidArgument``. Importing this package does not import torch.
"""

from harness.errors import DistconfError, InvalidArgument, WorldStartError
from harness.runners import AllRanksSkipped, RankFailure, RankOutcome, World, Worlds, open_world
from harness.torchkit.context import RankContext

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
