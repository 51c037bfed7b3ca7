"""DTensor's fake shape propagation shared by rank threads: computed once a key, exact keys,
torch's own method back when the last thread World closes."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from harness import RankFailure, open_world
from harness.torchkit import tensor_meta


@pytest.fixture
def counted():
    """A thread World of 4 whose fake runs (the misses) are counted per key."""
    with open_world("threads", world_size=4, timeout=60.0) as world:
        assert tensor_meta.installed()
        tensor_meta.clear()
        runs: Counter = Counter()
        lock = threading.Lock()
        original = tensor_meta._original

        def counting(self, op_schema):
            with lock:
                runs[tensor_meta._key_of(op_schema)] += 1
            return original(self, op_schema)

        tensor_meta._original = counting
        try:
            yield world, runs
        finally:  # before the World closes and puts torch's own method back
            tensor_meta._original = original


def _program(ctx, rows):
    mesh = ctx.mesh((ctx.world_size,))
    x = distribute_tensor(torch.arange(rows * 3.0).reshape(rows, 3), mesh, [Shard(0)])
    y = distribute_tensor(torch.ones(rows, 3), mesh, [Replicate()])
    out = ((x + y) * 2).sum(0)
    pieces = torch.split(x, 1, dim=1)  # a list of outputs
    return out.full_tensor().tolist(), [tuple(p.shape) for p in pieces]


def test_every_rank_gets_the_shapes_one_fake_run_computed(counted):
    world, runs = counted
    results = world.run(_program, 7)  # 7 rows: a shape no other test uses
    want = ((torch.arange(21.0).reshape(7, 3) + 1) * 2).sum(0).tolist()
    assert results == [(want, [(7, 1)] * 3)] * 4
    assert runs, "no fake run went through the shared table"
    assert None not in runs
    assert set(runs.values()) == {1}, runs  # four ranks, one fake run a key
    before = sum(runs.values())
    assert world.run(_program, 7) == results
    assert sum(runs.values()) == before  # met again: no fake run at all


def _mismatched(ctx):
    mesh = ctx.mesh((ctx.world_size,))
    x = distribute_tensor(torch.ones(5, 3), mesh, [Replicate()])
    y = distribute_tensor(torch.ones(4, 3), mesh, [Replicate()])
    return x + y


def test_a_fake_run_that_raises_raises_on_every_rank_and_is_not_kept(counted):
    world, _ = counted
    with pytest.raises(RankFailure) as failed:
        world.run(_mismatched)
    assert [o.status for o in failed.value.outcomes] == ["error"] * 4
    assert all("broadcast a dimension of length 4" in o.summary for o in failed.value.outcomes), [
        o.summary for o in failed.value.outcomes
    ]
    assert not any(k is not None and ((5, 3) in str(k)) for k in tensor_meta._table), "kept"
    assert world.run(lambda ctx: ctx.rank) == [0, 1, 2, 3]


def _spec(shape, dtype=torch.float32):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    class Mesh:  # only its device type is read
        device_type = "cpu"

    stride = torch.empty(shape).stride()
    meta = TensorMeta(shape=torch.Size(shape), stride=stride, dtype=dtype)
    spec = DTensorSpec.__new__(DTensorSpec)
    object.__setattr__(spec, "mesh", Mesh())
    object.__setattr__(spec, "tensor_meta", meta)
    return spec


def test_keys_tell_argument_types_and_shapes_apart(counted):
    describe = tensor_meta._describe
    assert len({describe(1), describe(1.0), describe(True)}) == 3
    assert describe((1, 2)) != describe([1, 2])
    assert describe(_spec((2, 3))) != describe(_spec((3, 2)))
    assert describe(_spec((2, 3))) != describe(_spec((2, 3), torch.float64))
    assert describe(_spec((2, 3))) == describe(_spec((2, 3)))
    uncacheable = tensor_meta._UNCACHEABLE
    assert describe(torch.ones(1)) is uncacheable
    assert describe([1, torch.ones(1)]) is uncacheable
    assert describe({"alpha": object()}) is uncacheable
    assert describe({"alpha": 2}) == (dict, (("alpha", (int, 2)),))


def test_a_list_result_is_each_callers_own(monkeypatch, counted):
    runs = []
    counting = tensor_meta._original
    monkeypatch.setattr(tensor_meta, "_key_of", lambda op_schema: ("a list result",))
    tensor_meta._original = lambda self, op_schema: runs.append(1) or [1, 2]
    try:
        first = tensor_meta._shared(None, None)
        first.append(3)
        assert tensor_meta._shared(None, None) == [1, 2]
    finally:
        tensor_meta._original = counting
    assert runs == [1]


def test_the_last_thread_world_to_close_puts_torchs_method_back():
    own = ShardingPropagator.__dict__["_propagate_tensor_meta_non_cached"]
    if tensor_meta.installed():
        pytest.skip("another thread World of this process is open")
    with open_world("threads", world_size=2) as first:
        first.run(lambda ctx: None)
        with open_world("threads", world_size=2) as second:
            second.run(lambda ctx: None)
        assert tensor_meta.installed()
    assert not tensor_meta.installed()
    assert ShardingPropagator.__dict__["_propagate_tensor_meta_non_cached"] is own
