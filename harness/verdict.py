"""The verdict on a run: the one reading of its results files that the summary, the HTML
report, the exit code of ``python -m harness run`` and its JUnit XML all give.

A run is green only when it finished, checked something and found nothing unexpected. The
kinds, the first that applies wins:

==============  ====  ========================================================================
kind            exit  when
==============  ====  ========================================================================
``interrupted``    2  a session ended by an interrupt (Ctrl-C, SIGINT, a collection error)
``crashed``        3  a results file has no end record: its process died (``os._exit``, a
                      signal, memory, or ``harness run`` killed it past a test's timeout);
                      the tests it was running are named, and why it was killed
``fail``           1  a test failed where no deviation is known (``harness.triage``: new)
``changed``        6  a spec with a known deviation failed otherwise than the deviation does
``fixed``          7  a known deviation did not happen: its expectation must be updated
``partial``        3  a test started and recorded no outcome, or some lines of a results
                      file could not be read
``unverified``     8  known deviations held, on a torch they were not verified on
                      (``harness expectations update RESULTS --verified``, after review)
``empty``          5  nothing was checked: no test recorded an outcome, or every test skipped
``pass``           0  all conformant, or known deviations verified on this torch
==============  ====  ========================================================================
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harness import triage
from harness.results import SEVERITY, TITLES, Results

EXIT_CODES = {
    "pass": 0,
    "fail": 1,
    "interrupted": 2,
    "crashed": 3,
    "partial": 3,
    "empty": 5,
    "changed": 6,
    "fixed": 7,
    "unverified": 8,
}
Outcome = tuple[str, str | None]
"""A test's status and its ``harness.triage`` category."""
INTERRUPTED_EXIT_STATUS = 2
"""pytest's ``ExitCode.INTERRUPTED``, as the end record keeps it."""


@dataclass(frozen=True)
class FileState:
    """What a results file says about how its session ended."""

    path: str
    end: dict[str, Any] | None
    unfinished: tuple[str, ...]
    bad_lines: int
    killed: tuple[dict[str, Any], ...] = ()
    """``harness run`` killed the session: its test ran past the timeout (``killed``)."""

    @classmethod
    def of(cls, path: str, results: Results) -> FileState:
        return cls(
            path,
            results.end,
            tuple(results.unfinished),
            len(results.bad_lines),
            tuple(results.killed),
        )

    @property
    def interrupted(self) -> bool:
        return self.end is not None and (
            self.end.get("exitstatus") == INTERRUPTED_EXIT_STATUS
            or bool(self.end.get("interrupted"))
        )


@dataclass(frozen=True)
class RunVerdict:
    kind: str
    headline: str
    details: tuple[str, ...]

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.kind]

    @property
    def text(self) -> str:
        return " · ".join((self.headline, *self.details))


def of_results(files: Sequence[tuple[str, Results]]) -> RunVerdict:
    """The verdict on raw results files (path, contents)."""
    states = [FileState.of(path, results) for path, results in files]
    outcomes = [
        (str(record.get("status")), triage.category(record))
        for _, results in files
        for record in results.tests
    ]
    return run_verdict(states, outcomes)


def run_verdict(files: Sequence[FileState], outcomes: Sequence[Outcome]) -> RunVerdict:
    """The verdict on a run: its files' states and each test's (status, triage category)."""
    details = tuple(_problems(outcomes) + _tally(outcomes))
    interrupted = [f for f in files if f.interrupted]
    if interrupted:
        why = "; ".join(
            dict.fromkeys(str(f.end.get("interrupted") or "") for f in interrupted if f.end)
        )
        headline = f"Interrupted{f' ({why})' if why.strip('; ') else ''}: the run did not finish"
        return RunVerdict("interrupted", headline, details)
    crashed = [f for f in files if f.end is None]
    if crashed:
        return RunVerdict("crashed", _crash_headline(crashed), details)
    found = Counter(category for _, category in outcomes if category is not None)
    bad = sum(found[c] for c in triage.UNEXPECTED)
    unexpected = f"{bad} unexpected outcome{'s' * (bad != 1)}"
    if found["new"]:
        return RunVerdict("fail", unexpected, details)
    if found["different"]:
        return RunVerdict("changed", f"{unexpected}: {triage.TITLES['different']}", details)
    if found["fixed"]:
        return RunVerdict("fixed", f"{unexpected}: {triage.TITLES['fixed']}", details)
    lost = [nodeid for f in files for nodeid in f.unfinished]
    if lost:
        headline = f"{len(lost)} test(s) started and recorded no outcome: {', '.join(lost)}"
        return RunVerdict("partial", headline, details)
    unreadable = sum(f.bad_lines for f in files)
    if unreadable:
        headline = f"No unexpected outcomes, but {unreadable} record line(s) could not be read"
        return RunVerdict("partial", headline, details)
    if found["unverified"]:
        headline = (
            f"{found['unverified']} test(s) failed as known deviations do, on a torch those "
            "deviations were not verified on: review, then `harness expectations update "
            "RESULTS --verified`"
        )
        return RunVerdict("unverified", headline, details)
    checked = sum(status != "skipped" for status, _ in outcomes)
    if not checked:
        what = f"all {len(outcomes)} tests skipped" if outcomes else "no test recorded an outcome"
        return RunVerdict("empty", f"Nothing was checked: {what}", details)
    return RunVerdict("pass", "All conformant", details)


def _crash_headline(crashed: Sequence[FileState]) -> str:
    running = [nodeid for f in crashed for nodeid in f.unfinished]
    files = ", ".join(f.path for f in crashed)
    kills = "".join(f": {describe_kill(k)}" for f in crashed for k in f.killed)
    if running:
        return f"Crashed while running {', '.join(running)} (no end record in {files}){kills}"
    return f"Crashed: no end record in {files}; the session died between tests{kills}"


def describe_kill(killed: dict[str, Any]) -> str:
    """What a ``killed`` record says happened."""
    return (
        f"harness run killed its processes {_seconds(killed.get('seconds'))} s into "
        f"{killed.get('nodeid')}, past --test-timeout={_seconds(killed.get('test_timeout'))} s "
        f"and {_seconds(killed.get('grace'))} s of grace (pytest-timeout could not end the test: "
        "stuck where no Python code runs, such as C code holding the GIL, or a deadlock)"
    )


def _seconds(value: Any) -> str:
    return f"{value:g}" if isinstance(value, int | float) else "?"


def _problems(outcomes: Sequence[Outcome]) -> list[str]:
    bad = Counter(status for status, category in outcomes if category in triage.UNEXPECTED)
    ordered = sorted(bad.items(), key=lambda item: _severity(item[0]))
    return (
        [", ".join(f"{count} {TITLES.get(status, status)}" for status, count in ordered)]
        if bad
        else []
    )


def _tally(outcomes: Sequence[Outcome]) -> list[str]:
    ran = sum(status != "skipped" for status, _ in outcomes)
    found = Counter(category for _, category in outcomes)
    held = found["known"] + found["unverified"]
    unverified = (
        f" ({found['unverified']} not verified on this torch)" if found["unverified"] else ""
    )
    return [f"{len(outcomes)} tests, {ran} ran, {held} known deviations held{unverified}"]


def _severity(status: str) -> int:
    return SEVERITY.index(status) if status in SEVERITY else -1
