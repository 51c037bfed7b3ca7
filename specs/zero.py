"""Reference model of ZeroRedundancyOptimizer's parameter partition (sorted-greedy).

For each parameter group in order, the group's parameters are taken largest first (ties keep
their order in the group) and each goes to the rank that holds the fewest elements so far
(ties: the lowest rank). The running totals carry over from one group to the next, so a
later group fills in where earlier groups left ranks light.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.errors import check_int, require


def partition(group_sizes: Sequence[Sequence[int]], world_size: int) -> list[list[list[int]]]:
    """``result[rank][group]``: indices (within the group) of the parameters ``rank`` owns.

    ``group_sizes[g][i]`` is the number of elements of parameter ``i`` of group ``g``.
    """
    check_int("world_size", world_size)
    for g, sizes in enumerate(group_sizes):
        counts = all(isinstance(s, int) and s >= 0 for s in sizes)
        require(counts, f"group_sizes[{g}]", list(sizes), "non-negative ints")
    totals = [0] * world_size
    owned: list[list[list[int]]] = [[[] for _ in group_sizes] for _ in range(world_size)]
    for g, sizes in enumerate(group_sizes):
        for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            rank = totals.index(min(totals))
            owned[rank][g].append(index)
            totals[rank] += sizes[index]
    return owned


def rank_totals(group_sizes: Sequence[Sequence[int]], world_size: int) -> list[int]:
    """Elements each rank owns under ``partition``."""
    owned = partition(group_sizes, world_size)
    return [
        sum(group_sizes[g][i] for g, indices in enumerate(groups) for i in indices)
        for groups in owned
    ]
