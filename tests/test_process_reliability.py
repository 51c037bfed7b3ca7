"""The process runner tells the truth and cleans up: it explains a driver script without the
main guard, fails a start at once with a dead rank's own story, replaces only the rank
processes a failed call broke, leaves nothing behind on Ctrl-C, and keeps gloo on loopback."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from sigint import default_sigint

from harness import InvalidArgument, RankFailure, WorldStartError, open_world
from harness.runners.processes import ProcessWorld

FIXTURES = Path(__file__).parent / "fixtures" / "process_reliability"
WORLD_SIZE = 3
GONE_WITHIN = 10.0
"""Seconds to poll for processes to disappear: a bound on a wait, not a measured figure."""


def _driver_env(tmp_path: Path) -> dict[str, str]:
    """A driver subprocess's environment: this checkout importable, temp files in tmp_path."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    pythonpath = os.pathsep.join([str(Path(__file__).parent.parent), *sys.path])
    return {**os.environ, "PYTHONPATH": pythonpath, "TMPDIR": str(tmp)}


def _world_dirs(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("distconf-world-*"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie still answers kill(0)
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _still_alive_after_polling(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + GONE_WITHIN
    while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _pid_alive(p)]


# --- a driver script without the main guard ------------------------------------------------


def test_a_driver_without_the_main_guard_is_told_why_with_the_ranks_own_error(short_tmp):
    env = _driver_env(short_tmp)
    driver = subprocess.run(
        [sys.executable, str(FIXTURES / "unguarded_driver.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert driver.returncode != 0
    # the driver's own error: the last line that starts with it (the ranks' lines are quoted)
    *_, last = re.finditer(r"^harness\.errors\.WorldStartError: ", driver.stderr, re.MULTILINE)
    error = driver.stderr[last.start() :]
    assert "did not answer" not in error
    # whichever rank the fork server reached first
    assert re.search(
        r"rank \d: exited with code 1 while multiprocessing re-imported the driver", error
    )
    assert 'open and use Worlds only under `if __name__ == "__main__":`' in error
    # the rank's own traceback, quoted from its stderr: it ran the driver's top level again
    assert re.search(r'\| +File ".*unguarded_driver\.py", line \d+, in <module>', error)
    assert "| harness.errors.WorldStartError: a processes World was started while" in error
    assert error.count("failed to start") == 1, "a rank that cannot import the driver is final"
    assert _world_dirs(Path(env["TMPDIR"])) == []


# --- a rank that dies while the pool starts ------------------------------------------------

DIES_WHILE_STARTING = """
import multiprocessing, os, signal, sys

if multiprocessing.current_process().name.split(":")[0] == "distconf-rank1":
    print("rank 1 gives up while starting", file=sys.stderr, flush=True)
    {how}
FAULTS = ()
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("how", "story"),
    [
        ("os._exit(7)", "rank 1: exited with code 7"),
        ("os.kill(os.getpid(), signal.SIGKILL)", "rank 1: killed by signal SIGKILL"),
    ],
)
def test_a_rank_that_dies_while_starting_fails_the_start_at_once_with_its_story(
    tmp_path, monkeypatch, how, story
):
    # A fault file is imported in every rank process before it joins the process group: this
    # one ends rank 1 there, while rank 0 waits for it at the rendezvous.
    fault_file = tmp_path / "dies_while_starting.py"
    fault_file.write_text(DIES_WHILE_STARTING.format(how=how))
    monkeypatch.setenv("DISTCONF_FAULT_FILES", str(fault_file))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    world = ProcessWorld(2, timeout=30.0)
    with pytest.raises(WorldStartError) as info:
        world.start()
    message = str(info.value)
    assert story in message
    assert "| rank 1 gives up while starting" in message  # its last stderr lines
    assert "rank 0: stopped while it started" in message
    assert "did not answer" not in message
    assert _world_dirs(tmp_path) == []


# --- after a failed call, only what is broken is replaced ----------------------------------


@pytest.fixture(scope="module")
def world():
    with open_world("processes", world_size=WORLD_SIZE, timeout=30.0) as world:
        world.start()
        yield world


def _pid(ctx):
    return os.getpid()


def _sum_of_ranks(ctx):
    tensor = torch.tensor([float(ctx.rank)])
    dist.all_reduce(tensor)
    return tensor.item()


def _raises_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()


def _raises_on_rank_1_between_collectives(ctx):
    tensor = torch.ones(2)
    dist.all_reduce(tensor)
    if ctx.rank == 1:
        raise ValueError("rank 1 refuses")
    dist.all_reduce(tensor)
    return tensor.tolist()


def _every_kind_of_collective(ctx):
    """Collectives of the default group and of a DeviceMesh, with values to check."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total)
    source = torch.tensor([float(ctx.rank)])
    dist.broadcast(source, src=WORLD_SIZE - 1)
    gathered = [torch.zeros(1) for _ in range(WORLD_SIZE)]
    dist.all_gather(gathered, torch.tensor([float(ctx.rank * 10)]))
    mesh = ctx.mesh((WORLD_SIZE,))
    full = torch.arange(WORLD_SIZE * 2, dtype=torch.float32).reshape(WORLD_SIZE, 2)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    replicated = sharded.redistribute(mesh, [Replicate()]).to_local()
    return total.item(), source.item(), [g.item() for g in gathered], replicated.sum().item()


EVERY_KIND = (6.0, 2.0, [0.0, 10.0, 20.0], 15.0)


def _stuck_in_a_collective_on_rank_2(ctx):
    if ctx.rank == 2:
        dist.barrier()  # the others never come
    return ctx.rank


def _dies_on_rank_2(ctx):
    dist.barrier()
    if ctx.rank == 2:
        os._exit(3)
    return ctx.rank


def test_a_failing_call_resets_the_ranks_in_place(world):
    pids, respawns, generations = world.run(_pid), world.respawns, world.generations
    resets = world.resets
    for _ in range(3):
        with pytest.raises(RankFailure) as info:
            world.run(_raises_on_rank_1)
        assert info.value.statuses == {0: "waiting", 1: "error", 2: "waiting"}
        assert world.run(_sum_of_ranks) == [3.0] * WORLD_SIZE
    assert world.run(_pid) == pids
    assert (world.respawns, world.generations) == (respawns, generations)
    assert world.resets == resets + 3


def test_a_group_reset_in_place_serves_every_kind_of_collective(world):
    pids = world.run(_pid)
    with pytest.raises(RankFailure) as info:
        world.run(_raises_on_rank_1_between_collectives)
    assert info.value.primary.rank == 1
    for _ in range(2):
        assert world.run(_every_kind_of_collective) == [EVERY_KIND] * WORLD_SIZE
    assert world.run(_pid) == pids


def test_a_rank_stuck_in_a_collective_past_the_deadline_is_respawned_alone(world):
    pids, respawns = world.run(_pid), world.respawns
    with pytest.raises(RankFailure) as info:
        world.run(_stuck_in_a_collective_on_rank_2, timeout=2.0)
    assert info.value.timed_out
    assert info.value.statuses == {0: "ok", 1: "ok", 2: "waiting"}
    assert world.respawns == respawns + 1
    after = world.run(_pid)
    assert after[:2] == pids[:2]
    assert after[2] != pids[2]
    assert world.run(_every_kind_of_collective) == [EVERY_KIND] * WORLD_SIZE
    assert world.check_health()  # lifts the short deadline that follows a hang


def test_a_crashed_rank_is_respawned_alone(world):
    pids, respawns = world.run(_pid), world.respawns
    with pytest.raises(RankFailure) as info:
        world.run(_dies_on_rank_2)
    assert info.value.statuses[2] == "crashed"
    assert world.respawns == respawns + 1
    after = world.run(_pid)
    assert (after[:2], after[2] != pids[2]) == (pids[:2], True)
    assert world.run(_sum_of_ranks) == [3.0] * WORLD_SIZE


def test_a_health_check_after_a_failing_call_resets_in_place(world):
    pids, respawns, resets = world.run(_pid), world.respawns, world.resets
    with pytest.raises(RankFailure):
        world.run(_raises_on_rank_1)
    assert world.check_health()
    assert (world.respawns, world.resets) == (respawns, resets + 1)
    assert world.run(_pid) == pids


def test_a_health_check_respawns_only_the_rank_that_died(world):
    pids, respawns = world.run(_pid), world.respawns
    os.kill(pids[1], signal.SIGKILL)
    assert not world.check_health()
    assert world.respawns == respawns + 1
    after = world.run(_pid)
    assert (after[0], after[2]) == (pids[0], pids[2])
    assert after[1] != pids[1]
    assert world.run(_sum_of_ranks) == [3.0] * WORLD_SIZE


@pytest.mark.parametrize("respawned_first", [False, True], ids=["mesh", "respawn-then-mesh"])
def test_a_failing_call_after_a_device_mesh_was_built_resets_in_place(world, respawned_first):
    # A DeviceMesh holds its process groups: destroying the group must still release the
    # failing rank's peers, or they are respawned for having stayed blocked.
    if respawned_first:
        with pytest.raises(RankFailure):
            world.run(_stuck_in_a_collective_on_rank_2, timeout=2.0)
        assert world.check_health()
    pids, respawns, resets = world.run(_pid), world.respawns, world.resets
    assert world.run(_every_kind_of_collective) == [EVERY_KIND] * WORLD_SIZE
    with pytest.raises(RankFailure) as info:
        world.run(_raises_on_rank_1)
    assert info.value.statuses == {0: "waiting", 1: "error", 2: "waiting"}
    assert world.check_health()
    assert (world.respawns, world.resets) == (respawns, resets + 1)
    assert world.run(_pid) == pids


def _raises_on_rank_1_while_peers_wait_in_mesh_subgroups(ctx):
    """On a 2 x 2 mesh: rank 0 waits for rank 1 in their row, rank 3 in their column, and
    rank 2 for rank 0 in theirs."""
    mesh = ctx.mesh((2, 2))
    if ctx.rank == 1:
        raise ValueError("rank 1 refuses")
    tensor = torch.ones(1)
    dist.all_reduce(tensor, group=mesh.get_group(1))
    dist.all_reduce(tensor, group=mesh.get_group(0))


def test_peers_blocked_in_a_device_mesh_subgroup_are_released_and_reset_in_place():
    with open_world("processes", world_size=4, timeout=30.0) as world:
        pids = world.run(_pid)
        with pytest.raises(RankFailure) as info:
            world.run(_raises_on_rank_1_while_peers_wait_in_mesh_subgroups)
        assert info.value.statuses == {0: "waiting", 1: "error", 2: "waiting", 3: "waiting"}
        assert world.check_health()
        assert (world.respawns, world.resets) == (0, 1)
        assert world.run(_pid) == pids


# --- strict collectives: the rank that failed is named, not the monitor -------------------


@pytest.fixture(scope="module")
def strict_world():
    with open_world(
        "processes", world_size=WORLD_SIZE, timeout=30.0, strict_collectives=True
    ) as world:
        world.start()
        yield world


def _raises_on_rank_2(ctx):
    if ctx.rank == 2:
        raise ValueError("rank 2 refuses")
    return _sum_of_ranks(ctx)


def _dies_on_rank_1(ctx):
    if ctx.rank == 1:
        os._exit(3)
    return _sum_of_ranks(ctx)


@pytest.mark.parametrize(
    ("fn", "rank", "status", "headline"),
    [
        (_raises_on_rank_2, 2, "error", "rank 2 of 3 failed"),
        (_dies_on_rank_1, 1, "crashed", "rank 1 of 3 crashed"),
    ],
    ids=["exception-on-rank-2", "crash-on-rank-1"],
)
def test_strict_collectives_name_the_rank_that_failed(strict_world, fn, rank, status, headline):
    # Rank 0 runs gloo's monitored barrier before each collective: it reports the others'
    # failure ("Ranks 2 failed to pass monitoredBarrier"), and was only released by it.
    with pytest.raises(RankFailure) as info:
        strict_world.run(fn)
    assert info.value.statuses == {r: status if r == rank else "waiting" for r in range(3)}
    assert info.value.primary.rank == rank
    assert str(info.value).startswith(headline)
    assert strict_world.run(_sum_of_ranks) == [3.0] * WORLD_SIZE


@pytest.mark.parametrize(
    ("message", "released"),
    [
        ("[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 7200000 ms", True),
        ("[Rank 0]: Rank 2 failed to pass monitoredBarrier in 50 ms\n Original exception: ", True),
        (
            "Rank 2 successfully reached monitoredBarrier, but received errors while waiting "
            "for send/recv from rank 0. Please check rank 0 logs for faulty rank.",
            True,
        ),
        ("[pair.cc:553] Connection closed by peer [127.0.0.1]:4300.", True),
        ("Rank 0 timed out in monitoredBarrier after 50 ms.", False),
        ("Detected mismatch between collectives on ranks. Rank 0 is running collective", False),
        ("expected 2 ranks to pass monitoredBarrier, 1 did", False),
    ],
    ids=[
        "rank-0-names-ranks",
        "rank-0-names-a-rank",
        "a-rank-names-rank-0",
        "gloo-peer-gone",
        "rank-0-timed-out",
        "mismatch",
        "look-alike",
    ],
)
def test_only_torchs_words_for_a_failed_peer_mark_a_rank_released(message, released):
    from harness.runners import _rank_process

    assert _rank_process._is_release(RuntimeError(message)) is released
    assert _rank_process._is_release(ValueError(message)) is False


# --- Ctrl-C in any phase --------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["start", "call", "repair", "health", "close"])
def test_ctrl_c_in_any_phase_leaves_no_rank_process_and_no_temp_dir(short_tmp, phase):
    env = _driver_env(short_tmp)
    driver = subprocess.Popen(
        [sys.executable, str(FIXTURES / "interrupted_driver.py"), phase],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=default_sigint,
    )
    try:
        line = driver.stdout.readline()
        assert line.startswith("PIDS "), line
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2
        driver.send_signal(signal.SIGINT)
        assert driver.stdout.readline().strip() == "INTERRUPTED"
        assert _still_alive_after_polling(pids) == []
        assert _world_dirs(Path(env["TMPDIR"])) == []
    finally:
        driver.kill()
        driver.wait(60)


# --- gloo on loopback ------------------------------------------------------------------------


def _tcp_addresses_of_this_process(ctx):
    """The gloo interface this rank was given and the local IP of each of its TCP sockets."""
    import socket as sockets

    tensor = torch.ones(1)
    dist.all_reduce(tensor)  # gloo's connections exist
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    addresses = []
    for table, family in (("/proc/net/tcp", sockets.AF_INET), ("/proc/net/tcp6", sockets.AF_INET6)):
        with open(table) as handle:
            for row in handle.read().splitlines()[1:]:
                fields = row.split()
                if fields[9] in inodes:
                    addresses.append(_proc_net_ip(fields[1].split(":")[0], family))
    return os.environ.get("GLOO_SOCKET_IFNAME"), addresses


def _proc_net_ip(hex_ip, family):
    """An address as /proc/net/tcp{,6} writes it (32-bit words in host byte order)."""
    import socket as sockets

    raw = bytes.fromhex(hex_ip)
    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
    return sockets.inet_ntop(family, b"".join(words))


def _interface_address(name):
    """The IPv4 address of an interface, or None (Linux)."""
    import fcntl
    import socket as sockets
    import struct

    with sockets.socket(sockets.AF_INET, sockets.SOCK_DGRAM) as probe:
        try:
            reply = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return sockets.inet_ntoa(reply[20:24])


linux_only = pytest.mark.skipif(
    not Path("/proc/net/tcp").exists(), reason="reads sockets from /proc/net (Linux)"
)
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


@linux_only
def test_gloo_of_every_rank_talks_over_loopback_by_default(monkeypatch):
    import socket as sockets

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with open_world("processes", world_size=2) as world:
        reports = world.run(_tcp_addresses_of_this_process)
    loopback = [n for _, n in sockets.if_nameindex() if _interface_address(n) == "127.0.0.1"]
    for interface, addresses in reports:
        assert interface in loopback
        assert addresses, "gloo's sockets were found"
        assert set(addresses) <= LOOPBACK


@linux_only
def test_a_gloo_interface_the_user_sets_is_what_the_ranks_use(monkeypatch):
    import socket as sockets

    other = [
        (name, address)
        for _, name in sockets.if_nameindex()
        if (address := _interface_address(name)) not in (None, "127.0.0.1")
    ]
    if not other:
        pytest.skip("this machine has no interface but loopback with an IPv4 address")
    name, address = other[0]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", name)
    with open_world("processes", world_size=2) as world:
        reports = world.run(_tcp_addresses_of_this_process)
    for interface, addresses in reports:
        assert interface == name
        assert address in addresses


def test_a_gloo_interface_this_machine_lacks_is_refused_before_ranks_start(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "distconf-no-such-interface")
    world = ProcessWorld(2)
    with pytest.raises(InvalidArgument, match="GLOO_SOCKET_IFNAME='distconf-no-such-interface'"):
        world.start()
    assert world.generations == 0
