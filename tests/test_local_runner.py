"""The local runner: one thread simulates every rank (torch's LocalTensorMode).

Its per-rank results, failures, deadlines and refusals, the rank-dependent helpers of
``harness.torchkit.local`` on it and on threads, and the placements and uneven suites at world
sizes 2-4 against the thread runner with the same seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from harness import AllRanksSkipped, DistconfError, InvalidArgument, RankFailure, open_world
from harness.cases.meshes import MeshCase
from harness.cases.placements import DistributeCase
from harness.config import RunConfig
from harness.errors import RunnerUnsupported
from harness.runners import WorldCache, make_world
from harness.runners.capacity import LOCAL_WORLD_LIMIT, check_capacity
from harness.torchkit import local
from harness.torchkit.dtensor import distribute, view_of
from specs.placements import Replicate, Shard, local_arrays

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def world8():
    with open_world("local", world_size=8) as world:
        yield world


def _summed_ranks(ctx):
    """Every rank's rank, all-reduced, and each rank's own rank and local tensor."""
    mine = local.rank_tensor(ctx, lambda rank: torch.tensor([float(rank)]))
    total = mine.clone()
    dist.all_reduce(total)
    return local.rank_of(ctx), local.per_shard(total, lambda t: t.item()), mine


@pytest.mark.parametrize("runner", ["threads", "local"])
def test_one_value_per_rank_from_the_same_check_on_either_runner(runner):
    with open_world(runner, world_size=4) as world:
        results = world.run(_summed_ranks)
    assert [(rank, total) for rank, total, _ in results] == [(r, 6.0) for r in range(4)]
    assert [type(t) for _, _, t in results] == [torch.Tensor] * 4  # plain tensors, split
    assert [t.tolist() for _, _, t in results] == [[float(r)] for r in range(4)]


def _view_of_distributed(ctx, case):
    return view_of(distribute(ctx, case), ctx)


@pytest.mark.parametrize("mesh_shape", [(4, 4, 4), (3, 5, 7)])
def test_a_dtensor_view_is_split_per_rank_on_a_3d_mesh(mesh_shape):
    case = DistributeCase(mesh_shape, (Shard(0), Replicate(), Shard(1)), (6, 9), "float32", 3)
    expected = local_arrays(case.global_array(), case.mesh_shape, case.placements)
    world_size = int(np.prod(mesh_shape))
    with open_world("local", world_size=world_size) as world:
        views = world.run(_view_of_distributed, case)
    for rank, view in enumerate(views):
        assert (view.rank, view.coord) == (rank, case.coord_of(rank))
        assert view.mesh_ranks == tuple(range(world_size))
        np.testing.assert_array_equal(view.local, expected[view.coord])
        np.testing.assert_array_equal(view.full, case.global_array())


def _checks(ctx, distributed, redistributed, mesh):
    from suites.checks.dtensor import mesh_on_rank, redistribute_on_rank

    return (
        _view_of_distributed(ctx, distributed),
        redistribute_on_rank(ctx, redistributed),
        mesh_on_rank(ctx, mesh),
    )


def test_the_suites_checks_give_the_thread_runners_values():
    from harness.cases.placements import RedistributeCase
    from specs.placements import Partial

    distributed = DistributeCase((2, 4), (Shard(1), Shard(0)), (3, 7), "float64", 5)
    sliced = MeshCase((2, 2, 2), "sliced", (0, 2))
    redistributed = RedistributeCase(
        (2, 2), (Partial("sum"), Shard(1)), (Shard(0), Replicate()), (5, 3), "float32", 2, sliced
    )
    arguments = (distributed, redistributed, MeshCase((2, 2, 2), "flattened", (1, 2)))
    results = {}
    for runner in ("threads", "local"):
        with open_world(runner, world_size=8) as world:
            results[runner] = world.run(_checks, *arguments)
    for by_thread, simulated in zip(results["threads"], results["local"], strict=True):
        for one, other in zip(by_thread, simulated, strict=True):
            assert repr(one) == repr(other)


def _sliced_mesh_view(ctx, case):
    mesh = ctx.mesh_of(case)
    return local.mesh_ranks(mesh), [local.group_ranks(mesh.get_group(a)) for a in range(mesh.ndim)]


def test_sliced_meshes_and_groups_are_each_ranks_own(world8):
    case = MeshCase((2, 2, 2), "sliced", (0, 2))
    for rank, (ranks, groups) in enumerate(world8.run(_sliced_mesh_view, case)):
        assert list(ranks) == case.ranks_of(rank)
        grid = np.array(case.ranks_of(rank)).reshape(2, 2)
        row, col = case.coord_of(rank)
        assert groups == [grid[:, col].tolist(), grid[row, :].tolist()]


def _reads_rank(ctx):
    return ctx.rank


def test_reading_ctx_rank_in_a_simulated_check_is_a_distconf_error(world8):
    with pytest.raises(RankFailure) as info:
        world8.run(_reads_rank)
    assert isinstance(info.value.primary.exception, local.RankIsSimulated)
    assert isinstance(info.value.primary.exception, DistconfError)
    assert "there is no one rank" in str(info.value)
    assert "harness.torchkit.local" in str(info.value)


def _raises(ctx):
    raise ValueError("the body says no")


def test_an_exception_in_the_body_is_a_rank_failure_and_the_world_goes_on(world8):
    generations = world8.generations
    with pytest.raises(RankFailure) as info:
        world8.run(_raises)
    failure = info.value
    assert failure.primary.rank == 0 and failure.statuses[0] == "error"
    assert set(failure.statuses.values()) == {"error", "waiting"}
    assert "ValueError: the body says no" in str(failure)
    assert "[local, cpu, world size 8]" in str(failure)
    assert isinstance(failure.__cause__, ValueError)
    assert [r for r, *_ in world8.run(_summed_ranks)] == list(range(8))
    assert world8.generations == max(generations, 1)  # a clean failure keeps the simulation


def _fails_for_rank_5(ctx):
    return local.each(ctx, lambda rank: 1 // (rank - 5))


def test_a_failure_inside_one_ranks_callback_names_that_rank(world8):
    with pytest.raises(RankFailure) as info:
        world8.run(_fails_for_rank_5)
    assert info.value.primary.rank == 5
    assert "(on simulated rank 5)" in info.value.primary.traceback


def _spins(ctx):
    while True:
        pass


def test_a_deadline_reports_the_stack_and_the_world_is_rebuilt():
    with open_world("local", world_size=4, timeout=30) as world:
        world.run(_summed_ranks)
        with pytest.raises(RankFailure) as info:
            world.run(_spins, timeout=1.0)
        failure = info.value
        assert failure.timed_out and failure.primary.status == "timeout"
        assert "_spins" in failure.primary.traceback
        assert "deadline of 1 s expired [local, cpu, world size 4]" in str(failure)
        assert world.check_health()
        assert [r for r, *_ in world.run(_summed_ranks)] == list(range(4))
        assert world.generations == 2


def _grows(ctx):
    held = torch.ones(64, 2**20)  # 256 MiB
    while True:
        held.add_(0)


def test_a_call_past_the_memory_budget_fails_naming_it(monkeypatch):
    from harness.runners import local as runner

    start = runner._resident_bytes()
    assert start is not None
    monkeypatch.setattr(runner, "_memory_budget", lambda: start + 2**27)
    with open_world("local", world_size=2, timeout=60) as world:
        with pytest.raises(RankFailure, match="past the local runner's budget of") as info:
            world.run(_grows)
        assert not info.value.timed_out and "_grows" in info.value.primary.traceback
        monkeypatch.undo()
        assert [r for r, *_ in world.run(_summed_ranks)] == [0, 1]


def _skips(ctx):
    pytest.skip("not on this world")


def test_a_skip_is_a_skip_of_every_rank(world8):
    with pytest.raises(AllRanksSkipped, match="all 8 ranks skipped: not on this world"):
        world8.run(_skips)


def test_a_simulated_check_cannot_use_its_own_world(world8):
    def uses_world(ctx):
        with pytest.raises(DistconfError, match="called from a simulated check"):
            world8.run(_reads_rank)
        return True

    assert world8.run(uses_world) == [True] * 8


def _from_group(ctx, case):
    return ctx.mesh_of(case)


def test_what_the_simulation_cannot_build_is_refused_and_named_in_lacks(world8):
    with pytest.raises(RankFailure) as info:
        world8.run(_from_group, MeshCase((2, 4), "from_group", (0,)))
    assert isinstance(info.value.primary.exception, RunnerUnsupported)
    assert "cannot simulate DeviceMesh.from_group" in str(info.value)
    scattered = DistributeCase((8,), (Shard(0),), (5,), "float32", 0, src_data_rank=1)
    with pytest.raises(RankFailure, match=r"src_data_rank=\.\.\.\) from group rank 1: a Shard"):
        world8.run(_view_of_distributed, scattered)
    strided = DistributeCase((2, 4), (Replicate(), Replicate()), (3,), "float32", 0, 1)
    with pytest.raises(RankFailure, match=r"mesh axis 0 \(ranks \[0, 4\], not consecutive\)"):
        world8.run(_view_of_distributed, strided)
    assert {"mesh.from_group", "scatter.group_src", "send"} <= world8.lacks


def test_a_broadcast_from_another_rank_over_consecutive_ranks_is_served(world8):
    case = DistributeCase((8,), (Replicate(),), (3,), "float32", 0, src_data_rank=5)
    for view in world8.run(_view_of_distributed, case):
        np.testing.assert_array_equal(view.local, case.input_of(5))


def test_worlds_of_several_sizes_take_turns_with_the_default_group():
    cache = WorldCache()
    try:
        for size in (2, 3, 2, 5, 3):
            world = cache.get("local", size, "cpu")
            assert [r for r, *_ in world.run(_summed_ranks)] == list(range(size))
            assert world.run(_sliced_mesh_view, MeshCase((size,)))[0][0] == tuple(range(size))
    finally:
        cache.close()
    assert not dist.is_initialized()


def _fails_only_simulated(ctx):
    if local.simulated_ranks() is not None:
        raise RuntimeError("the simulation cannot take this")
    return local.rank_of(ctx)


def _fails_everywhere(ctx):
    raise RuntimeError("the code under test is wrong")


def test_a_failure_rank_threads_do_not_share_is_told_as_the_simulations(world8):
    with pytest.raises(RankFailure) as info:
        world8.run(_fails_only_simulated)
    assert "the simulation cannot take this" in str(info.value)
    assert "simulation only: the same call passes on 8 rank threads" in str(info.value)
    with pytest.raises(RankFailure) as info:
        world8.run(_fails_everywhere)
    assert "the code under test is wrong" in str(info.value)
    assert "simulation only" not in str(info.value)
    assert [r for r, *_ in world8.run(_summed_ranks)] == list(range(8))  # and it goes on


def test_a_local_world_leaves_the_process_hooks_as_it_found_them():
    # (init_process_group wraps sys.excepthook with a rank prefix each time it is called)
    before = sys.excepthook, threading.excepthook
    cache = WorldCache()
    try:
        for size in (2, 3, 2):
            cache.get("local", size, "cpu").run(_summed_ranks)
    finally:
        cache.close()
    assert (sys.excepthook, threading.excepthook) == before


@dataclass(frozen=True)
class _Pair:
    left: object
    right: object


def test_split_resolves_per_rank_values_at_any_depth():
    per_rank = local.PerRank({0: "a", 1: "b"})
    value = {"k": [(_Pair(per_rank, 3), per_rank)], "n": None}
    assert local.split(value, 1) == {"k": [(_Pair("b", 3), "b")], "n": None}
    plain = {"k": [1, (2, "x")]}
    assert local.split(plain, 0) is plain


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 257}, f"world_size=257 must be at most {LOCAL_WORLD_LIMIT} on the local"),
        ({"device": "cuda"}, "device='cuda' must be 'cpu' on the local runner"),
        ({"backend": "gloo"}, "backend='gloo' must be unset on the local runner"),
    ],
)
def test_what_the_local_runner_cannot_do_is_refused_before_it_starts(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        make_world("local", **{"world_size": 2, **kwargs})


def test_a_local_run_refuses_faults_and_large_worlds_before_anything_starts():
    with pytest.raises(InvalidArgument, match=r"faults=.* must be empty with --runner local"):
        RunConfig(runner="local", faults=("dtensor.partial_reduced_twice",))
    too_large = RunConfig(runner="local", world_sizes=(8, 1024))
    with pytest.raises(
        InvalidArgument, match=f"world_sizes=1024 must be at most {LOCAL_WORLD_LIMIT} on the local"
    ):
        too_large.check_machine()
    assert check_capacity("local", "cpu", (256,)) == "fake"


# --- the suites against the thread runner --------------------------------------------------

SIZES = "2,3,4"


def _run(runner: str, out: Path, *extra: str, codes=(0,)) -> dict[str, dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-m", "harness", "run", "--runner", runner, "--profile", "dev",
         "--seed", "1", "--jobs", "1", "--out", str(out), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode in codes, f"{runner}: {done.stdout[-4000:]}{done.stderr[-2000:]}"
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {r["nodeid"].replace(f"[{runner}-", "["): r for r in records if r["kind"] == "test"}


def test_a_suite_the_local_runner_cannot_serve_skips_naming_it(tmp_path):
    records = _run("local", tmp_path, "--suite", "zero", "--world-sizes", "2", codes=(0, 5))
    assert records
    for record in records.values():
        assert record["status"] == "skipped"
        assert "the local runner serves the ops, placements, uneven suites only" in str(
            record["skip_reason"]
        )


def _local_reason(record: dict[str, object]) -> str | None:
    """Why the local runner's outcome may differ from the thread runner's: a skip naming it,
    or a limitation of its simulation (an expectation of specs/expectations/local.toml)."""
    expectation = record.get("expectation") or {}
    assert isinstance(expectation, dict)
    if str(expectation.get("source", "")).startswith("local.toml"):
        return f"{expectation['source']} (a limitation of LocalTensorMode)"
    reason = str(record.get("skip_reason") or "")
    return reason if record["status"] == "skipped" and "local runner" in reason else None


def test_the_dtensor_suites_give_the_thread_runners_outcomes_on_the_local_runner(tmp_path):
    """Same seed, same outcome per test; where they differ, the local runner said why (a skip
    naming it, or a limitation of LocalTensorMode in local.toml), and any other difference
    is named."""
    suites = ("--suite", "placements", "--suite", "uneven", "--world-sizes", SIZES)
    threads = _run("threads", tmp_path / "threads", *suites)
    simulated = _run("local", tmp_path / "local", *suites)
    assert sorted(threads) == sorted(simulated)
    same, explained, differences = [], [], []
    for test, record in sorted(threads.items()):
        other = simulated[test]
        mine, theirs, why = record["status"], other["status"], _local_reason(other)
        if theirs == "xpassed" and why is not None:
            theirs = "passed"  # a flaky limitation the examples did not meet
        if mine == theirs:
            same.append(test)
        elif why is not None:
            explained.append(f"{test}: threads {mine}, local {theirs}: {why}")
        else:
            differences.append(f"{test}: threads {mine}, local {theirs}: {other.get('error')}")
    assert not differences, "outcomes differ:\n" + "\n".join(differences)
    checked = [test for test in same if threads[test]["status"] in ("passed", "xfailed")]
    assert len(checked) >= len(threads) // 2, "\n".join(explained)
