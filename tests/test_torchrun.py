"""The torchrun runner: ranks torchrun starts attach to the driver over the authenticated
channel, serve the suites with the process runner's outcomes, and fail as the other runners
do. The Worlds here are two torchrun "nodes" of two processes each on loopback."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness import RankFailure, WorldStartError, cli
from harness.config import RunConfig
from harness.errors import InvalidArgument
from harness.outcome.results import read_results
from harness.runners import make_world
from harness.runners.torchrun import channel
from harness.runners.torchrun.listener import AgentListener
from harness.runners.torchrun.world import TorchrunOptions

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "a-token-for-the-tests-only-0123456789"
WORLD_SIZE = 4


def _pythonpath_with_this_module() -> str:
    """torchrun's workers load the drill functions by this module's name."""
    paths = [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(filter(None, paths))


@pytest.fixture
def ranks_import_this_module(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", _pythonpath_with_this_module())


def _launched(max_restarts: int, timeout: float = 20.0):
    options = TorchrunOptions(
        world_size=WORLD_SIZE, nproc_per_node=2, nnodes=2, max_restarts=max_restarts
    )
    return make_world("torchrun", WORLD_SIZE, torchrun=options, timeout=timeout)


@pytest.fixture
def private_tmpdir(tmp_path, monkeypatch) -> Path:
    """``TMPDIR`` of this test and of everything it starts: a directory that must stay empty."""
    directory = tmp_path / "tmpdir"
    directory.mkdir()
    monkeypatch.setenv("TMPDIR", str(directory))
    monkeypatch.setattr(tempfile, "tempdir", None)
    return directory


@pytest.fixture(scope="module")
def restartable():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", _pythonpath_with_this_module())
        world = _launched(max_restarts=1)
        try:
            world.start()
            yield world
        finally:
            world.close()


# --- what the ranks run ----------------------------------------------------------------------


def _sum_of_ranks(ctx):
    tensor = torch.tensor([float(ctx.rank)])
    dist.all_reduce(tensor)
    return tensor.item(), ctx.runner


def _raises_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()


def _hangs_on_rank_2(ctx):
    if ctx.rank == 2:
        while True:
            time.sleep(0.05)
    dist.barrier()


def _killed_on_rank_3(ctx):
    if ctx.rank == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _assert_serves_next_call(world):
    assert world.run(_sum_of_ranks) == [(6.0, "torchrun")] * WORLD_SIZE


# --- drills ------------------------------------------------------------------------------------


def test_an_exception_names_its_rank_and_the_world_goes_on(restartable):
    with pytest.raises(RankFailure) as info:
        restartable.run(_raises_on_rank_1)
    failure = info.value
    assert failure.primary.rank == 1
    assert failure.statuses == {0: "waiting", 1: "error", 2: "waiting", 3: "waiting"}
    assert "ValueError: rank 1 refuses" in failure.primary.summary
    assert "_raises_on_rank_1" in failure.primary.traceback
    _assert_serves_next_call(restartable)


def test_a_hang_gives_the_stack_of_every_rank_and_the_world_goes_on(restartable):
    with pytest.raises(RankFailure) as info:
        restartable.run(_hangs_on_rank_2, timeout=3.0)
    failure = info.value
    assert failure.timed_out
    assert failure.primary.rank == 2
    assert failure.statuses == {0: "waiting", 1: "waiting", 2: "timeout", 3: "waiting"}
    for outcome in failure.outcomes:  # each rank's stack, gathered over the channel
        assert "_hangs_on_rank_2" in outcome.traceback, outcome
    assert "in barrier" in failure.outcomes[0].traceback
    assert restartable.check_health()
    _assert_serves_next_call(restartable)


def test_a_killed_rank_is_restarted_by_torchrun_and_the_session_goes_on(restartable):
    attaches = restartable.attaches
    with pytest.raises(RankFailure) as info:
        restartable.run(_killed_on_rank_3)
    failure = info.value
    assert failure.primary.rank == 3
    assert failure.primary.status == "crashed"
    assert "rank 3 on node 1" in failure.primary.summary
    assert "killed by signal SIGKILL" in failure.primary.summary
    restartable.check_health()
    _assert_serves_next_call(restartable)  # on agents torchrun restarted
    assert restartable.attaches == attaches + 1


def test_with_no_restarts_left_the_remaining_calls_are_crashed(
    ranks_import_this_module, private_tmpdir
):
    world = _launched(max_restarts=0)
    try:
        _assert_serves_next_call(world)
        with pytest.raises(RankFailure):
            world.run(_killed_on_rank_3)
        for _ in range(2):  # every later call: crashed, naming rank, node and exit
            started = time.monotonic()
            with pytest.raises(RankFailure) as info:
                world.run(_sum_of_ranks)
            # never --attach-timeout (300 s): at most a few seconds for a late exit report
            assert time.monotonic() - started < 20.0
            failure = info.value
            assert failure.primary.rank == 3
            assert failure.primary.status == "crashed"
            assert "rank 3 on node 1" in failure.primary.summary
            assert "killed by signal SIGKILL" in failure.primary.summary
            assert "no restarts left (--max-restarts=0)" in failure.describe()
    finally:
        world.close()
    # torchrun's and torchelastic's files, the token and the logs went with the World
    assert sorted(p.name for p in private_tmpdir.iterdir()) == []


def test_a_function_of_the_drivers_main_is_refused(restartable):
    def local(ctx):
        return ctx.rank

    local.__module__ = "__main__"
    with pytest.raises(InvalidArgument, match=r"fn=.* must be a function of an importable module"):
        restartable.run(local)


# --- what listens where ------------------------------------------------------------------------


def _listening_sockets() -> dict[str, tuple[str, int]]:
    """Every listening TCP socket of this machine: its inode -> (address, port)."""
    found = {}
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        for fields in (line.split() for line in lines):
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)  # 32-bit words in the host's order
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found[fields[9]] = (socket.inet_ntop(family, words), int(port, 16))
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes  # it ended meanwhile
    for descriptor in descriptors:
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{descriptor}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return inodes


def _process_tree(root: int) -> set[int]:
    """``root`` and every process descended from it."""
    parents = {}
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, IndexError):
            if entry.isdigit():
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, grown = {root}, True
    while grown:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grown = bool(children)
    return tree


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads sockets from Linux's /proc")
def test_nothing_distconf_starts_listens_beyond_loopback(restartable):
    """The driver (its listener, the store of the ranks' groups) and every process of the
    torchrun it started (torchrun, agents, ranks and their gloo pairs)."""
    restartable.check_health()
    launched = {pid for p in restartable._launcher.processes for pid in _process_tree(p.pid)}
    listening = _listening_sockets()
    found = {
        (pid, listening[inode])
        for pid in launched | {os.getpid()}
        for inode in _socket_inodes(pid)
        if inode in listening
    }
    assert (os.getpid(), restartable.address) in found
    assert any(pid != os.getpid() for pid, _ in found), "no rank's gloo pairs were seen"
    beyond = sorted((pid, a) for pid, a in found if not ipaddress.ip_address(a[0]).is_loopback)
    assert beyond == [], "listening beyond loopback (pid, address)"


# --- attaching ---------------------------------------------------------------------------------


def test_a_wrong_token_is_refused_before_any_pickle(caplog):
    listener = AgentListener(("127.0.0.1", 0), TOKEN.encode())
    try:
        with pytest.raises(ConnectionError):
            channel.connect(listener.address, b"not-the-token-0123456789", timeout=5.0)
        good = channel.connect(listener.address, TOKEN.encode(), timeout=5.0)
        good.send_bytes(b"\x80\x04N.")  # a pickle: None
        arrival = listener.next(timeout=5.0)
        assert arrival is not None and arrival[0] is None
        arrival[1].close()
        good.close()
        # The refusal is recorded by the listener's handshake thread, which a loaded machine
        # may run after the client already saw its connection refused.
        deadline = time.monotonic() + 10.0
        while "refused a connection" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        listener.close()
    assert len(listener.refused) == 1 and listener.refused[0].endswith("wrong token")
    assert "refused a connection from 127.0.0.1" in caplog.text


def test_an_impostor_driver_is_refused_by_the_agent():
    listener = AgentListener(("127.0.0.1", 0), b"the-impostor-knows-another-token")
    try:
        with pytest.raises(ConnectionError):
            channel.connect(listener.address, TOKEN.encode(), timeout=5.0)
    finally:
        listener.close()


def test_agents_that_never_attach_fail_the_start_after_the_attach_timeout(monkeypatch):
    monkeypatch.setenv(channel.TOKEN_VAR, TOKEN)
    options = TorchrunOptions(world_size=WORLD_SIZE, attach_timeout=1.5)
    world = make_world("torchrun", WORLD_SIZE, torchrun=options)
    try:
        with pytest.raises(ConnectionError):  # and one with the wrong token, refused
            channel.connect(world.address, b"not-the-token-0123456789", timeout=5.0)
        started = time.monotonic()
        with pytest.raises(WorldStartError) as info:
            world.start()
        assert time.monotonic() - started < 10.0
        message = str(info.value)
        assert "--attach-timeout=1.5 s passed before 4 agents attached to 127.0.0.1:" in message
        assert "ranks [0, 1, 2, 3] missing (0 attached)" in message
        assert "wrong token" in message
        with pytest.raises(WorldStartError):  # at once: the World does not wait again
            world.run(_sum_of_ranks)
    finally:
        world.close()


def test_an_agent_that_fails_to_attach_leaves_nothing_in_tmpdir(private_tmpdir):
    listener = AgentListener(("127.0.0.1", 0), TOKEN.encode())
    try:
        host, port = listener.address
        torchrun_env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        agent = subprocess.run(
            [sys.executable, "-m", "harness.attach", f"--driver={host}:{port}"],
            env={
                **os.environ,
                **torchrun_env,
                "PYTHONPATH": str(ROOT),
                channel.TOKEN_VAR: "not-the-token-0123456789",
            },
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        listener.close()
    assert agent.returncode != 0
    assert "ConnectionError: the peer closed the connection during the handshake" in agent.stderr
    assert sorted(p.name for p in private_tmpdir.iterdir()) == []


def test_where_the_driver_waits_and_a_listener_beyond_loopback_are_warnings(monkeypatch, caplog):
    """On the torchrun runner's notices logger, which the plugin puts on the terminal."""
    monkeypatch.setenv(channel.TOKEN_VAR, TOKEN)
    monkeypatch.setattr(channel, "is_loopback", lambda host: False)
    options = TorchrunOptions(world_size=2, attach_timeout=1.0)
    world = make_world("torchrun", 2, torchrun=options)
    try:
        host, port = world.address
    finally:
        world.close()
    notices = [
        r.getMessage()
        for r in caplog.records
        if r.name == "distconf.torchrun" and r.levelno == logging.WARNING
    ]
    assert f"the torchrun runner listens on {host}:{port}, beyond this machine's" in notices[0]
    assert notices[1] == (
        f"distconf: waiting up to 1 s for 2 agents: torchrun ... -m harness.attach --driver "
        f"{host}:{port}"
    )


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"nproc_per_node": 2}, "nproc_per_node=2 must be left unset without --runner torchrun"),
        ({"runner": "torchrun"}, "world_sizes='1,2,3,4' must be one size with --runner torchrun"),
        ({"runner": "torchrun", "nproc_per_node": 2, "workers": 2}, "workers=2 must be 1"),
        ({"runner": "torchrun", "world_sizes": (4,), "listen": "nowhere"}, "listen='nowhere'"),
        ({"runner": "torchrun", "nproc_per_node": 2, "faults": ("x",)}, "faults=('x',) must"),
    ],
)
def test_torchrun_options_are_refused_before_anything_starts(fields, expected):
    with pytest.raises(InvalidArgument, match=expected.replace("(", r"\(").replace(")", r"\)")):
        RunConfig(**fields)


def test_agents_started_elsewhere_need_the_token_before_anything_starts(monkeypatch, tmp_path):
    monkeypatch.delenv(channel.TOKEN_VAR, raising=False)
    config = RunConfig(runner="torchrun", world_sizes=(4,), out=tmp_path)
    with pytest.raises(InvalidArgument, match=r"DISTCONF_TOKEN='<unset>' must be a shared"):
        config.check_machine()


def test_a_missing_token_is_named_as_the_variable_it_is(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(channel.TOKEN_VAR, raising=False)
    command = ["run", "--runner", "torchrun", "--world-sizes", "2", "--out", str(tmp_path)]
    assert cli.main(command) == cli.USAGE_ERROR
    err = capsys.readouterr().err
    assert "error: DISTCONF_TOKEN='<unset>' must be a shared secret of at least 16" in err
    assert "--DISTCONF-TOKEN" not in err


# --- the suites --------------------------------------------------------------------------------


def _harness_run(out: Path, *options: str) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "harness", "run", "--suite", "placements,uneven",
        "--profile", "dev", "--seed", "1", "--jobs", "1", "--out", str(out), *options,
    ]  # fmt: skip
    return subprocess.Popen(
        command, cwd=out.parent, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _outcomes_by_spec(out: Path) -> dict[str, str]:
    tests = [t for f in sorted(out.glob("results*.jsonl")) for t in read_results(f).tests]
    return {f"{t['spec']} ws{t['world_size']}": t["status"] for t in tests}


def test_the_suites_on_two_torchrun_nodes_match_the_process_runner(tmp_path):
    processes = _harness_run(tmp_path / "processes", "--runner", "processes", "--world-sizes", "4")
    processes_output, _ = processes.communicate(timeout=900)
    torchrun = _harness_run(
        tmp_path / "torchrun", "--runner", "torchrun", "--nproc-per-node", "2", "--nnodes", "2"
    )
    torchrun_output, _ = torchrun.communicate(timeout=900)
    assert processes.returncode == 0, processes_output[-3000:]
    assert torchrun.returncode == 0, torchrun_output[-3000:]
    expected = _outcomes_by_spec(tmp_path / "processes")
    assert sum(status == "passed" for status in expected.values()) >= 15
    assert _outcomes_by_spec(tmp_path / "torchrun") == expected


def test_the_driver_shows_where_it_waits_and_what_it_refused_at_once(tmp_path):
    """pytest runs the run's tests with its capture on, in a child of ``harness run``: the
    waiting line and each refusal reach the terminal while the driver waits, and the end
    record and the report count the refusals."""
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "harness", "run", "--runner", "torchrun", "--world-sizes", "2",
        "--attach-timeout", "15", "--suite", "placements", "--profile", "dev", "--seed", "1",
        "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), channel.TOKEN_VAR: TOKEN}
    run = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in run.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []

    def printed(pattern: str, timeout: float) -> re.Match[str]:
        """The line matching ``pattern``, printed while the run still waits for agents."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                line = lines.get(timeout=0.1)
                assert line is not None, f"the run ended first:\n{''.join(seen)[-3000:]}"
                seen.append(line)
                found = re.search(pattern, line)
                if found:
                    assert run.poll() is None, "printed only once the run had ended"
                    return found
        raise AssertionError(f"not printed in {timeout} s:\n{''.join(seen)[-3000:]}")

    try:
        waiting = printed(
            r"distconf: waiting up to 15 s for 2 agents: torchrun \.\.\. -m harness\.attach "
            r"--driver (127\.0\.0\.1):(\d+)",
            timeout=180,
        )
        driver = (waiting[1], int(waiting[2]))
        with pytest.raises(ConnectionError):
            channel.connect(driver, b"not-the-token-0123456789", timeout=5.0)
        printed(
            r"refused a connection from 127\.0\.0\.1:\d+ to the torchrun listener: wrong token", 10
        )
        run.wait(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 1, "".join(seen)[-3000:]
    (results,) = out.glob("results*.jsonl")
    assert read_results(results).end["refused_connections"] == 1
    assert "the torchrun driver refused 1 connection " in (out / "report.html").read_text()
