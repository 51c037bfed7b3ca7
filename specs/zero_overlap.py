"""Which rank steps which parameters when DDP's communication hook runs ZeRO's step with
``shard_buckets=True`` (``ddp_zero_hook.hook_with_zero_step``): a model of torch 2.13's
``ZeroRedundancyOptimizer._bucket_assignments_per_rank``, fed the DDP buckets the hook sees.

DDP rebuilds its buckets after the first iteration in the order gradients became ready (for
a stack of Linears: the last Linear's bias, its weight, ..., the first Linear's weight),
closing a bucket as soon as it holds at least its byte limit (1 MiB for the first, then
``bucket_cap_mb``, 25 MiB by default). ZeRO then takes the buckets in increasing total size
(ties in bucket order) and cuts each into pieces of consecutive parameters: a piece closes
before the parameter that would bring it to ``total / world_size`` elements or more (a piece
is never empty), and each piece goes to the least-loaded rank that holds no piece of that
bucket yet. A bucket that needs more pieces than there are ranks has no rank left for a
piece: torch raises ``AssertionError('All indices are disallowed')``.

Plain Python: no torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from harness.errors import check_int, require

FIRST_BUCKET_BYTES = 1024 * 1024
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def ready_order(dims: Sequence[int], bias: bool) -> list[int]:
    """Element counts of a Linear stack's parameters in gradient-ready order."""
    require(len(dims) >= 2, "dims", tuple(dims), "at least two sizes (one Linear)")
    numels: list[int] = []
    for d_in, d_out in reversed(list(itertools.pairwise(dims))):
        numels.extend([d_out, d_out * d_in] if bias else [d_out * d_in])
    return numels


def ddp_buckets(
    numels: Sequence[int],
    itemsize: int,
    *,
    first: int = FIRST_BUCKET_BYTES,
    cap: int = DEFAULT_BUCKET_BYTES,
) -> list[list[int]]:
    """DDP's buckets of parameters with ``numels`` elements of ``itemsize`` bytes, in order."""
    check_int("itemsize", itemsize, 1)
    buckets: list[list[int]] = []
    current: list[int] = []
    size, limit = 0, first
    for numel in numels:
        current.append(numel)
        size += numel * itemsize
        if size >= limit:
            buckets.append(current)
            current, size, limit = [], 0, cap
    if current:
        buckets.append(current)
    return buckets


def _least_loaded(loads: list[int], taken: set[int]) -> int | None:
    best: int | None = None
    for rank, load in enumerate(loads):
        if rank not in taken and (best is None or load < loads[best]):
            best = rank
    return best


def shard_pieces(buckets: Sequence[Sequence[int]], world_size: int) -> list[list[int]] | None:
    """For each bucket, the rank of each piece ZeRO cuts it into (in bucket order); None
    where some bucket needs more pieces than there are ranks (torch raises)."""
    check_int("world_size", world_size, 1)
    threshold = sum(sum(b) for b in buckets) / world_size
    loads = [0] * world_size
    ranks: list[list[int]] = [[] for _ in buckets]
    for index in sorted(range(len(buckets)), key=lambda i: sum(buckets[i])):
        taken: set[int] = set()
        start, size = 0, 0
        bucket = buckets[index]
        for position, numel in enumerate(bucket):
            if size + numel >= threshold and position > start:
                rank = _least_loaded(loads, taken)
                if rank is None:
                    return None
                taken.add(rank)
                ranks[index].append(rank)
                loads[rank] += size
                start, size = position, 0
            size += numel
        rank = _least_loaded(loads, taken)
        if rank is None:
            return None
        taken.add(rank)
        ranks[index].append(rank)
        loads[rank] += size
    return ranks


def fits(dims: Sequence[int], bias: bool, itemsize: int, world_size: int) -> bool:
    """Whether ``shard_buckets=True`` can place every piece of a Linear stack's buckets."""
    buckets = ddp_buckets(ready_order(dims, bias), itemsize)
    return shard_pieces(buckets, world_size) is not None
