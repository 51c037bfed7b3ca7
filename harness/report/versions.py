"""The report's "Versions" section: which torch the run checked, and what it says about each
known deviation (``harness.outcome.triage``): new failures, changed behaviour, deviations fixed,
deviations still present (verified on this torch or not)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from harness.outcome import triage
from harness.report.records import Loaded, Record


@dataclass(frozen=True)
class Line:
    category: str
    title: str
    spec: str
    text: str
    tests: int
    unexpected: bool


@dataclass(frozen=True)
class Versions:
    torch: tuple[str, ...]
    lines: tuple[Line, ...]
    counts: tuple[tuple[str, int], ...]
    """Tests per category, worst first."""


def _seen(record: Record) -> triage.Seen:
    expected = record.expectation
    return triage.Seen(
        category=record.category,
        spec=record.spec or "(no spec)",
        nodeid=record.nodeid,
        expectation=expected.source if expected else None,
        verified=expected.verified if expected else (),
    )


def versions(loaded: Loaded, records: Sequence[Record]) -> Versions:
    torch = tuple(triage.releases(f.header for f in loaded.files))
    shown = ", ".join(torch) or "this torch"
    found = triage.findings(map(_seen, records))
    lines = tuple(
        Line(
            category=f.category,
            title=triage.TITLES[f.category],
            spec=f.spec,
            text=triage.meaning(f, shown),
            tests=len(f.tests),
            unexpected=f.category in triage.UNEXPECTED,
        )
        for f in found
    )
    tally = triage.counts_of(r.category for r in records)
    return Versions(torch, lines, tuple(tally.items()))
