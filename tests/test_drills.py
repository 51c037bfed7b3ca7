"""Failure drills run against both runners: after each, the same World (or its rebuilt
successor) serves the next call."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

from harness import InvalidArgument, RankFailure, open_world
from harness.runners import WorldStartError

RUNNERS = ["threads", "processes"]
WORLD_SIZE = 3


@pytest.fixture(scope="module", params=RUNNERS)
def world(request):
    with open_world(request.param, world_size=WORLD_SIZE, timeout=30.0) as world:
        world.start()
        yield world


def _sum_of_ranks(ctx):
    tensor = torch.tensor([float(ctx.rank)])
    dist.all_reduce(tensor)
    return tensor.item()


def _assert_serves_next_call(world):
    assert world.run(_sum_of_ranks) == [3.0] * WORLD_SIZE


def _raises_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()


def test_exception_on_one_rank_names_it_and_releases_the_rest(world):
    with pytest.raises(RankFailure) as info:
        world.run(_raises_on_rank_1)
    failure = info.value
    assert failure.primary.rank == 1
    assert failure.statuses == {0: "waiting", 1: "error", 2: "waiting"}
    assert "ValueError: rank 1 refuses" in failure.primary.summary
    assert "_raises_on_rank_1" in failure.primary.traceback
    _assert_serves_next_call(world)


def _hangs_on_rank_0(ctx):
    # every rank is past its start when the peers head for the barrier: on a loaded
    # machine a late-starting rank would otherwise still be running at the deadline
    dist.all_reduce(torch.zeros(1))
    if ctx.rank == 0:
        while True:
            time.sleep(0.05)
    dist.barrier()


def test_hang_gives_every_stack_at_the_deadline(world):
    with pytest.raises(RankFailure) as info:
        world.run(_hangs_on_rank_0, timeout=4.0)
    failure = info.value
    assert failure.timed_out
    assert failure.statuses == {0: "timeout", 1: "waiting", 2: "waiting"}
    assert "_hangs_on_rank_0" in failure.outcomes[0].traceback
    assert all("barrier" in o.traceback for o in failure.outcomes[1:])
    _assert_serves_next_call(world)


def _mismatched(ctx):
    tensor = torch.ones(2)
    if ctx.rank == 0:
        dist.all_reduce(tensor)
    else:
        dist.broadcast(tensor, src=0)


def test_mismatched_collectives_fail_naming_both_sides():
    with open_world("threads", world_size=WORLD_SIZE) as world:
        with pytest.raises(RankFailure) as info:
            world.run(_mismatched)
        summary = info.value.primary.summary
        assert "mismatched collectives on group 0" in summary
        assert "ranks [0] called allreduce(float32[2], SUM)" in summary
        assert "ranks [1, 2] called broadcast(float32[2], root=0)" in summary
        _assert_serves_next_call(world)


def test_mismatched_collectives_on_processes_in_strict_mode():
    with open_world("processes", world_size=2, strict_collectives=True, timeout=30.0) as world:
        with pytest.raises(RankFailure) as info:
            world.run(_mismatched)
        assert "Detected mismatch between collectives on ranks" in info.value.primary.summary
        assert world.run(_sum_of_ranks) == [1.0, 1.0]


def test_mismatched_collectives_on_processes_without_strict_mode_hit_the_deadline():
    with open_world("processes", world_size=2, timeout=2.0) as world:
        with pytest.raises(RankFailure) as info:
            world.run(_mismatched)
        assert info.value.timed_out
        assert world.run(_sum_of_ranks) == [1.0, 1.0]


def _dies_on_rank_2(ctx, how):
    dist.barrier()
    if ctx.rank == 2:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "exit":
            os._exit(3)
        elif how == "segfault":
            ctypes.string_at(0)
    dist.barrier()


@pytest.mark.parametrize(
    ("how", "summary"),
    [
        ("sigkill", "killed by signal SIGKILL"),
        ("exit", "exited with code 3"),
        ("segfault", "killed by signal SIGSEGV"),
    ],
)
def test_dead_rank_process_is_crashed_and_the_pool_respawns(world, how, summary):
    if world.runner == "threads":
        pytest.skip("a rank thread cannot die alone: its process is the whole World")
    respawns = world.respawns
    with pytest.raises(RankFailure) as info:
        world.run(_dies_on_rank_2, how)
    failure = info.value
    assert failure.primary.rank == 2
    assert failure.primary.status == "crashed"
    assert summary in failure.primary.summary
    if how == "segfault":
        assert "Fatal Python error: Segmentation fault" in failure.primary.traceback
    assert world.respawns == respawns + 1
    _assert_serves_next_call(world)


def _leaves_after_last_collective(ctx):
    dist.barrier()
    if ctx.rank == 1:
        if ctx.runner == "processes":
            os._exit(0)
        sys.exit(0)
    return ctx.rank


def test_rank_leaving_after_its_last_collective_is_never_a_pass(world):
    with pytest.raises(RankFailure) as info:
        world.run(_leaves_after_last_collective)
    assert info.value.primary.rank == 1
    assert info.value.primary.status in ("crashed", "error")
    assert info.value.statuses[0] == "ok"
    _assert_serves_next_call(world)


def _skips_on_rank_2(ctx):
    if ctx.rank == 2:
        pytest.skip("rank 2 has nothing to do")
    dist.barrier()


def test_skip_on_one_rank_is_a_failure(world):
    with pytest.raises(RankFailure) as info:
        world.run(_skips_on_rank_2)
    assert info.value.primary.rank == 2
    assert info.value.statuses[2] == "skipped"
    _assert_serves_next_call(world)


def _skips(ctx):
    pytest.skip(f"not on rank {ctx.rank}")


def test_skip_on_every_rank_is_a_skip(world):
    with pytest.raises(pytest.skip.Exception, match="rank 2: not on rank 2"):
        world.run(_skips)
    _assert_serves_next_call(world)


def test_health_check_respawns_a_broken_pool(world):
    if world.runner == "threads":
        assert world.check_health()
        return
    pids = world.run(lambda_free_pid)
    os.kill(pids[1], signal.SIGKILL)
    time.sleep(0.2)
    assert not world.check_health()
    assert world.run(lambda_free_pid) != pids
    _assert_serves_next_call(world)


def lambda_free_pid(ctx):
    return os.getpid()


def test_unpicklable_call_is_named_in_the_driver():
    with open_world("processes", world_size=2) as world:
        with pytest.raises(
            InvalidArgument, match=r"fn=<function .*<lambda>.* must be picklable to reach rank"
        ):
            world.run(lambda ctx: 1)
        with pytest.raises(InvalidArgument, match=r"args\[0\]=<generator .* must be picklable"):
            world.run(_sum_of_ranks, (i for i in range(3)))
        assert world.calls == 0  # nothing was started for calls that could not be sent


def _returns_a_lock(ctx):
    import threading

    return threading.Lock()


def test_unpicklable_return_value_is_an_error_naming_its_type():
    with open_world("processes", world_size=2) as world:
        with pytest.raises(RankFailure, match="the return value \\(a lock\\) cannot be sent"):
            world.run(_returns_a_lock)
        assert world.run(_sum_of_ranks) == [1.0, 1.0]


def test_start_failures_are_retried_then_reported_as_infrastructure_errors(monkeypatch):
    from harness.runners import processes

    attempts = []

    def failing_start(self):
        attempts.append(1)
        self.kill()
        raise WorldStartError("rendezvous failed (simulated)")

    monkeypatch.setattr(processes._Pool, "start", failing_start)
    world = processes.ProcessWorld(2)
    with pytest.raises(WorldStartError, match="3 attempts to start 2 rank processes failed"):
        world.start()
    assert len(attempts) == 3


def test_assertion_failures_are_never_retried(world):
    calls = world.calls
    with pytest.raises(RankFailure):
        world.run(_raises_on_rank_1)
    assert world.calls == calls + 1


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); its state says whether it runs.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def _wait_gone(pids, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _pid_alive(p)]


DRIVER = """
import os, sys, time
from harness import open_world
def pid(ctx):
    return os.getpid()
if __name__ == "__main__":
    world = open_world("processes", world_size=2).__enter__()
    print(" ".join(map(str, world.run(pid))), flush=True)
    if sys.argv[1] == "hang":
        time.sleep(3600)
"""


@pytest.mark.parametrize("ending", ["exit", "hang"])
def test_no_rank_process_outlives_its_driver(ending):
    """Ranks exit when the driver exits normally without closing its World, and when it is
    killed outright; the World's directory goes either way."""
    import shutil
    import subprocess
    import tempfile

    # short: the fork server's socket in it must fit an AF_UNIX path
    tmp = tempfile.mkdtemp(prefix="dc-")
    try:
        script = os.path.join(tmp, "driver.py")
        with open(script, "w") as handle:
            handle.write(DRIVER)
        os.mkdir(os.path.join(tmp, "tmp"))
        driver = subprocess.Popen(
            [sys.executable, script, ending],
            stdout=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(sys.path),
                "TMPDIR": os.path.join(tmp, "tmp"),
            },
        )
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2
        if ending == "hang":
            driver.kill()
        driver.wait(60)
        assert _wait_gone(pids, 10) == []
        left = os.listdir(os.path.join(tmp, "tmp"))
        assert [name for name in left if name.startswith("distconf-")] == []
        if ending == "exit":  # multiprocessing's own directory goes at a normal exit only
            assert [name for name in left if name.startswith("pymp-")] == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _released_rank_raises_while_unwinding(ctx):
    try:
        if ctx.rank == 2:
            raise KeyError("the real error")
        dist.barrier()
    finally:
        if ctx.rank == 0:
            raise RuntimeError("cleanup found inconsistent state")


def test_a_released_rank_failing_while_unwinding_is_not_the_primary(world):
    with pytest.raises(RankFailure) as info:
        world.run(_released_rank_raises_while_unwinding)
    failure = info.value
    assert failure.primary.rank == 2
    assert "the real error" in failure.primary.summary
    assert failure.statuses[0] == "waiting"
    assert "cleanup found inconsistent state while unwinding" in failure.outcomes[0].summary
    _assert_serves_next_call(world)


def _fails_on_rank_1_while_peers_wait_in_a_mesh_collective(ctx):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = ctx.mesh((WORLD_SIZE,))
    local = distribute_tensor(torch.ones(WORLD_SIZE, 2), mesh, [Shard(0)])
    if ctx.rank == 1:
        raise ValueError("rank 1 refuses")
    return local.redistribute(mesh, [Replicate()]).to_local().sum().item()


def test_peers_stranded_in_a_mesh_collective_are_waiting_and_the_world_recovers(world):
    with pytest.raises(RankFailure) as info:
        world.run(_fails_on_rank_1_while_peers_wait_in_a_mesh_collective)
    failure = info.value
    assert failure.primary.rank == 1
    assert "ValueError: rank 1 refuses" in failure.primary.summary
    assert failure.statuses == {0: "waiting", 1: "error", 2: "waiting"}
    assert failure.deadline is None, "a failed peer is not a deadline expiry"
    _assert_serves_next_call(world)
