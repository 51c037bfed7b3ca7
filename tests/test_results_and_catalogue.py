"""The results store keeps what was written; the catalogue is well-formed and matches the suites."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness import catalogue, errors
from harness.outcome import expectations
from harness.outcome.results import ResultsWriter, TestRecord, environment_stamp, read_results

ROOT = Path(__file__).resolve().parent.parent


def _record(status="passed", **extra):
    return TestRecord(
        nodeid="t::x",
        spec="a.b",
        runner="threads",
        world_size=2,
        device="cpu",
        status=status,
        duration=0.1,
        **extra,
    )


def test_every_record_is_on_disk_as_soon_as_it_is_written(tmp_path):
    path = tmp_path / "r.jsonl"
    writer = ResultsWriter(path, environment_stamp(runner="threads"))
    writer.write_test(_record())
    written = read_results(path)  # not closed: as after a crash
    assert written.header["torch"] and written.header["runner"] == "threads"
    assert [t["status"] for t in written.tests] == ["passed"]
    assert written.end is None
    writer.close(exitstatus=0)
    assert read_results(path).end["exitstatus"] == 0


def test_corrupt_lines_are_reported_not_fatal(tmp_path):
    path = tmp_path / "r.jsonl"
    lines = [
        json.dumps(environment_stamp()),
        "{not json",
        json.dumps({"kind": "test", "status": "passed"}),
        '{"kind": "??"}',
    ]
    path.write_text("\n".join(lines) + "\n")
    results = read_results(path)
    assert results.bad_lines == [2, 4]
    assert len(results.tests) == 1


def test_unknown_status_is_rejected():
    with pytest.raises(ValueError, match="status='green' must be one of"):
        _record(status="green")


def test_long_texts_are_clipped(tmp_path):
    path = tmp_path / "r.jsonl"
    writer = ResultsWriter(path, environment_stamp())
    writer.write_test(_record(status="failed", traceback="x" * 50_000))
    writer.close()
    assert "more characters clipped" in read_results(path).tests[0]["traceback"]


def test_catalogue_loads_and_every_area_prefixes_its_ids():
    specs = catalogue.load()
    assert specs and all(spec.id.startswith(spec.area + ".") for spec in specs.values())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[spec]]\nid = "a.b"\n', "lacks string fields"),
        ("[[spec", "is not valid TOML"),
        (
            '[[spec]]\nid="a.b"\narea="b"\nsuite="s"\nstatement="s"\nprovenance="p"\nstatus="active"\n',
            "id='a.b' must be prefixed by its area 'b'",
        ),
        (
            '[[spec]]\nid="a.b"\narea="a"\nsuite="s"\nstatement="s"\nprovenance="p"\nstatus="maybe"\n',
            r"c\.toml: \[\[spec\]\] #1: status='maybe' must be one of \('active', 'planned'\)",
        ),
        (
            '[[spec]]\nid="a.b"\narea="a"\nsuite="s"\nstatement="s"\nprovenance="p"\nstatus="active"\nowner="x"\n',
            "unknown fields",
        ),
    ],
)
def test_malformed_catalogue_names_the_entry(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(catalogue.CatalogueError, match=message):
        catalogue.load(path)


def test_file_errors_are_the_classes_of_harness_errors():
    from harness.faults import FaultError
    from harness.report import ReportError
    from harness.report.records import ReportError as RecordsReportError
    from harness.report.screenshot import ScreenshotError

    assert catalogue.CatalogueError is errors.CatalogueError
    assert expectations.ExpectationError is errors.ExpectationError
    assert ReportError is RecordsReportError is errors.ReportError
    assert ScreenshotError is errors.ScreenshotError
    assert FaultError is errors.FaultError


def test_writing_after_close_is_refused(tmp_path):
    writer = ResultsWriter(tmp_path / "r.jsonl", environment_stamp())
    writer.close()
    with pytest.raises(errors.DistconfError, match="is already closed"):
        writer.write_test(_record())


def test_suites_and_catalogue_agree():
    """Collecting every suite runs the plugin's spec check (markers, IDs, coverage)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "harness.plugin",
            "-p",
            "no:cacheprovider",
            str(ROOT / "suites"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    collected = done.stdout
    for spec in catalogue.load().values():
        assert spec.status != "active" or (ROOT / "suites" / f"test_{spec.suite}.py").exists()
    assert "test_distribute_tensor_matches_model[threads-ws4-cpu]" in collected
