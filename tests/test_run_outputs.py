"""What ``python -m harness run`` writes, and where. One run at a time in an ``--out``: a
second run there is refused while the first runs, and a run judges only the results its own
pytest wrote. An output that cannot be written is refused before anything starts, a report
is written whole or not at all, and a run its pytest refuses moves nothing aside."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness import InvalidArgument, cli
from harness.config import RunConfig
from harness.outcome.results import ResultsWriter, environment_stamp, read_results

ROOT = Path(__file__).resolve().parent.parent
LOCK = ".distconf.lock"
"""The lock file a run holds in its ``--out`` (``harness.outcome.outputs.LOCK``)."""

DRILL = """
import os
import time
from pathlib import Path

GO = Path(__file__).with_name("go")


def _end_the_process(ctx):
    os._exit(0)


def test_ends_when_told(world):
    for _ in range(1800):
        if GO.exists():
            break
        time.sleep(0.1)
    world.run(_end_the_process)


def test_passes(world):
    assert world.run(lambda ctx: 1) == [1] * world.world_size


def test_told_to_pass(world):
    for _ in range(1800):
        if GO.exists():
            break
        time.sleep(0.1)
    assert world.run(lambda ctx: 1) == [1] * world.world_size
"""


def _command(
    tmp_path: Path,
    *options: str,
    select: str,
    runner: str = "threads",
    pytest_args: tuple[str, ...] = (),
) -> list[str]:
    (tmp_path / "test_drill.py").write_text(DRILL)
    return [
        sys.executable, "-m", "harness", "run", "--runner", runner, "--suite", "uneven",
        "--world-sizes", "2", "--profile", "dev", "--seed", "1", "--jobs", "1",
        "--out", str(tmp_path / "out"), *options,
        "--", str(tmp_path / "test_drill.py"), "-k", select, *pytest_args,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _start(tmp_path: Path, *options: str, select: str, **keywords: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _command(tmp_path, *options, select=select, **keywords),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
    )  # fmt: skip


def _run(
    tmp_path: Path, *options: str, pytest_args: tuple[str, ...] = (), **keywords: Any
) -> tuple[int, str]:
    done = subprocess.run(
        _command(tmp_path, *options, select="passes", pytest_args=pytest_args),
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=_env(), check=False,
        **keywords,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def _wait_for_start(results: Path, process: subprocess.Popen[str]) -> None:
    for _ in range(1200):
        if results.exists() and '"kind": "start"' in results.read_text():
            return
        assert process.poll() is None, process.communicate()[0][-3000:]
        time.sleep(0.1)
    raise AssertionError("the first run's test never started")


@pytest.mark.parametrize("runner", ["threads", "local"])
def test_a_second_run_on_a_busy_out_is_refused_and_the_first_judges_its_own_crash(tmp_path, runner):
    """The drill of issue 32: a first run whose rank ends the process (``os._exit(0)``)
    after a second run into the same ``--out`` finished. The second is refused; the first
    judges its own records, a crash, not the second run's green file."""
    first = _start(tmp_path, select="ends_when_told", runner=runner)
    try:
        out = tmp_path / "out"
        _wait_for_start(out / "results.jsonl", first)
        second_code, second = _run(tmp_path, "--runner", runner)
    finally:
        (tmp_path / "go").touch()
        first_output = first.communicate(timeout=300)[0]
    assert (second_code, first.returncode) == (4, 3), (second[-3000:], first_output[-3000:])
    assert f"error: --out='{out}' must be a directory no other run is writing to" in second
    assert f"the run of pid {first.pid}" in second
    assert "verdict: crashed: Crashed while running" in first_output
    assert "test_ends_when_told" in first_output
    assert not (out / "earlier").exists(), "the refused run moved the first run's records"
    (results,) = sorted(out.glob("results*.jsonl"))
    written = read_results(results)
    assert [nodeid.split("::")[-1] for nodeid in written.started] == [
        f"test_ends_when_told[{runner}-ws2-cpu]"
    ]
    assert written.end is None and not written.bad_lines


def test_two_runs_started_at_once_into_one_out_lose_no_record(tmp_path):
    """Both started together; the run that holds the directory waits (for the file "go")
    until the other has ended, so the two overlap however the machine schedules them."""
    runs = [_start(tmp_path, select="told_to_pass") for _ in range(2)]
    try:
        first = _first_to_end(runs)
    finally:
        (tmp_path / "go").touch()
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    codes = [run.returncode for run in runs]
    assert first.returncode == 4 and sorted(codes) == [0, 4], [o[-2000:] for o in outputs]
    (results,) = sorted((tmp_path / "out").glob("results*.jsonl"))
    written = read_results(results)
    assert not written.bad_lines and written.end is not None
    assert [t["status"] for t in written.tests] == ["passed"]


def _first_to_end(runs: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    for _ in range(3000):
        for run in runs:
            if run.poll() is not None:
                return run
        time.sleep(0.1)
    raise AssertionError("neither run ended")


def test_a_run_reads_only_its_own_results_files(tmp_path):
    """A results file another run wrote beside this run's (an xdist worker's of an earlier
    run, a plain pytest given the same file) is never summarised with it."""
    for name, run_id in (("results.jsonl", "mine"), ("results.gw3.jsonl", "theirs")):
        ResultsWriter(tmp_path / name, environment_stamp(run_id=run_id)).close(exitstatus=0)
    (tmp_path / "results.gw0.jsonl").write_text("{not a header\n")
    from harness.outcome.outputs import results_of

    own, others = results_of(tmp_path, "mine")
    assert own == [tmp_path / "results.jsonl"]
    assert others == [tmp_path / "results.gw0.jsonl", tmp_path / "results.gw3.jsonl"]


@pytest.mark.parametrize("command", [["report", "-o", "r.html"], ["expectations", "check"]])
def test_a_directory_holding_two_runs_is_refused_naming_each(
    tmp_path, command, capsys, monkeypatch
):
    """``harness report DIR`` and ``expectations check DIR`` judge one run: a directory where
    another run's files lie beside it (copied there, or a plain pytest run's) is refused."""
    out = tmp_path / "out"
    out.mkdir()
    for name, run_id in (("results.gw0.jsonl", "mine"), ("results.gw3.jsonl", "theirs")):
        ResultsWriter(out / name, environment_stamp(run_id=run_id)).close(exitstatus=0)
    monkeypatch.chdir(tmp_path)
    assert cli.main([*command, str(out)]) == cli.USAGE_ERROR
    error = capsys.readouterr().err
    assert f"RESULTS={str(out)!r} must hold the results of one run" in error
    assert "mine: results.gw0.jsonl; theirs: results.gw3.jsonl" in error
    assert not (tmp_path / "r.html").exists()


def test_a_plain_pytest_session_never_empties_a_results_file_another_is_writing(pytester):
    """``pytest --distconf-results=FILE`` while another session writes FILE: refused (a
    usage error naming the writer), never truncating its records."""
    results = pytester.path / "results.jsonl"
    writer = ResultsWriter(results, environment_stamp(run_id="first"))
    writer.write_start("elsewhere.py::test_running")
    before = results.read_bytes()
    pytester.makepyfile(test_one="def test_one(world):\n    assert world.world_size == 1\n")
    try:
        run = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "--world-sizes=1", f"--distconf-results={results}"
        )
        assert results.read_bytes() == before
    finally:
        writer.close(exitstatus=0)
    assert run.ret == pytest.ExitCode.USAGE_ERROR, run.stdout.str()[-2000:]
    run.stderr.fnmatch_lines(
        [f"*--distconf-results='{results}' must be a file no other session is writing, and "
         f"pid {os.getpid()} *is writing it*"]
    )  # fmt: skip


def test_the_lock_of_a_run_that_died_refuses_nothing(tmp_path):
    """The lock is the kernel's: it ends with the process that held it, however it ends."""
    from harness.outcome.outputs import locked

    out = tmp_path / "out"
    child = os.fork()
    if child == 0:
        try:
            with locked(out):
                os._exit(0)
        finally:
            os._exit(1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (out / LOCK).exists()
    with locked(out):
        assert str(os.getpid()) in (out / LOCK).read_text()


def test_a_report_that_cannot_be_written_is_an_error_and_never_a_partial_page(tmp_path):
    """A file size limit makes the kernel refuse the page's write, as a full disk does
    (EFBIG here, ENOSPC there): the run says so, and no page cut short is left to show its
    verdict."""

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a refused write, not a killed run
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    code, output = _run(tmp_path, preexec_fn=limited)
    out = tmp_path / "out"
    assert code == 1, output[-3000:]
    assert "verdict: pass: All conformant" in output
    assert f"error: no report: cannot write '{out / 'report.html'}': File too large" in output
    assert "Traceback" not in output
    assert not (out / "report.html").exists()
    assert sorted(p.name for p in out.iterdir()) == [LOCK, "results.jsonl"]


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("kept\n")
    return path


@pytest.mark.parametrize(
    ("option", "where", "expected"),
    [
        ("--out", "file", "a directory, and '{path}' is a file"),
        ("--out", "under-file", "a directory, and '{file}' is a file"),
        ("--out", "proc", "a path this user can create and write files in"),
        ("--junit", "dir", "a file, and it is a directory"),
        ("--junit", "proc", "a path this user can create and write files in"),
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_anything_starts(
    tmp_path, option, where, expected
):
    file = _file(tmp_path)
    path = {
        "file": file,
        "under-file": file / "out",
        "proc": Path("/proc/distconf-out"),
        "dir": tmp_path,
    }[where]
    if where == "proc" and not Path("/proc/self").exists():
        pytest.skip("needs /proc")
    code, output = _run(tmp_path, option, str(path))
    assert code == 4, output[-3000:]
    message = expected.format(path=path, file=file)
    assert f"error: {option}='{path}' must be {message}" in output, output[-3000:]
    assert "Traceback" not in output and "distconf results" not in output
    assert not (tmp_path / "out").exists() or where == "file"
    assert file.read_text() == "kept\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a read-only mode")
def test_a_read_only_out_is_refused(tmp_path):
    directory = tmp_path / "read-only"
    directory.mkdir(mode=0o555)
    with pytest.raises(InvalidArgument, match=r"out='.*read-only/out' must be a path this"):
        RunConfig(out=directory / "out").check_outputs()


def test_mutate_refuses_an_out_it_cannot_write_before_anything_runs(tmp_path, capsys):
    file = _file(tmp_path)
    code = cli.main(["mutate", "--faults", "dtensor.partial_avg_as_sum", "--out", str(file)])
    assert code == cli.USAGE_ERROR
    assert f"error: --out='{file}' must be a directory, and '{file}' is a file" in (
        capsys.readouterr().err
    )
    assert file.read_text() == "kept\n"


def test_a_missing_expectations_directory_is_refused_before_the_earlier_run_is_moved(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    earlier = {
        "results.jsonl": json.dumps(environment_stamp(run_id="earlier")) + "\n",
        "report.html": "<p>the earlier run</p>\n",
    }
    for name, text in earlier.items():
        (out / name).write_text(text)
    missing = tmp_path / "no-such-expectations"
    code, output = _run(tmp_path, pytest_args=("-o", f"distconf_expectations={missing}"))
    assert code == 4, output[-3000:]
    assert f"distconf_expectations='{missing}' must be a directory of *.toml" in output
    assert {p.name: p.read_text() for p in out.iterdir() if p.name != LOCK} == earlier
    assert "moved to" not in output
