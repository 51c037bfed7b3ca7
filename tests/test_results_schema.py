"""A results file of a schema this distconf does not read is never rendered green without a
word: every reader goes through ``read_results``, which marks it; the summary, the report and
JUnit give a partial verdict and say why, and ``expectations check`` refuses it."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from harness import cli, session
from harness.outcome import junit
from harness.outcome.results import READS, SCHEMA, ResultsWriter, TestRecord
from harness.report import render_report

CATALOGUE = Path(__file__).resolve().parent / "fixtures" / "report" / "catalogue.toml"
NEWER = SCHEMA + 1
PROBLEM = f"schema={NEWER} is not one this distconf reads ({', '.join(map(str, READS))})"


@pytest.fixture
def newer(tmp_path: Path) -> Path:
    """A finished run of one passing test, written by a distconf of a newer schema."""
    path = tmp_path / "results.jsonl"
    header = {"kind": "header", "schema": NEWER, "torch": "2.13.0+cpu", "started": "now"}
    writer = ResultsWriter(path, header)
    writer.write_start("t.py::a")
    record = TestRecord("t.py::a", "uneven.torch_chunk", "threads", 2, "cpu", "passed", 1.0)
    writer.write_test(record)
    writer.close(exitstatus=0)
    return path


def test_the_summary_and_junit_call_it_partial_and_say_why(newer, tmp_path, capsys):
    judged = session.summarise([newer])
    printed = capsys.readouterr().out
    assert f"warning: {newer}: {PROBLEM}: its records may mean otherwise" in printed
    assert f"verdict: partial: Records that may mean otherwise: {newer}: {PROBLEM}" in printed
    assert (judged.kind, judged.exit_code) == ("partial", 3)
    xml = tmp_path / "junit.xml"
    junit.add_verdict(xml, judged)
    suite = next(ElementTree.parse(xml).getroot().iter("testsuite"))
    assert {p.get("name"): p.get("value") for p in suite.iter("property")} == {
        "distconf_verdict": "partial"
    }


def test_the_report_calls_it_partial_and_warns(newer, tmp_path):
    html = render_report([newer], tmp_path / "report.html", catalogue_path=CATALOGUE)
    page = html.read_text(encoding="utf-8")
    assert '<section class="verdict partial"' in page
    assert "All conformant" not in page
    assert f"{newer}: {PROBLEM}: its records may mean otherwise" in page


def test_expectations_check_refuses_it(newer, capsys):
    assert cli.main(["expectations", "check", str(newer)]) == cli.USAGE_ERROR
    error = capsys.readouterr().err
    assert f"must be results this distconf reads: {str(newer)!r}: {PROBLEM}" in error


def test_junit_is_written_whole_or_left_as_pytest_wrote_it(newer, tmp_path, monkeypatch):
    # a run killed or out of disk while adding its verdict must not leave XML a CI cannot parse
    from harness.outcome import outputs

    xml = tmp_path / "junit.xml"
    written = '<testsuites><testsuite name="pytest" tests="1" errors="0" /></testsuites>'
    xml.write_text(written, encoding="utf-8")

    def full_disk(source: object, target: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outputs.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        junit.add_verdict(xml, session.summarise([newer]))
    assert xml.read_text(encoding="utf-8") == written
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
