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
                      the tests it was running are named, and why it was killed. Or its session
                      did not run to its end: pytest's exit status is none of those of a
                      session that did (``RAN_TO_ITS_END``: OK, TESTS_FAILED,
                      NO_TESTS_COLLECTED), as after an INTERNALERROR or a usage error
``partial``        3  a results file has no header or a schema this distconf does not read
                      (``harness.outcome.results.READS``): its records may mean otherwise
``fail``           1  a test failed where no deviation is known (``harness.outcome.triage``: new)
``changed``        6  a spec with a known deviation failed otherwise than the deviation does
``fixed``          7  a known deviation did not happen: its expectation must be updated
``partial``        3  a test started and recorded no outcome, some lines of a results file
                      could not be read, or pytest ended with failed tests (exit status 1)
                      that no record holds
``unverified``     8  known deviations held, on a torch they were not verified on
                      (``harness expectations update RESULTS --verified``, after review)
``empty``          5  nothing was checked: no test recorded an outcome, or every test skipped
``pass``           0  all conformant, or known deviations verified on this torch
==============  ====  ========================================================================

``of_results`` is the one function that reads a run so: the summary of ``harness run``, its
report and JUnit XML, ``mutate``'s clean and fault runs and ``bench`` all take its verdict.
Besides the kind, it says what was caught: each test whose outcome is unexpected
(``is_unexpected``: a ``harness.outcome.triage`` category of new, different or fixed; a flaky
deviation that did not show is none), and each test that started and recorded no outcome.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.outcome import fatal, triage
from harness.outcome.results import SEVERITY, STATUSES, TITLES, Results

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
"""A test's status and its ``harness.outcome.triage`` category."""
INTERRUPTED_EXIT_STATUS = 2
"""pytest's ``ExitCode.INTERRUPTED``, as the end record keeps it."""
PYTEST_EXIT_STATUSES = {
    0: "OK",
    1: "TESTS_FAILED",
    2: "INTERRUPTED",
    3: "INTERNAL_ERROR",
    4: "USAGE_ERROR",
    5: "NO_TESTS_COLLECTED",
}
"""pytest's ``ExitCode`` names."""
RAN_TO_ITS_END = (0, 1, 5)
"""The exit statuses of a session that ran to its end (its records say the rest): OK,
TESTS_FAILED, NO_TESTS_COLLECTED. Any other (an INTERNALERROR, a usage error once the
session started, a status pytest does not have) ended it early; INTERRUPTED is its own kind."""
_ENDED_HOW = {
    3: "pytest stopped with an internal error",
    4: "pytest stopped with a usage error",
}


@dataclass(frozen=True)
class FileState:
    """What a results file says about how its session ended."""

    path: str
    end: Mapping[str, Any] | None
    unfinished: tuple[str, ...]
    bad_lines: int
    schema_problem: str | None = None
    """``Results.schema_problem``: why its records may mean otherwise."""
    killed: tuple[dict[str, Any], ...] = ()
    """``harness run`` killed the session: its test ran past the timeout (``killed``)."""
    fatal: str | None = None
    """What the fault handler wrote as the session's process died (``fatal.summary``)."""

    @classmethod
    def of(cls, path: str, results: Results) -> FileState:
        return cls(
            path,
            results.end,
            tuple(results.unfinished),
            len(results.bad_lines),
            results.schema_problem,
            tuple(results.killed),
            fatal.summary(Path(path)) if results.end is None else None,
        )

    @property
    def interrupted(self) -> bool:
        return self.end is not None and (
            self.end.get("exitstatus") == INTERRUPTED_EXIT_STATUS
            or bool(self.end.get("interrupted"))
        )

    @property
    def cut_short(self) -> str | None:
        """How a session that wrote its end record still did not run to its end (its exit
        status), or None: it ran to its end, was interrupted, or wrote no end record."""
        if self.end is None or self.interrupted:
            return None
        status = self.end.get("exitstatus")
        if type(status) is int and status in RAN_TO_ITS_END:
            return None
        if type(status) is not int:
            return f"its end record holds no pytest exit status ({status!r})"
        name = PYTEST_EXIT_STATUSES.get(status, "not one of pytest's")
        how = _ENDED_HOW.get(status, "pytest ended the session")
        return f"{how} (exit status {status}, {name})"


@dataclass(frozen=True)
class RunVerdict:
    kind: str
    headline: str
    details: tuple[str, ...]
    caught: tuple[Mapping[str, Any], ...] = ()
    """What the run caught, in the order its files hold them: each test record whose outcome
    is unexpected, then (as a ``crashed`` record of its node ID) each test that started and
    recorded no outcome. Empty for a clean run."""

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.kind]

    @property
    def text(self) -> str:
        return " · ".join((self.headline, *self.details))

    @property
    def clean(self) -> bool:
        """Green: it finished, checked something and found nothing to look at."""
        return self.kind == "pass"

    @property
    def finished(self) -> bool:
        """Every session of the run ran to its end, and its files were read whole."""
        return self.kind not in ("interrupted", "crashed", "partial")


def outcome(record: Mapping[str, Any]) -> Outcome:
    """A test record's status (one distconf does not write counts as an ``error``) and its
    ``harness.outcome.triage`` category."""
    status = record.get("status")
    if status not in STATUSES:
        return "error", triage.category({**record, "status": "error"})
    return str(status), triage.category(record)


def is_unexpected(record: Mapping[str, Any]) -> bool:
    """Whether a test record is an unexpected outcome, one a person must look at: a failure,
    or a pass where a deviation was expected (except a flaky one, which may pass)."""
    return outcome(record)[1] in triage.UNEXPECTED


def of_results(files: Sequence[tuple[str, Results]]) -> RunVerdict:
    """The verdict on raw results files (path, contents), with what the run caught."""
    states = [FileState.of(path, results) for path, results in files]
    outcomes = [outcome(record) for _, results in files for record in results.tests]
    caught: list[Mapping[str, Any]] = []
    for path, results in files:
        caught += [record for record in results.tests if is_unexpected(record)]
        caught += [_no_outcome(nodeid, path) for nodeid in results.unfinished]
    judged = run_verdict(states, outcomes)
    return RunVerdict(judged.kind, judged.headline, judged.details, tuple(caught))


def _no_outcome(nodeid: str, path: str) -> dict[str, Any]:
    return {
        "kind": "test",
        "nodeid": nodeid,
        "status": "crashed",
        "error": f"started and recorded no outcome in {path}: the session ended while it ran",
    }


def run_verdict(files: Sequence[FileState], outcomes: Sequence[Outcome]) -> RunVerdict:
    """The verdict on a run: its files' states and each test's (status, triage category)."""
    details = tuple(_problems(outcomes) + _tally(outcomes))
    found = Counter(category for _, category in outcomes if category is not None)
    kind, headline = (
        _not_to_its_end(files)
        or _unexpected(found)
        or _incomplete(files)
        or _failures_unrecorded(files)
        or _settled(found, outcomes)
    )
    return RunVerdict(kind, headline, details)


def _not_to_its_end(files: Sequence[FileState]) -> tuple[str, str] | None:
    """Interrupted, crashed, or files whose records may mean otherwise: what their records
    say does not decide the verdict."""
    interrupted = [f for f in files if f.interrupted]
    if interrupted:
        why = "; ".join(
            dict.fromkeys(str(f.end.get("interrupted") or "") for f in interrupted if f.end)
        )
        return "interrupted", (
            f"Interrupted{f' ({why})' if why.strip('; ') else ''}: the run did not finish"
        )
    crashed = [f for f in files if f.end is None or f.cut_short]
    if crashed:
        return "crashed", _crash_headline(crashed)
    misread = [f"{f.path}: {f.schema_problem}" for f in files if f.schema_problem]
    if misread:
        return "partial", f"Records that may mean otherwise: {'; '.join(misread)}"
    return None


def _unexpected(found: Counter[str]) -> tuple[str, str] | None:
    bad = sum(found[c] for c in triage.UNEXPECTED)
    unexpected = f"{bad} unexpected outcome{'s' * (bad != 1)}"
    if found["new"]:
        return "fail", unexpected
    if found["different"]:
        return "changed", f"{unexpected}: {triage.TITLES['different']}"
    if found["fixed"]:
        return "fixed", f"{unexpected}: {triage.TITLES['fixed']}"
    return None


def _incomplete(files: Sequence[FileState]) -> tuple[str, str] | None:
    lost = [nodeid for f in files for nodeid in f.unfinished]
    if lost:
        return "partial", f"{len(lost)} test(s) started and recorded no outcome: {', '.join(lost)}"
    unreadable = sum(f.bad_lines for f in files)
    if unreadable:
        return "partial", (
            f"No unexpected outcomes, but {unreadable} record line(s) could not be read"
        )
    return None


def _failures_unrecorded(files: Sequence[FileState]) -> tuple[str, str] | None:
    """pytest counted a failure that no record holds (no record was unexpected): what failed
    is not in the records, so they cannot say the run was green."""
    failed = [f.path for f in files if f.end is not None and f.end.get("exitstatus") == 1]
    if not failed:
        return None
    return "partial", (
        f"pytest ended with failed tests (exit status 1, TESTS_FAILED) in {', '.join(failed)}, "
        "but no test record holds a failure"
    )


def _settled(found: Counter[str], outcomes: Sequence[Outcome]) -> tuple[str, str]:
    if found["unverified"]:
        return "unverified", (
            f"{found['unverified']} test(s) failed as known deviations do, on a torch those "
            "deviations were not verified on: review, then `harness expectations update "
            "RESULTS --verified`"
        )
    checked = sum(status != "skipped" for status, _ in outcomes)
    if not checked:
        what = f"all {len(outcomes)} tests skipped" if outcomes else "no test recorded an outcome"
        return "empty", f"Nothing was checked: {what}"
    return "pass", "All conformant"


def _crash_headline(crashed: Sequence[FileState]) -> str:
    running = [nodeid for f in crashed for nodeid in f.unfinished]
    died = [f.path for f in crashed if f.end is None]
    why = [f"no end record in {', '.join(died)}"] if died else []
    why += [f"{f.cut_short} in {f.path}" for f in crashed if f.cut_short]
    kills = "".join(f": {describe_kill(k)}" for f in crashed for k in f.killed)
    kills += "".join(f": {f.fatal}" for f in crashed if f.fatal)
    if running:
        return f"Crashed while running {', '.join(running)} ({'; '.join(why)}){kills}"
    after = "the session died between tests" if died else "the run did not finish"
    return f"Crashed: {'; '.join(why)}; {after}{kills}"


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
