"""The command line as a user meets it: a run's main results file reported with its
workers' files."""

from __future__ import annotations

import shutil
from pathlib import Path

from harness import cli
from harness.outcome.results import ResultsWriter, TestRecord, environment_stamp


def _run_of_two_workers(out: Path, run_id: str = "mine") -> Path:
    """The files an xdist run of two workers writes: the main file (the controller's, no
    test of its own) and a file per worker, each holding one test; the main file's path."""
    for worker in ("gw0", "gw1"):
        writer = ResultsWriter(
            out / f"results.{worker}.jsonl", environment_stamp(run_id=run_id, worker=worker)
        )
        nodeid = f"suites/test_uneven.py::test_{worker}[threads-ws1-cpu]"
        writer.write_start(nodeid)
        record = TestRecord(nodeid, "uneven.shard.torch_chunk", "threads", 1, "cpu", "passed", 1.0)
        writer.write_test(record)
        writer.close(exitstatus=0)
    main = ResultsWriter(out / "results.jsonl", environment_stamp(run_id=run_id, worker=None))
    main.close(exitstatus=0, workers=2)
    return out / "results.jsonl"


def test_report_of_a_runs_main_file_reads_its_workers_files_beside_it(tmp_path, capsys):
    """Row 1 of issue 38: the file README's run names is the main file of an xdist run."""
    out = tmp_path / "out"
    main = _run_of_two_workers(out)
    ResultsWriter(out / "results.gw7.jsonl", environment_stamp(run_id="theirs")).close()
    html = tmp_path / "r.html"
    assert cli.main(["report", str(main), "-o", str(html)]) == 0, capsys.readouterr().err
    page = html.read_text(encoding="utf-8")
    assert f"{out / 'results.gw0.jsonl'}<" in page and f"{out / 'results.gw1.jsonl'}<" in page
    assert "results.gw7.jsonl" not in page, "another run's file was read with this one"
    assert cli.main(["expectations", "check", str(main)]) == 0, capsys.readouterr().err


def test_a_main_file_without_its_workers_files_never_says_nothing_ran(tmp_path, capsys):
    main = _run_of_two_workers(tmp_path / "out")
    alone = tmp_path / "copied" / "results.jsonl"
    alone.parent.mkdir()
    shutil.copy(main, alone)
    assert cli.main(["report", str(alone), "-o", str(tmp_path / "r.html")]) == cli.USAGE_ERROR
    error = capsys.readouterr().err
    assert "nothing ran" not in error
    assert f"no test records in {alone}: it is the main results file of a run whose 2 " in error
    assert "name the workers' files too, or the directory holding them all" in error
    assert not (tmp_path / "r.html").exists()
