"""harness.verdict: one reading of a run's files, the first kind that applies winning."""

from __future__ import annotations

import pytest

from harness.verdict import FileState, run_verdict

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
