"""distconf: property-based conformance checks for PyTorch's distributed training stack.

The public API: ``open_world`` gives a World of ranks (threads today), ``World.run(fn,
*args)`` runs ``fn(ctx, *args)`` on every rank, and a failure on any rank raises
``RankFailure`` with every rank's status.
"""

from harness.runners import AllRanksSkipped, RankFailure, RankOutcome, World, Worlds, open_world

__all__ = ["AllRanksSkipped", "RankFailure", "RankOutcome", "World", "Worlds", "open_world"]
__version__ = "0.1.0"
