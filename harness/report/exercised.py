"""The report's "Exercised" section: per spec whose tests count what their examples reached
(``parity.exercise``: a program's ops and the placements each met), the labels and counts
over every World of the run, so a reader sees which transitions a green run checked."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from harness.report.records import Record

SHOWN = 40
"""Labels listed per spec, most exercised first (the rest are counted, not listed)."""


@dataclass(frozen=True)
class SpecExercised:
    spec: str
    rows: tuple[tuple[str, int], ...]
    labels: int
    """Distinct labels in all: ``rows`` lists the ``SHOWN`` most exercised."""
    examples: int


def exercised(records: Sequence[Record]) -> tuple[SpecExercised, ...]:
    counts: dict[str, Counter[str]] = {}
    examples: Counter[str] = Counter()
    for record in records:
        if not record.exercised:
            continue
        spec = record.spec or "(no spec)"
        counts.setdefault(spec, Counter()).update(dict(record.exercised))
        examples[spec] += record.examples or 0
    return tuple(
        SpecExercised(
            spec=spec,
            rows=tuple(tally.most_common(SHOWN)),
            labels=len(tally),
            examples=examples[spec],
        )
        for spec, tally in sorted(counts.items())
    )
