"""Every way ``python -m harness run`` can end tells the truth: its exit code, its summary's
verdict, the report's verdict and the JUnit XML agree, and a run that checked nothing, was
interrupted or died is never green. Options are refused before anything is written, and an
earlier run's records are never lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
from sigint import default_sigint

ROOT = Path(__file__).resolve().parent.parent

ROWS = """
import faulthandler
import os
import time

import pytest


def test_dies(world):
    def body(ctx):
        if ctx.rank == 1:
            os._exit(0)
        return ctx.rank

    world.run(body)


def test_segfaults(world):
    def segfault_on_rank_one(ctx):
        if ctx.rank == 1:
            faulthandler._sigsegv()
        return ctx.rank

    world.run(segfault_on_rank_one)


@pytest.mark.skip(reason="checks nothing")
def test_skipped(world):
    pass


def test_slow(world):
    time.sleep(120)


def test_passes(world):
    assert world.run(lambda ctx: ctx.rank) == list(range(world.world_size))
"""


def _command(
    tmp_path: Path, *options: str, select: str, runner: str = "threads", jobs: str = "1"
) -> list[str]:
    (tmp_path / "test_rows.py").write_text(ROWS)
    return [
        sys.executable, "-m", "harness", "run", "--runner", runner, "--suite", "uneven",
        "--world-sizes", "2", "--profile", "dev", "--seed", "1", "--jobs", jobs,
        "--out", str(tmp_path / "out"), "--junit", str(tmp_path / "out" / "junit.xml"),
        *options, "--", str(tmp_path / "test_rows.py"), "-k", select,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _run(
    tmp_path: Path, *options: str, select: str, runner: str = "threads", jobs: str = "1"
) -> tuple[int, str]:
    done = subprocess.run(
        _command(tmp_path, *options, select=select, runner=runner, jobs=jobs),
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=_env(), check=False,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def _verdicts(out: Path) -> tuple[str, str]:
    """The report's verdict class and the JUnit verdict property."""
    html = (out / "report.html").read_text()
    kind = html.split('<section class="verdict ', 1)[1].split('"', 1)[0]
    suite = ElementTree.parse(out / "junit.xml").getroot().iter("testsuite").__next__()
    junit = {p.get("name"): p.get("value") for p in suite.iter("property")}
    return kind, junit["distconf_verdict"]


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_rank_thread_ending_the_process_is_a_crash_naming_the_test(tmp_path, jobs):
    code, output = _run(tmp_path, select="dies", jobs=jobs)
    assert code == 3, output[-3000:]
    assert "verdict: crashed: Crashed while running" in output
    assert "test_dies[threads-ws2-cpu]" in output
    verdict = output.rstrip().splitlines()[-1]
    assert verdict.count("test_dies[") == 1, verdict  # run once, never handed on after
    assert _verdicts(tmp_path / "out") == ("crashed", "crashed")


def test_a_run_where_every_test_skipped_checked_nothing(tmp_path):
    code, output = _run(tmp_path, select="skipped")
    assert code == 5, output[-3000:]
    assert "verdict: empty: Nothing was checked: all 1 tests skipped" in output
    assert _verdicts(tmp_path / "out") == ("empty", "empty")


def test_a_passing_run_is_green_everywhere(tmp_path):
    code, output = _run(tmp_path, select="passes")
    assert code == 0, output[-3000:]
    assert "verdict: pass: All conformant" in output
    assert _verdicts(tmp_path / "out") == ("pass", "pass")
    assert not list((tmp_path / "out").glob("*.fatal.txt"))  # kept only where a process died


def test_a_segfault_in_a_rank_thread_is_a_crash_naming_where(tmp_path):
    code, output = _run(tmp_path, select="segfaults", jobs="2")
    assert code == 3, output[-3000:]
    verdict = output.rstrip().splitlines()[-1]
    assert "Crashed while running" in verdict and "test_segfaults[" in verdict, verdict
    assert "Fatal Python error: Segmentation fault in segfault_on_rank_one" in verdict, verdict
    fatal_logs = list((tmp_path / "out").glob("results.gw*.fatal.txt"))
    assert len(fatal_logs) == 1 and "segfault_on_rank_one" in fatal_logs[0].read_text()


BROKEN_PLUGIN = """
def pytest_runtest_logfinish(nodeid, location):
    raise RuntimeError(f"a plugin broke after {nodeid}")
"""


def test_an_internal_error_after_a_passing_test_is_a_crashed_run_everywhere(tmp_path):
    """pytest's INTERNALERROR (exit status 3 in the end record) after the first test: the
    session did not run to its end, so one passing test is no green run."""
    (tmp_path / "conftest.py").write_text(BROKEN_PLUGIN)
    code, output = _run(tmp_path, select="passes")
    assert code == 3, output[-3000:]
    assert "INTERNALERROR" in output and "a plugin broke after" in output
    assert (
        "verdict: crashed: Crashed: pytest stopped with an internal error (exit status 3, "
        "INTERNAL_ERROR) in "
    ) in output
    assert "All conformant" not in output
    assert _verdicts(tmp_path / "out") == ("crashed", "crashed")


def _wait_for_start(results: Path, process: subprocess.Popen[str]) -> None:
    for _ in range(600):
        if results.exists() and '"kind": "start"' in results.read_text():
            return
        assert process.poll() is None, process.communicate()[0][-3000:]
        time.sleep(0.1)
    raise AssertionError("the test never started")


@pytest.mark.parametrize("runner", ["threads", "processes"])
def test_sigint_is_an_interrupted_run_everywhere(tmp_path, runner):
    process = subprocess.Popen(
        _command(tmp_path, select="slow", runner=runner),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
        preexec_fn=default_sigint,
    )  # fmt: skip
    _wait_for_start(tmp_path / "out" / "results.jsonl", process)
    time.sleep(1.0)  # into the test's body, past the World's start
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2, output[-3000:]
    assert "verdict: interrupted: Interrupted" in output
    assert "All conformant" not in output
    assert _verdicts(tmp_path / "out") == ("interrupted", "interrupted")


def test_a_refused_option_leaves_an_earlier_run_untouched(tmp_path):
    code, output = _run(tmp_path, select="passes")
    assert code == 0, output[-3000:]
    out = tmp_path / "out"
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    refused = (
        ["--world-sizes", "0"],
        ["--suite", "nosuch"],
        ["--rank-timeout", "0"],
        ["--backend-plugin", "no_such_plugin"],
        ["--runner", "processes", "--backend", "nccl"],
    )
    for bad in refused:
        code, output = _run(tmp_path, *bad, select="passes")
        assert code == 4, output[-3000:]
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_a_new_run_moves_the_earlier_records_aside_whole(tmp_path):
    assert _run(tmp_path, select="passes")[0] == 0
    out = tmp_path / "out"
    earlier = (out / "results.jsonl").read_bytes()
    started = json.loads(earlier.splitlines()[0])["started"]
    code, output = _run(tmp_path, select="skipped")
    assert code == 5, output[-3000:]
    (kept,) = (out / "earlier").iterdir()
    assert (kept / "results.jsonl").read_bytes() == earlier
    assert (kept / "report.html").exists()
    assert started.replace(":", "-").startswith(kept.name[:16])
    assert f"moved to {kept}" in output


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--world-sizes", "9999"], "--world-sizes=9999 must be at most 1024 on the threads"),
        (["--runner", "processes", "--world-sizes", "2,4096"], "--world-sizes=4096 must be at"),
    ],
)
def test_a_world_the_machine_cannot_hold_is_refused_up_front(tmp_path, options, message):
    code, output = _run(tmp_path, *options, select="passes")
    assert code == 4, output[-3000:]
    assert message in output
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from harness.torchkit.devices import device_count; "
            "sys.exit(device_count('cuda') > 0)",
        ],
        check=False,
    ).returncode
    != 0,
    reason="needs a host without a CUDA GPU",
)
def test_a_device_that_is_not_there_is_refused_up_front(tmp_path):
    code, output = _run(tmp_path, "--device", "cuda", select="passes")
    assert code == 4, output[-3000:]
    assert "--device='cuda' must be a device this machine has" in output
    assert not (tmp_path / "out").exists()


def test_the_checkout_guard_fails_a_session_that_touches_a_guarded_dir(pytester, monkeypatch):
    guarded = pytester.mkdir("reports")
    (guarded / "results.jsonl").write_text("kept\n")
    monkeypatch.setenv("DISTCONF_GUARDED_DIRS", str(guarded))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    pytester.makepyfile(
        test_touch=f"""
        import pathlib
        def test_deletes():
            pathlib.Path({str(guarded / "results.jsonl")!r}).unlink()
        """
    )
    run = pytester.runpytest_subprocess("-p", "checkout_guard", "-p", "no:cacheprovider")
    run.assert_outcomes(passed=1)
    assert run.ret == pytest.ExitCode.TESTS_FAILED
    run.stdout.fnmatch_lines(["*touched the checkout's reports:*", "*deleted *results.jsonl"])


def test_ctrl_c_at_a_terminal_is_an_interrupted_run(tmp_path):
    """A Ctrl-C typed at a terminal reaches the run's pytest once (its child has the
    terminal's foreground) and the parent gives the verdict."""
    import pty

    command = _command(tmp_path, select="slow")
    pid, terminal = pty.fork()
    if pid == 0:  # the child: a session whose controlling terminal is the pty
        os.chdir(tmp_path)
        default_sigint()
        os.execve(sys.executable, command, _env())
    output = bytearray()
    results = tmp_path / "out" / "results.jsonl"
    for _ in range(600):
        output += _read_available(terminal)
        if results.exists() and '"kind": "start"' in results.read_text():
            break
        time.sleep(0.1)
    time.sleep(1.0)
    os.write(terminal, b"\x03")
    finished, status = 0, 0
    while not finished:  # drain the terminal while waiting, or a full pty blocks the run
        output += _read_available(terminal)
        finished, status = os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    output += _read_available(terminal)
    os.close(terminal)
    text = output.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 2, text[-3000:]
    assert "verdict: interrupted" in text
    assert _verdicts(tmp_path / "out") == ("interrupted", "interrupted")


def _read_available(descriptor: int) -> bytes:
    import select

    data = b""
    while select.select([descriptor], [], [], 0)[0]:
        try:
            chunk = os.read(descriptor, 65536)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_pytest_child_ends_when_the_run_is_killed(tmp_path):
    process = subprocess.Popen(
        _command(tmp_path, select="slow"),
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(),
    )  # fmt: skip
    _wait_for_start(tmp_path / "out" / "results.jsonl", process)
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    assert len(children) == 1, children
    process.kill()
    process.wait(60)
    for _ in range(100):
        if not Path(f"/proc/{children[0]}").exists():
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"pytest's child {children[0]} outlived a killed harness run")
