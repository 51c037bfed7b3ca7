"""How ``python -m harness run`` ends when it is told to stop or its test never ends, drilled
on a real run of a tiny selection: SIGTERM (what CI runners and ``timeout`` send) is an
interrupted run as SIGINT is, on every runner; a test stuck where pytest-timeout cannot reach
it (C code holding the GIL) is killed by the parent after the test timeout and its grace, and
the run is crashed while running that test. Either way no process of the run is left, and
nothing in the TMPDIR it was given."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.forked import KILL_GRACE, ORPHAN_GRACE
from harness.outcome.results import read_results

ROOT = Path(__file__).resolve().parent.parent
STOP_WITHIN = 180.0
"""Seconds an interrupted or killed run may take to end: a bound on a wait, not a figure."""

ROWS = """
import ctypes
import os
import threading
import time
from pathlib import Path


def _its_rank(ctx):
    return ctx.rank


def test_passes(world):
    assert world.run(_its_rank) == [0, 1]


def _mark_and_stay(ctx):
    Path(os.environ["DRILL_MARKS"], f"{os.getpid()}-{threading.get_ident()}").touch()
    time.sleep(600)


def test_stays(world):
    world.run(_mark_and_stay)


def _hold_the_gil_forever():
    # PyDLL keeps the GIL through the call, and a default mutex locked twice by one thread
    # never returns, whatever signal arrives: no Python code runs in this process again.
    Path(os.environ["DRILL_MARKS"], str(os.getpid())).touch()
    libc = ctypes.PyDLL(None)
    mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)


def _rank_1_holds_the_gil(ctx):
    if ctx.rank == 1:
        _hold_the_gil_forever()


def test_stuck_in_c(world):
    if world.runner == "threads":
        world.run(_rank_1_holds_the_gil)  # a rank thread: the driver's process stops with it
    else:
        _hold_the_gil_forever()  # rank processes have a driver that kills them: the driver
"""

RUNNER_OPTIONS = {
    "threads": (),
    "processes": (),
    "local": (),
    "torchrun": ("--nproc-per-node", "2"),
}


@pytest.fixture
def drill(tmp_path: Path) -> Iterator[Path]:
    """A directory for the run (its test file, marks, --out) and, with a short path (the
    fork server's socket must fit an AF_UNIX path), the run's TMPDIR: ``drill/tmp``."""
    short = Path(tempfile.mkdtemp(prefix="dc-"))
    (short / "tmp").mkdir()
    (short / "marks").mkdir()
    (short / "test_rows.py").write_text(ROWS)
    yield short
    shutil.rmtree(short, ignore_errors=True)


def _start(
    drill: Path, runner: str, *options: str, select: str, pytest_options: tuple[str, ...] = ()
) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "harness", "run", "--runner", runner, *RUNNER_OPTIONS[runner],
        "--suite", "uneven", "--world-sizes", "2", "--profile", "dev", "--seed", "1",
        "--out", str(drill / "out"), "--junit", str(drill / "out" / "junit.xml"), *options,
        "--", str(drill / "test_rows.py"), "-k", select, *pytest_options,
    ]  # fmt: skip
    env = {
        **os.environ,
        # torchrun's ranks load the rank functions by their module's name
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(drill)]),
        "TMPDIR": str(drill / "tmp"),
        "DRILL_MARKS": str(drill / "marks"),
    }
    return subprocess.Popen(
        command, cwd=drill, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def _wait_for_marks(drill: Path, run: subprocess.Popen[str], count: int) -> None:
    """Until ``count`` ranks (or drivers) marked that they are inside the test's body."""
    deadline = time.monotonic() + STOP_WITHIN
    while len(list((drill / "marks").iterdir())) < count:
        assert run.poll() is None, run.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the test's body never ran"
        time.sleep(0.1)


def _started(drill: Path) -> bool:
    files = (drill / "out").glob("results*.jsonl")
    return any(read_results(path).started for path in files)


def _verdicts(out: Path) -> tuple[str, str, str]:
    """The report's verdict class and text, and the JUnit verdict property."""
    html = (out / "report.html").read_text()
    section = html.split('<section class="verdict ', 1)[1]
    kind = section.split('"', 1)[0]
    suite = ElementTree.parse(out / "junit.xml").getroot().iter("testsuite").__next__()
    junit = {p.get("name"): p.get("value") for p in suite.iter("property")}
    return kind, section.split("</section>", 1)[0], junit["distconf_verdict"]


def _processes_of_the_run(drill: Path) -> list[str]:
    """Processes whose environment names the run's TMPDIR (every process a run starts
    inherits it: pytest, xdist's workers, the fork server, ranks, torchrun and its agents),
    with their command lines."""
    marker = f"TMPDIR={drill / 'tmp'}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if any(entry == marker or entry.startswith(marker + b"/") for entry in environ):
            found.append(f"{proc.name}: {command.decode(errors='replace')}")
    return found


def _assert_nothing_left(drill: Path) -> None:
    deadline = time.monotonic() + 10.0
    while _processes_of_the_run(drill) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_of_the_run(drill) == []
    assert sorted(os.listdir(drill / "tmp")) == []


linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="lists the run's processes from /proc (Linux)"
)


@linux_only
def test_a_passing_process_runner_run_leaves_nothing_behind(drill):
    """multiprocessing's fork server directory (pymp-*) was left after every such run."""
    run = _start(drill, "processes", "--jobs", "1", select="passes")
    output, _ = run.communicate(timeout=STOP_WITHIN)
    assert run.returncode == 0, output[-3000:]
    _assert_nothing_left(drill)


@linux_only
@pytest.mark.parametrize(
    ("runner", "jobs"),
    [("threads", "1"), ("processes", "1"), ("processes", "2"), ("local", "1"), ("torchrun", "1")],
    ids=["threads", "processes", "processes-2-workers", "local", "torchrun"],
)
def test_sigterm_is_an_interrupted_run_that_leaves_nothing_behind(drill, runner, jobs):
    run = _start(
        drill, runner, "--jobs", jobs, "--rank-timeout", "900", "--test-timeout", "900",
        select="stays",
    )  # fmt: skip
    try:
        # every rank of the World is inside the call (the local runner's one thread, once)
        _wait_for_marks(drill, run, 1 if runner == "local" else 2)
        assert _started(drill)
        run.send_signal(signal.SIGTERM)
        output, _ = run.communicate(timeout=STOP_WITHIN)
    finally:
        run.kill()
        run.wait()
    assert run.returncode == 2, output[-3000:]
    assert "verdict: interrupted: Interrupted (SIGTERM): the run did not finish" in output
    out = drill / "out"
    kind, _, junit = _verdicts(out)
    assert (kind, junit) == ("interrupted", "interrupted")
    files = sorted(out.glob("results*.jsonl"))
    assert len(files) == (3 if jobs == "2" else 1)
    # every pytest process of the run closed its session (its Worlds first): the controller
    # and the worker that ran the test say why; a worker given no test had finished
    for path in files:
        results = read_results(path)
        assert results.end is not None, f"{path.name} has no end record"
        if results.started or path.name == "results.jsonl":
            assert results.end.get("interrupted") == "SIGTERM", (path.name, results.end)
    _assert_nothing_left(drill)


@linux_only
@pytest.mark.parametrize("runner", ["threads", "processes"])
def test_a_test_stuck_holding_the_gil_is_killed_after_its_timeout_and_grace(drill, runner):
    test_timeout = 20.0
    # pytest-timeout times the test's body only: how long a World takes to start on a loaded
    # machine is not what this drill is about (the parent's limit counts from the start
    # record, setup included).
    run = _start(
        drill, runner, "--jobs", "1", "--rank-timeout", "5", "--test-timeout",
        f"{test_timeout:g}", select="stuck_in_c", pytest_options=("-o", "timeout_func_only=true"),
    )  # fmt: skip
    try:
        _wait_for_marks(drill, run, 1)
        stuck_since = time.monotonic()
        output, _ = run.communicate(timeout=test_timeout + KILL_GRACE + STOP_WITHIN)
        took = time.monotonic() - stuck_since
    finally:
        run.kill()
        run.wait()
    assert run.returncode == 3, output[-3000:]
    assert took < test_timeout + KILL_GRACE + 30.0, output[-3000:]
    test = f"::test_stuck_in_c[{runner}-ws2-cpu]"
    killed = re.compile(
        rf"harness run killed its processes [0-9.]+ s into {re.escape(test)}, past "
        rf"--test-timeout={test_timeout:g} s and {KILL_GRACE:g} s of grace"
    )
    assert f"distconf: {test} has run" in output
    assert f"verdict: crashed: Crashed while running {test} (no end record in" in output
    assert killed.search(output), output[-3000:]
    kind, text, junit = _verdicts(drill / "out")
    assert (kind, junit) == ("crashed", "crashed")
    assert killed.search(text), text
    (kill,) = read_results(drill / "out" / "results.jsonl").killed
    assert kill["nodeid"] == test
    assert test_timeout + KILL_GRACE <= kill["seconds"] < test_timeout + KILL_GRACE + 10.0
    _assert_nothing_left(drill)


@linux_only
def test_a_run_killed_outright_while_stuck_leaves_nothing_behind(drill):
    """``harness run`` killed (SIGKILL) while its test is stuck where no Python code runs:
    its stand-in interrupts the run, and kills what did not end within the grace."""
    run = _start(
        drill, "threads", "--jobs", "1", "--rank-timeout", "5", "--test-timeout", "900",
        select="stuck_in_c",
    )  # fmt: skip
    try:
        _wait_for_marks(drill, run, 1)
    finally:
        run.kill()
        run.wait()
    deadline = time.monotonic() + ORPHAN_GRACE + 30.0
    while _processes_of_the_run(drill) and time.monotonic() < deadline:
        time.sleep(0.5)
    _assert_nothing_left(drill)
