"""harness.torchkit.collectives: per-rank counts of c10d and functional collectives, per group, on
both runners; counters of concurrent rank threads never see each other's collectives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from harness import open_world
from harness.torchkit import collectives
from harness.torchkit.collectives import by_op, counting


def _c10d_calls(ctx):
    mesh = ctx.mesh((2, ctx.world_size // 2), ("a", "b"))
    tensor = torch.ones(4)
    outside = torch.ones(1)
    dist.all_reduce(outside)  # before the block: not counted
    with counting() as counts:
        dist.all_reduce(tensor, group=mesh.get_group("a"))
        dist.all_reduce(tensor, group=mesh.get_group("a"))
        out = torch.empty(4 // mesh.size(1))
        dist.reduce_scatter_tensor(out, tensor, group=mesh.get_group("b"))
        dist.all_gather_into_tensor(torch.empty(4 * ctx.world_size), tensor)
    return dict(counts)


@pytest.mark.parametrize("runner", ["threads", "processes"])
def test_counts_c10d_calls_per_group_on_each_rank(runner):
    with open_world(runner, world_size=4, timeout=60.0) as world:
        results = world.run(_c10d_calls)
    for rank, counts in enumerate(results):
        column = (rank % 2, rank % 2 + 2)
        row = (rank - rank % 2, rank - rank % 2 + 1)
        assert counts == {
            ("all_reduce", column): 2,
            ("reduce_scatter", row): 1,
            ("all_gather", (0, 1, 2, 3)): 1,
        }


def _dtensor_redistribute(ctx):
    mesh = ctx.mesh((ctx.world_size,))
    sharded = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    with counting() as counts:
        sharded.redistribute(mesh, [Replicate()])
    return dict(counts)


@pytest.mark.parametrize("runner", ["threads", "processes"])
def test_counts_the_functional_collectives_dtensor_issues(runner):
    with open_world(runner, world_size=2, timeout=60.0) as world:
        results = world.run(_dtensor_redistribute)
    assert results == [{("all_gather", (0, 1)): 1}] * 2


def _ranks_count_different_numbers(ctx):
    # Rank r issues r + 1 all-reduces on its own one-rank group; the others do not see them.
    groups = [dist.new_group([r]) for r in range(ctx.world_size)]
    with counting() as counts:
        for _ in range(ctx.rank + 1):
            dist.all_reduce(torch.ones(1), group=groups[ctx.rank])
    return by_op(counts)


def test_rank_threads_count_only_their_own_collectives():
    with open_world("threads", world_size=4) as world:
        for _ in range(3):
            assert world.run(_ranks_count_different_numbers) == [
                {"all_reduce": r + 1} for r in range(4)
            ]


def _nested(ctx):
    with counting() as outer:
        dist.all_reduce(torch.ones(1))
        with counting() as inner:
            dist.all_reduce(torch.ones(1))
    return by_op(outer), by_op(inner)


def test_nested_blocks_both_count():
    with open_world("threads", world_size=2) as world:
        assert world.run(_nested) == [({"all_reduce": 2}, {"all_reduce": 1})] * 2


def test_functions_are_restored_after_the_last_block():
    original = dist.all_reduce
    with counting(), counting():
        assert dist.all_reduce is not original
    assert dist.all_reduce is original


def test_a_patch_installed_on_top_is_left_in_place():
    original = dist.all_reduce

    def injected(*args, **kwargs):
        return original(*args, **kwargs)

    try:
        with counting():
            dist.all_reduce = injected
        assert dist.all_reduce is injected
    finally:
        dist.all_reduce = original
        collectives._installed.clear()


def test_by_op_sums_over_groups():
    from collections import Counter

    counts = Counter({("all_reduce", (0,)): 2, ("all_reduce", (0, 1)): 1, ("broadcast", (0,)): 1})
    assert by_op(counts) == {"all_reduce": 3, "broadcast": 1}


def test_a_function_this_torch_lacks_is_not_counted(monkeypatch):
    # torch 2.11 has no dist.reduce_scatter_single; counting must still install the rest
    monkeypatch.delattr(dist, "reduce_scatter_single")
    original = dist.all_reduce
    with counting():
        assert dist.all_reduce is not original
        assert not hasattr(dist, "reduce_scatter_single")
    assert dist.all_reduce is original
    assert not hasattr(dist, "reduce_scatter_single")
