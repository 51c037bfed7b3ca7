"""specs.zero_overlap against torch: DDP's bucket assignment, and which rank ZeRO gives each
piece of each bucket with ``shard_buckets=True`` (or that it raises)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from harness import RankContext, open_world
from specs.zero_overlap import ddp_buckets, ready_order, shard_pieces

CAPS = [1024 * 1024, 25 * 1024 * 1024]


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(1, 300_000), min_size=1, max_size=8))
def test_ddp_buckets_follow_torch(numels: list[int]) -> None:
    tensors = [torch.empty(n, dtype=torch.float64) for n in numels]
    indices, _ = dist._compute_bucket_assignment_by_size(tensors, CAPS)
    assert ddp_buckets(numels, 8) == [[numels[i] for i in bucket] for bucket in indices]


def _pieces_on_rank(ctx: RankContext, dims: tuple[int, ...], bias: bool) -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    layers = [nn.Linear(a, b, bias=bias) for a, b in itertools.pairwise(dims)]
    ddp = DistributedDataParallel(nn.Sequential(*layers).double())
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True, lr=0.01
    )
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero, shard_buckets=True))
    x = torch.ones(1, dims[0], dtype=torch.float64)
    try:
        for _ in range(3):
            zero.zero_grad()
            ddp(x).sum().backward()
    except AssertionError as exc:
        return str(exc)
    buckets = zero._overlap_info.params_per_bucket
    found: list[list[tuple[int, int]]] = [[] for _ in buckets]
    for rank, assignments in enumerate(zero._bucket_assignments_per_rank):
        for index, assignment in assignments.items():
            found[index].append((assignment.offset, rank))
    return [[p.numel() for p in b] for b in buckets], [[r for _, r in sorted(f)] for f in found]


MODELS = [
    ((3, 4, 5), True),
    ((3, 4, 5), False),
    ((100, 200, 50), True),
    ((50, 60, 70, 80), False),
    ((1, 1, 1), True),
    ((20, 9, 30, 2), True),
    ((7, 5), False),
]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shard_pieces_follow_zero(world_size: int) -> None:
    with open_world("threads", world_size, timeout=120) as world:
        for dims, bias in MODELS:
            seen = world.run(_pieces_on_rank, dims, bias)[0]
            buckets = ddp_buckets(ready_order(dims, bias), 8)
            expected = shard_pieces(buckets, world_size)
            if expected is None:
                assert seen == "All indices are disallowed", (dims, bias, seen)
            else:
                assert seen == (buckets, expected), (dims, bias)
