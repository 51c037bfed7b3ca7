"""The thread runner under failure: exceptions, hangs, skips, long runs."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from harness import AllRanksSkipped, DistconfError, RankFailure, open_world
from harness.runners import WorldCache, Worlds
from harness.runners._threaded_pg import RunnerUnsupported


@pytest.fixture(scope="module")
def world4():
    with open_world("threads", world_size=4) as world:
        yield world


def _rank(ctx):
    return ctx.rank


def _all_reduce_ones(ctx):
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    return tensor.item()


@pytest.mark.parametrize("size", [1, 2, 3, 4, 6])
def test_returns_values_in_rank_order(size):
    with open_world("threads", world_size=size) as world:
        assert world.run(_rank) == list(range(size))
        assert world.run(_all_reduce_ones) == [float(size)] * size


def test_arguments_reach_every_rank(world4):
    assert world4.run(lambda ctx, a, b: (ctx.rank, a + b), 2, 3) == [(r, 5) for r in range(4)]


def _fails_on_rank_2(ctx):
    if ctx.rank == 2:
        raise ValueError("rank two says no")
    dist.barrier()


def test_exception_on_one_rank_releases_the_others(world4):
    with pytest.raises(RankFailure) as info:
        world4.run(_fails_on_rank_2)
    failure = info.value
    assert failure.primary.rank == 2
    assert failure.statuses == {0: "waiting", 1: "waiting", 2: "error", 3: "waiting"}
    assert "ValueError: rank two says no" in str(failure)
    assert "_fails_on_rank_2" in failure.primary.traceback
    assert isinstance(failure.__cause__, ValueError)
    assert not failure.timed_out
    assert world4.run(_all_reduce_ones) == [4.0] * 4


def _fails_on_ranks_1_and_3(ctx):
    if ctx.rank in (3, 1):
        raise KeyError(f"rank {ctx.rank}")
    dist.barrier()


def test_primary_rank_is_the_lowest_real_error(world4):
    for _ in range(5):  # deterministic whatever order the threads fail in
        with pytest.raises(RankFailure) as info:
            world4.run(_fails_on_ranks_1_and_3)
        assert info.value.primary.rank == 1
        assert info.value.statuses[3] == "error"


def _exits(ctx):
    if ctx.rank == 0:
        sys.exit(3)
    dist.barrier()


def test_sys_exit_on_a_rank_is_an_error_not_a_release(world4):
    with pytest.raises(RankFailure) as info:
        world4.run(_exits)
    assert info.value.primary.rank == 0
    assert info.value.primary.status == "error"
    assert "SystemExit" in info.value.primary.summary


def _hangs_on_rank_1(ctx):
    if ctx.rank == 1:
        while True:
            time.sleep(0.01)
    dist.barrier()


def test_hang_reports_stacks_and_the_world_is_rebuilt(world4):
    world4.run(_rank)
    generations = world4.generations
    started = time.monotonic()
    with pytest.raises(RankFailure) as info:
        world4.run(_hangs_on_rank_1, timeout=1.0)
    elapsed = time.monotonic() - started
    failure = info.value
    assert failure.timed_out and failure.deadline == 1.0
    assert failure.primary.rank == 1
    assert failure.statuses == {0: "waiting", 1: "timeout", 2: "waiting", 3: "waiting"}
    assert "_hangs_on_rank_1" in failure.outcomes[1].traceback
    assert "allreduce" in failure.outcomes[0].summary
    assert "Python stack of every rank" in str(failure)
    # The deadline bounds the whole call (upstream waits 300 s per thread, one after another).
    assert elapsed < 10
    assert world4.run(_all_reduce_ones) == [4.0] * 4
    assert world4.generations == generations + 1


def _every_rank_sleeps(ctx):
    time.sleep(3600)


def test_every_rank_stuck_still_returns_at_the_deadline():
    with open_world("threads", world_size=4, timeout=0.5) as world:
        started = time.monotonic()
        with pytest.raises(RankFailure) as info:
            world.run(_every_rank_sleeps)
        assert time.monotonic() - started < 10
        assert set(info.value.statuses.values()) == {"timeout"}
        assert info.value.primary.rank == 0
        assert world.run(_rank) == [0, 1, 2, 3]


def _spins_on_rank_1(ctx):
    if ctx.rank == 1:
        while True:  # pure Python, never sleeping: holds the GIL whenever it can
            pass


def test_a_rank_spinning_in_python_is_stopped_after_its_deadline():
    earlier = set(threading.enumerate())  # other tests' ranks stuck in C code stay stuck
    with open_world("threads", world_size=2, timeout=0.5) as world:
        with pytest.raises(RankFailure) as info:
            world.run(_spins_on_rank_1)
        assert info.value.statuses[1] == "timeout"
        spinning = [
            t for t in threading.enumerate() if t not in earlier and t.name.endswith("-rank1")
        ]
        deadline = time.monotonic() + 10
        while any(t.is_alive() for t in spinning) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(t.is_alive() for t in spinning), "the spinning rank thread still runs"
        assert world.run(_rank) == [0, 1]


def test_an_interrupt_that_comes_after_the_call_returned_lets_the_rank_leave_quietly(
    monkeypatch,
):
    from harness.runners.threads import _interrupt

    unhandled: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", unhandled.append)
    earlier = set(threading.enumerate())
    with open_world("threads", world_size=2) as world:
        assert world.run(_rank) == [0, 1]  # both ranks now wait in C for the next message
        (idle,) = [
            t for t in threading.enumerate() if t not in earlier and t.name.endswith("-rank1")
        ]
        _interrupt(idle)  # it shows when the rank next runs Python: the close's stop message
    idle.join(10)
    assert not idle.is_alive(), "the interrupted rank thread still runs after the close"
    assert not unhandled, f"got unhandled {[type(u.exc_value) for u in unhandled]}, should be none"


def test_a_rank_thread_cannot_use_its_own_world(world4):
    def uses_world(ctx):
        refusals = []
        for call in (lambda: world4.run(_rank), world4.check_health, world4.start):
            with pytest.raises(DistconfError, match="was called from a rank thread") as info:
                call()
            refusals.append(str(info.value).split()[0])
        return refusals

    expected = ["world.run", "world.check_health", "world.start"]
    assert world4.run(uses_world) == [expected] * 4


def _skips_everywhere(ctx):
    pytest.skip(f"nothing to do on rank {ctx.rank}")


def test_skip_on_every_rank_is_a_skip_with_each_reason(world4):
    with pytest.raises(AllRanksSkipped) as info:
        world4.run(_skips_everywhere)
    assert info.value.reasons == {r: f"nothing to do on rank {r}" for r in range(4)}
    assert "rank 3: nothing to do on rank 3" in str(info.value)
    assert world4.run(_all_reduce_ones) == [4.0] * 4


def _skips_on_rank_0(ctx):
    if ctx.rank == 0:
        pytest.skip("only me")
    dist.barrier()


def test_skip_on_one_rank_is_a_failure(world4):
    with pytest.raises(RankFailure) as info:
        world4.run(_skips_on_rank_0)
    assert info.value.primary.rank == 0
    assert info.value.statuses == {0: "skipped", 1: "waiting", 2: "waiting", 3: "waiting"}


def _gathers_into_too_small_outputs(ctx):
    output = [torch.zeros(2) for _ in range(ctx.world_size)]
    dist.all_gather(output, torch.ones(3))


def test_failing_collective_fails_every_participant(world4):
    with pytest.raises(RankFailure) as info:
        world4.run(_gathers_into_too_small_outputs)
    assert set(info.value.statuses.values()) == {"error"}
    assert info.value.primary.rank == 0
    assert "allgather on group 0 failed" in info.value.primary.summary


def _sends(ctx):
    dist.send(torch.ones(1), dst=(ctx.rank + 1) % ctx.world_size)


def test_unsupported_op_says_so(world4):
    with pytest.raises(RankFailure) as info:
        world4.run(_sends)
    assert isinstance(info.value.primary.exception, RunnerUnsupported)
    assert "send is unsupported on the thread runner" in info.value.primary.summary
    assert "send" in world4.lacks


def test_thousand_calls_reuse_one_generation(world4):
    world4.run(_rank)
    generations, calls = world4.generations, world4.calls
    for _ in range(1000):
        assert world4.run(_all_reduce_ones) == [4.0] * 4
    assert world4.generations == generations
    assert world4.calls == calls + 1000


def test_meshes_are_cached_per_rank(world4):
    first = world4.run(lambda ctx: id(ctx.mesh((2, 2))))
    second = world4.run(lambda ctx: id(ctx.mesh((2, 2))))
    assert first == second


def test_mesh_shape_is_validated(world4):
    with pytest.raises(RankFailure) as info:
        world4.run(lambda ctx: ctx.mesh((3,)))
    assert "shape=(3,) must be a non-empty mesh shape whose product is the world size 4" in str(
        info.value
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"runner": "mpi"}, "runner='mpi' must be one of"),
        ({"world_size": 0}, "world_size=0 must be a positive int"),
        ({"world_size": 2.0}, "world_size=2.0 must be a positive int"),
        ({"device": "tpu"}, "device='tpu' must be cpu or an accelerator type torch knows"),
        ({"timeout": -1}, "timeout=-1 must be a positive, finite number"),
    ],
)
def test_bad_world_arguments_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message), open_world(**kwargs):
        pass


def test_bad_timeout_per_call(world4):
    with pytest.raises(ValueError, match="timeout=0 must be a positive, finite number"):
        world4.run(_rank, timeout=0)


def test_world_cache_keeps_one_world_per_key():
    cache = WorldCache(timeout=5.0)
    try:
        assert cache.get("threads", 2, "cpu") is cache.get("threads", 2, "cpu")
        assert cache.get("threads", 3, "cpu") is not cache.get("threads", 2, "cpu")
    finally:
        cache.close()


def test_worlds_serve_the_sessions_sizes_from_the_cache_and_check_them():
    cache = WorldCache(timeout=5.0)
    try:
        worlds = Worlds(cache, "threads", "cpu", (1, 3))
        assert worlds.get(3) is cache.get("threads", 3, "cpu")
        assert worlds.get(3).run(_rank) == [0, 1, 2]
        cache.get("threads", 2, "cpu")  # built by another test: listed and checked too
        assert [w.world_size for w in cache.existing("threads", "cpu")] == [2, 3]
        worlds.check_health()
        with pytest.raises(ValueError, match=r"world_size=2 must be one of .* \(1, 3\)"):
            worlds.get(2)
        with pytest.raises(ValueError, match=r"sizes=\(\) must be a non-empty tuple"):
            Worlds(cache, "threads", "cpu", ())
    finally:
        cache.close()


def test_new_generations_never_reuse_another_ranks_redistribute_plan():
    """Thread idents are recycled; DTensor caches rank-dependent plans by ident."""
    from harness.cases.placements import RedistributeCase
    from specs.placements import Replicate, Shard
    from suites.checks.dtensor import redistribute_on_rank

    case = RedistributeCase(
        mesh_shape=(1, 2, 2),
        src=(Shard(-1), Shard(0), Replicate()),
        dst=(Shard(0), Shard(0), Shard(0)),
        shape=(17,),
        dtype="float64",
        seed=0,
    )
    for _ in range(4):  # before the fix, every World after the first failed here
        with open_world("threads", world_size=4) as world:
            views = world.run(redistribute_on_rank, case)
            assert [v.local.shape for v in views] == [(5,), (4,), (4,), (4,)]


def test_seeded_models_are_identical_on_every_rank_and_in_the_driver(world4):
    """Rank threads share torch's global RNG; seeded_init_ must not depend on it."""
    from harness.cases.training import MLPCase
    from harness.torchkit.dtensor import to_numpy
    from harness.torchkit.models import build_mlp

    case = MLPCase(
        dims=(5, 7, 3),
        bias=True,
        shard_layers=False,
        batch_per_rank=1,
        lr=0.1,
        momentum=0.0,
        dtype="float32",
        seed=11,
    )

    def weights(ctx):
        torch.manual_seed(ctx.rank)  # a rank reseeding the global RNG changes nothing
        return [to_numpy(p) for p in build_mlp(case, ctx.device).parameters()]

    expected = [to_numpy(p) for p in build_mlp(case, torch.device("cpu")).parameters()]
    for _ in range(3):
        for per_rank in world4.run(weights):
            assert all((a == b).all() for a, b in zip(per_rank, expected, strict=True))


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), True, "1"])
def test_non_finite_or_non_number_timeouts_are_rejected(world4, bad):
    with pytest.raises(ValueError, match="must be a positive, finite number of seconds"):
        world4.run(_rank, timeout=bad)


def test_after_a_hang_later_calls_get_a_short_deadline_until_the_health_check():
    from harness.runners.base import AFTER_HANG_TIMEOUT

    with open_world("threads", world_size=2, timeout=30.0) as world:
        with pytest.raises(RankFailure):
            world.run(_hangs_on_rank_1, timeout=0.5)
        with pytest.raises(RankFailure) as info:
            world.run(_hangs_on_rank_1)  # would wait 30 s; hypothesis re-runs hangs while shrinking
        assert info.value.deadline == AFTER_HANG_TIMEOUT
        assert "shortened: this World already hung in this test" in str(info.value)
        assert world.check_health()
        assert world.run(_all_reduce_ones, timeout=20) == [2.0, 2.0]


def test_among_crashed_ranks_the_primary_is_one_that_says_how():
    from harness.runners.base import RankOutcome, primary_rank

    outcomes = [
        RankOutcome(0, "waiting", summary="released"),
        RankOutcome(2, "crashed", summary="its connection closed"),
        RankOutcome(3, "crashed", summary="killed by signal SIGKILL", traceback="stack"),
    ]
    assert primary_rank(outcomes) == 3
    assert primary_rank([*outcomes[:2], RankOutcome(1, "crashed", summary="closed")]) == 1


def test_a_collective_settles_each_rank_input_then_the_outputs(world4, monkeypatch):
    # Rank threads share a device but not its streams: each rank's inputs are settled
    # before the exchange and the outputs once after it (a device-wide sync on CUDA).
    from harness.runners import _threaded_pg

    settled = []
    real = _threaded_pg.settle
    monkeypatch.setattr(
        _threaded_pg,
        "settle",
        lambda data: (settled.append(len(_threaded_pg._flat(data))), real(data)),
    )
    assert world4.run(_all_reduce_ones) == [4.0] * 4
    assert sorted(settled) == [1, 1, 1, 1, 4]


def test_settle_synchronizes_each_accelerator_the_data_lives_on(monkeypatch):
    from types import SimpleNamespace

    from harness.runners import _threaded_pg

    synced = []
    module = SimpleNamespace(synchronize=synced.append)
    monkeypatch.setattr(torch, "get_device_module", lambda device: module)
    on = [SimpleNamespace(device=torch.device("cuda", i)) for i in (0, 0, 1)]
    monkeypatch.setattr(_threaded_pg, "_flat", lambda data: data)
    _threaded_pg.settle([*on, torch.ones(1), torch.ones(1, device="meta")])
    assert sorted(synced, key=str) == [torch.device("cuda", 0), torch.device("cuda", 1)]
    synced.clear()
    _threaded_pg.settle([torch.ones(1)])
    assert synced == []


def test_a_thread_local_world_without_comms_gets_one_list_per_thread() -> None:
    """torch 2.11's c10d reads ``_world.comms`` on destroy; its thread-local world lacked it."""
    from harness.runners import _threaded_pg

    class World:
        _world = threading.local()

    _threaded_pg._give_world_comms(World)
    world = World()
    world.comms.append("main")  # type: ignore[attr-defined]
    seen: list[list[str]] = []
    other = threading.Thread(target=lambda: seen.append(list(world.comms)))  # type: ignore[attr-defined]
    other.start()
    other.join()
    assert (world.comms, seen) == (["main"], [[]])  # type: ignore[attr-defined]
