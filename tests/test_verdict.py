"""harness.outcome.verdict: one reading of a run's files, the first kind that applies winning."""

from __future__ import annotations

import pytest

from harness.outcome.results import ResultsWriter, TestRecord, read_results
from harness.outcome.verdict import (
    EXIT_CODES,
    FileState,
    is_unexpected,
    of_results,
    outcome,
    run_verdict,
)

ENDED = {"exitstatus": 0}
PASS = [("passed", None)]


def _file(end=ENDED, unfinished=(), bad_lines=0, path="r.jsonl"):
    return FileState(path, end, tuple(unfinished), bad_lines)


@pytest.mark.parametrize(
    ("files", "outcomes", "kind", "exit_code", "headline"),
    [
        ([_file()], PASS, "pass", 0, "All conformant"),
        ([_file()], [("failed", "new"), *PASS], "fail", 1, "1 unexpected outcome"),
        (
            [_file({"exitstatus": 2, "interrupted": "KeyboardInterrupt"}), _file(None)],
            [("failed", "new")],
            "interrupted",
            2,
            "Interrupted (KeyboardInterrupt)",
        ),
        (
            [_file(None, ["t.py::a"])],
            [("failed", "new")],
            "crashed",
            3,
            "Crashed while running t.py::a",
        ),
        ([_file(None)], PASS, "crashed", 3, "Crashed: no end record in r.jsonl"),
        ([_file(unfinished=["t.py::b"])], PASS, "partial", 3, "started and recorded no outcome"),
        ([_file(bad_lines=2)], PASS, "partial", 3, "2 record line(s) could not be read"),
        ([_file()], [("skipped", None)] * 3, "empty", 5, "all 3 tests skipped"),
        ([_file()], [], "empty", 5, "no test recorded an outcome"),
        ([_file()], [("xfailed", "known")], "pass", 0, "All conformant"),
        (
            [_file()],
            [("failed", "different"), ("xpassed", "fixed"), ("xfailed", "unverified")],
            "changed",
            6,
            "a different failure in a spec with a known deviation",
        ),
        (
            [_file()],
            [("xpassed", "fixed"), ("xfailed", "unverified")],
            "fixed",
            7,
            "an expected failure passed",
        ),
        (
            [_file()],
            [("xfailed", "unverified"), ("xfailed", "known"), *PASS],
            "unverified",
            8,
            "1 test(s) failed as known deviations do, on a torch those deviations were not",
        ),
        (
            [_file(unfinished=["t.py::b"])],
            [("xfailed", "unverified")],
            "partial",
            3,
            "started and recorded no outcome",
        ),
        ([_file()], [("failed", "new"), ("failed", "different")], "fail", 1, "2 unexpected"),
    ],
)
def test_the_first_kind_that_applies_wins(files, outcomes, kind, exit_code, headline):
    verdict = run_verdict(files, outcomes)
    assert (verdict.kind, verdict.exit_code) == (kind, exit_code)
    assert headline in verdict.headline


def test_the_details_count_what_ran_and_name_the_unexpected():
    verdict = run_verdict([_file()], [("crashed", "new"), ("failed", "new"), ("skipped", None)])
    assert verdict.details == (
        "1 crashed, 1 failed",
        "3 tests, 2 ran, 0 known deviations held",
    )


def test_the_details_say_how_many_deviations_are_not_verified_here():
    verdict = run_verdict([_file()], [("xfailed", "known"), ("xfailed", "unverified")])
    assert verdict.details == (
        "2 tests, 2 ran, 2 known deviations held (1 not verified on this torch)",
    )


@pytest.mark.parametrize(
    ("end", "kind", "headline"),
    [
        ({"exitstatus": 0}, "pass", "All conformant"),
        (
            {"exitstatus": 1},
            "partial",
            "pytest ended with failed tests (exit status 1, TESTS_FAILED) in r.jsonl, but no test "
            "record holds a failure",
        ),
        ({"exitstatus": 5}, "pass", "All conformant"),
        ({"exitstatus": 2}, "interrupted", "Interrupted: the run did not finish"),
        (
            {"exitstatus": 3},
            "crashed",
            "Crashed: pytest stopped with an internal error (exit status 3, INTERNAL_ERROR) in "
            "r.jsonl; the run did not finish",
        ),
        (
            {"exitstatus": 4},
            "crashed",
            "Crashed: pytest stopped with a usage error (exit status 4, USAGE_ERROR) in r.jsonl",
        ),
        ({"exitstatus": 70}, "crashed", "(exit status 70, not one of pytest's)"),
        ({"exitstatus": True}, "crashed", "its end record holds no pytest exit status (True)"),
        ({}, "crashed", "its end record holds no pytest exit status (None)"),
    ],
)
def test_a_session_that_did_not_run_to_its_end_is_never_green(end, kind, headline):
    """pytest's exit statuses: OK, TESTS_FAILED and NO_TESTS_COLLECTED end a session that ran
    to its end, and its records decide; INTERRUPTED is an interrupt; any other status (an
    INTERNALERROR after the first test, say) cut the run short, whatever was recorded."""
    verdict = run_verdict([_file(end)], PASS)
    assert (verdict.kind, verdict.exit_code) == (kind, EXIT_CODES[kind])
    assert headline in verdict.headline


def test_a_cut_short_session_names_the_test_it_was_running():
    verdict = run_verdict([_file({"exitstatus": 3}, ["t.py::b"]), _file()], PASS)
    assert verdict.kind == "crashed"
    assert verdict.headline == (
        "Crashed while running t.py::b (pytest stopped with an internal error (exit status 3, "
        "INTERNAL_ERROR) in r.jsonl)"
    )


def test_records_of_a_schema_this_distconf_does_not_read_are_never_green():
    misread = FileState("r.jsonl", ENDED, (), 0, "schema=3 is not one this distconf reads (1, 2)")
    verdict = run_verdict([misread, _file(path="s.jsonl")], PASS)
    assert (verdict.kind, verdict.exit_code) == ("partial", 3)
    assert verdict.headline == (
        "Records that may mean otherwise: r.jsonl: schema=3 is not one this distconf reads (1, 2)"
    )
    assert run_verdict([misread], [("failed", "new")]).kind == "partial"
    assert run_verdict([misread, _file(None)], PASS).kind == "crashed"


def _results(path, records, *, schema=2, end=ENDED, started=()):
    writer = ResultsWriter(path, {"kind": "header", "schema": schema, "torch": "2.13.0"})
    for nodeid in started:
        writer.write_start(nodeid)
    for record in records:
        writer.write_test(record)
    if end is not None:
        writer.close(**end)
    return read_results(path)


def _test(nodeid, status, expectation=None):
    return TestRecord(nodeid, "s.x", "threads", 2, "cpu", status, 1.0, expectation=expectation)


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        (1, None),
        (2, None),
        (3, None),
        (4, None),
        (5, "schema=5 is not one this distconf reads (1, 2, 3, 4)"),
        ("2", "schema='2' is not one this distconf reads (1, 2, 3, 4)"),
        (None, "schema=None is not one this distconf reads (1, 2, 3, 4)"),
    ],
)
def test_read_results_marks_a_schema_it_does_not_read(tmp_path, schema, problem):
    results = _results(tmp_path / "r.jsonl", [_test("t::a", "passed")], schema=schema)
    assert results.schema_problem == problem
    assert results.tests and results.tests[0]["status"] == "passed"  # read all the same
    judged = of_results([("r.jsonl", results)])
    assert judged.kind == ("pass" if problem is None else "partial")


def test_a_file_without_a_header_has_no_known_schema(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"kind": "test", "nodeid": "t::a", "status": "passed"}\n{"kind": "end", '
                    '"exitstatus": 0}\n')  # fmt: skip
    results = read_results(path)
    assert results.schema_problem == "no header record, so its schema is unknown"
    assert of_results([(str(path), results)]).kind == "partial"


FLAKY = {"status": "flaky", "source": "t.toml #1"}
XFAIL = {"status": "xfail", "source": "t.toml #2", "verified_here": True}


def test_what_a_run_caught_is_what_its_verdict_calls_unexpected(tmp_path):
    """A flaky deviation that did not show is no catch; a failure, an unexpected pass of a
    strict deviation or of a test without one, and a test that recorded no outcome are."""
    first = _results(
        tmp_path / "results.gw0.jsonl",
        [
            _test("t::flaky", "xpassed", FLAKY),
            _test("t::known", "xfailed", XFAIL),
            _test("t::fails", "failed"),
            _test("t::fixed", "xpassed", XFAIL),
            _test("t::passes", "passed"),
        ],
    )
    second = _results(
        tmp_path / "results.gw1.jsonl",
        [_test("t::new_pass", "xpassed")],
        end=None,
        started=["t::new_pass", "t::dies"],
    )
    judged = of_results([("gw0", first), ("gw1", second)])
    assert [(r["nodeid"], r["status"]) for r in judged.caught] == [
        ("t::fails", "failed"),
        ("t::fixed", "xpassed"),
        ("t::new_pass", "xpassed"),
        ("t::dies", "crashed"),
    ]
    assert judged.caught[0] is first.tests[2]  # the record itself, as written
    assert "started and recorded no outcome in gw1" in judged.caught[-1]["error"]
    assert judged.kind == "crashed" and not judged.clean and not judged.finished


def test_a_run_that_checked_nothing_caught_nothing_and_is_not_clean():
    judged = of_results([])
    assert judged.kind == "empty" and not judged.clean and judged.finished and not judged.caught


@pytest.mark.parametrize(
    ("record", "status", "category", "unexpected"),
    [
        ({"status": "passed"}, "passed", None, False),
        ({"status": "xpassed", "expectation": FLAKY}, "xpassed", None, False),
        ({"status": "xpassed", "expectation": XFAIL}, "xpassed", "fixed", True),
        ({"status": "xpassed"}, "xpassed", "new", True),
        ({"status": "xfailed", "expectation": XFAIL}, "xfailed", "known", False),
        ({"status": "<b>green</b>"}, "error", "new", True),
        ({}, "error", "new", True),
        ({"status": "weird", "expectation": XFAIL}, "error", "different", True),
    ],
)
def test_a_records_outcome_counts_a_status_distconf_does_not_write_as_an_error(
    record, status, category, unexpected
):
    assert outcome(record) == (status, category)
    assert is_unexpected(record) is unexpected
