"""Shape test records into what the report shows: plain dataclasses, no HTML.

``build`` turns one run's records (and the catalogue) into a ``Report``; the templates only
lay it out. Statuses keep the names of ``harness.outcome.results``; ``TITLES`` gives their words.
"""

from __future__ import annotations

import re
import shlex
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from harness.catalogue import Spec
from harness.outcome.results import (
    SEVERITY as SEVERITY,  # re-exported: the report's order of statuses
)
from harness.outcome.results import TITLES as TITLES  # re-exported: the words of each status
from harness.report.exercised import SpecExercised, exercised
from harness.report.records import Expectation, Loaded, Metric, Record, SourceFile, text
from harness.report.versions import Versions, versions

LABELS = {
    "passed": "pass",
    "failed": "FAIL",
    "xfailed": "xfail",
    "xpassed": "XPASS",
    "skipped": "skip",
    "error": "ERROR",
    "timeout": "TIMEOUT",
    "crashed": "CRASH",
}
CARD_STATUSES = ("crashed", "timeout", "error", "failed", "xpassed")
_STACKS = "Python stack of every rank at the deadline:"
_NO_SPEC = "(no spec)"
_UNKNOWN = {True: "tests without a spec mark", False: "not in the catalogue"}
_LIBRARIES = ("site-packages", "/lib/python3", "/harness/runners/", "<frozen ")
_STACK_HEAD = re.compile(r"^--- (rank \d+ \([^)\n]*\)) ---$", re.MULTILINE)


@dataclass(frozen=True)
class Fact:
    """One line of the environment table; several files may disagree (``values``)."""

    label: str
    values: tuple[str, ...]

    @property
    def shown(self) -> str:
        return ", ".join(self.values) if self.values else "—"


@dataclass(frozen=True)
class StatusCount:
    status: str
    title: str
    count: int
    unexpected: bool


@dataclass(frozen=True)
class Verdict:
    kind: str
    """A ``harness.outcome.verdict`` kind (``EXIT_CODES`` lists them)."""
    headline: str
    detail: str


@dataclass(frozen=True)
class SkipReason:
    reason: str
    count: int
    specs: tuple[str, ...]


@dataclass(frozen=True)
class Column:
    runner: str
    world_size: int | None
    device: str

    @property
    def ws(self) -> str:
        return f"ws{'?' if self.world_size is None else self.world_size}"

    @property
    def label(self) -> str:
        return f"{self.runner} · {self.device} · {self.ws}"


@dataclass(frozen=True)
class ColumnGroup:
    title: str
    span: int


@dataclass(frozen=True)
class Cell:
    status: str
    """A test status, ``missing`` (an active spec with no record) or ``planned``."""
    label: str
    count: int
    tooltip: str
    unexpected: bool
    link: str | None


@dataclass(frozen=True)
class Row:
    spec: str
    statement: str
    provenance: str
    planned: bool
    ran: bool
    cells: tuple[Cell, ...]


@dataclass(frozen=True)
class Area:
    name: str
    rows: tuple[Row, ...]

    @property
    def ran(self) -> int:
        return sum(row.ran for row in self.rows)


@dataclass(frozen=True)
class Matrix:
    groups: tuple[ColumnGroup, ...]
    columns: tuple[Column, ...]
    areas: tuple[Area, ...]
    uncatalogued: tuple[Row, ...]


@dataclass(frozen=True)
class Stack:
    title: str
    text: str

    @property
    def where(self) -> str:
        """The innermost frame of the rank's own code (else the innermost frame at all)."""
        lines = [line.strip() for line in self.text.splitlines() if line.strip()]
        frames = [i for i, line in enumerate(lines) if line.startswith("File ")]
        own = [i for i in frames if not any(lib in lines[i] for lib in _LIBRARIES)]
        chosen = (own or frames or [len(lines) - 1])[-1]
        return " · ".join(lines[chosen : chosen + 2]) if lines else ""


@dataclass(frozen=True)
class RankState:
    rank: int
    status: str
    primary: bool


@dataclass(frozen=True)
class Card:
    """One failure, unexpected pass or expected failure, with all that explains it."""

    anchor: str
    status: str
    title: str
    nodeid: str
    spec: str | None
    column: str
    source: str
    duration: float | None
    examples: int | None
    falsifying_example: str | None
    primary_rank: int | None
    ranks: tuple[RankState, ...]
    error: str | None
    stacks: tuple[Stack, ...]
    traceback: str | None
    reproduce: str | None
    metrics: tuple[Metric, ...]
    expectation: Expectation | None
    reason: str | None


@dataclass(frozen=True)
class Report:
    generated: str
    files: tuple[SourceFile, ...]
    warnings: tuple[str, ...]
    verdict: Verdict
    counts: tuple[StatusCount, ...]
    total: int
    skip_reasons: tuple[SkipReason, ...]
    facts: tuple[Fact, ...]
    matrix: Matrix
    coverage: str
    failures: tuple[Card, ...]
    expected: tuple[Card, ...]
    versions: Versions
    anchors: Mapping[int, str]
    """The anchor of each record's card, by ``id(record)``: links from the matrix and diff."""
    exercised: tuple[SpecExercised, ...] = ()


def worst(statuses: Iterable[str]) -> str:
    return min(statuses, key=SEVERITY.index)


def column_of(record: Record) -> Column:
    return Column(record.runner, record.world_size, record.device)


def _column_key(column: Column) -> tuple[str, str, int]:
    return (column.runner, column.device, column.world_size or 0)


def _distinct(values: Iterable[Any]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(t for v in values if (t := _fact_text(v)) is not None))


def _fact_text(value: Any) -> str | None:
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return text(value)


def _seconds(value: Any) -> str | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:.1f} s"
    return None


def facts(loaded: Loaded) -> tuple[Fact, ...]:
    """The environment: versions and settings from the headers, what ran from the records."""
    headers = [f.header for f in loaded.files if f.header is not None]
    ends = [f.end for f in loaded.files if f.end is not None]

    def header(*keys: str) -> tuple[str, ...]:
        return _distinct(h.get(key) for h in headers for key in keys)

    argv = [h.get("argv") for h in headers]
    commands = [shlex.join(map(str, a)) for a in argv if isinstance(a, list)]
    records = loaded.records
    return (
        Fact("torch", header("torch")),
        Fact("accelerator", header("accelerator")),
        Fact("CUDA", header("cuda")),
        Fact("NCCL", header("nccl")),
        Fact("hypothesis", header("hypothesis")),
        Fact("python", header("python")),
        Fact("numpy", header("numpy")),
        Fact("platform", header("platform")),
        Fact("git SHA", header("git_sha")),
        Fact("profile", header("profile")),
        Fact("seed", header("seed")),
        Fact("runners", _distinct(r.runner for r in records)),
        Fact("devices", _distinct(r.device for r in records)),
        Fact("backend", header("backend")),
        Fact("backend plugins", header("backend_plugins")),
        Fact("world sizes", _distinct(sorted({r.world_size or 0 for r in records}))),
        Fact("started", header("started")),
        Fact("finished", _distinct(e.get("finished") for e in ends)),
        Fact("duration", _distinct(_seconds(e.get("duration")) for e in ends)),
        Fact("command", _distinct(commands)),
    )


def counts(records: Sequence[Record]) -> tuple[StatusCount, ...]:
    """Tests per status; a status is marked unexpected where one of its tests is (a flaky
    deviation's unexpected pass is not)."""
    tally = Counter(r.status for r in records)
    order = ("passed", "failed", "xfailed", "xpassed", "skipped", "error", "timeout", "crashed")
    unexpected = {r.status for r in records if r.unexpected}
    return tuple(StatusCount(s, TITLES[s], tally[s], s in unexpected) for s in order)


def verdict(loaded: Loaded, covered: str) -> Verdict:
    """``harness.outcome.verdict``'s reading of the run, with what the specs covered."""
    judged = loaded.verdict
    return Verdict(judged.kind, judged.headline, " · ".join((*judged.details, covered)))


def _by_severity(item: tuple[str, int]) -> int:
    return SEVERITY.index(item[0])


def skip_reasons(records: Sequence[Record]) -> tuple[SkipReason, ...]:
    grouped: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        if record.status == "skipped":
            grouped[record.skip_reason or "(no reason given)"].append(record)
    reasons = [
        SkipReason(reason, len(rs), tuple(dict.fromkeys(r.spec or "(no spec)" for r in rs)))
        for reason, rs in grouped.items()
    ]
    return tuple(sorted(reasons, key=lambda s: (-s.count, s.reason)))


def _cell(records: Sequence[Record], anchors: Mapping[int, str]) -> Cell:
    status = worst(r.status for r in records)
    tally = Counter(r.status for r in records)
    tooltip = ", ".join(f"{c} {TITLES[s]}" for s, c in sorted(tally.items(), key=_by_severity))
    link = next((anchors[id(r)] for r in records if id(r) in anchors), None)
    unexpected = any(r.unexpected for r in records if r.status == status)
    return Cell(status, LABELS[status], len(records), tooltip, unexpected, link)


def _gap(planned: bool, catalogued: bool) -> Cell:
    if not catalogued:
        return Cell("none", "", 0, "no test of this ID ran here", False, None)
    if planned:
        return Cell("planned", "planned", 0, "planned: not checked yet", False, None)
    return Cell("missing", "not run", 0, "no test of this spec ran here", False, None)


def _row(
    spec: Spec | None,
    spec_id: str,
    columns: Sequence[Column],
    records: Sequence[Record],
    anchors: Mapping[int, str],
) -> Row:
    by_column: dict[Column, list[Record]] = defaultdict(list)
    for record in records:
        by_column[column_of(record)].append(record)
    planned = spec is not None and spec.status == "planned"
    cells = tuple(
        _cell(by_column[c], anchors) if by_column.get(c) else _gap(planned, spec is not None)
        for c in columns
    )
    return Row(
        spec=spec_id,
        statement=spec.statement if spec else _UNKNOWN[spec_id == _NO_SPEC],
        provenance=spec.provenance if spec else "",
        planned=planned,
        ran=bool(records),
        cells=cells,
    )


def matrix(
    records: Sequence[Record], specs: Mapping[str, Spec], anchors: Mapping[int, str]
) -> Matrix:
    """Catalogue × (runner, device, world size); records of unknown specs apart."""
    columns = tuple(sorted({column_of(r) for r in records}, key=_column_key))
    groups: list[ColumnGroup] = []
    for column in columns:
        title = f"{column.runner} · {column.device}"
        if groups and groups[-1].title == title:
            groups[-1] = ColumnGroup(title, groups[-1].span + 1)
        else:
            groups.append(ColumnGroup(title, 1))
    by_spec: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        by_spec[record.spec or _NO_SPEC].append(record)
    areas: dict[str, list[Row]] = defaultdict(list)
    for spec in specs.values():
        areas[spec.area].append(_row(spec, spec.id, columns, by_spec.get(spec.id, []), anchors))
    unknown = tuple(
        _row(None, spec_id, columns, rs, anchors)
        for spec_id, rs in sorted(by_spec.items())
        if spec_id not in specs
    )
    return Matrix(
        groups=tuple(groups),
        columns=columns,
        areas=tuple(Area(name, tuple(rows)) for name, rows in areas.items()),
        uncatalogued=unknown,
    )


def coverage(matrix: Matrix) -> str:
    rows = [row for area in matrix.areas for row in area.rows]
    active = [row for row in rows if not row.planned]
    ran = sum(row.ran for row in active)
    planned = len(rows) - len(active)
    text = f"{ran} of {len(active)} active specs ran"
    if planned:
        text += f"; {planned} planned"
    if matrix.uncatalogued:
        text += f"; {len(matrix.uncatalogued)} spec IDs outside the catalogue"
    return text


def split_stacks(error: str | None) -> tuple[str | None, tuple[Stack, ...]]:
    """A ``RankFailure`` text on a deadline: its head, and the stack of every rank."""
    if error is None or _STACKS not in error:
        return error, ()
    head, _, rest = error.partition(_STACKS)
    parts = _STACK_HEAD.split(rest)
    stacks = tuple(Stack(parts[i], parts[i + 1].strip("\n")) for i in range(1, len(parts) - 1, 2))
    return head.rstrip("\n"), stacks


def card(record: Record, anchor: str) -> Card:
    error, stacks = split_stacks(record.error)
    ranks = tuple(
        RankState(rank, status, rank == record.primary_rank)
        for rank, status in record.rank_statuses
    )
    return Card(
        anchor=anchor,
        status=record.status,
        title=TITLES[record.status],
        nodeid=record.nodeid,
        spec=record.spec,
        column=column_of(record).label,
        source=record.source,
        duration=record.duration,
        examples=record.examples,
        falsifying_example=record.falsifying_example,
        primary_rank=record.primary_rank,
        ranks=ranks,
        error=error,
        stacks=stacks,
        traceback=record.traceback,
        reproduce=record.reproduce,
        metrics=record.metrics,
        expectation=record.expectation,
        reason=record.skip_reason,
    )


def _cards(records: Sequence[Record]) -> tuple[dict[int, str], list[Card], list[Card]]:
    """Failure cards (worst first) and expected-failure cards, with each record's anchor."""
    anchors: dict[int, str] = {}
    failures: list[Card] = []
    expected: list[Card] = []
    shown = [r for r in records if r.status in CARD_STATUSES or r.status == "xfailed"]
    ordered = sorted(shown, key=lambda r: (not r.unexpected, SEVERITY.index(r.status)))
    for number, record in enumerate(ordered, start=1):
        anchor = f"failure-{number}" if record.unexpected else f"expected-{number}"
        anchors[id(record)] = anchor
        (failures if record.unexpected else expected).append(card(record, anchor))
    return anchors, failures, expected


def build(loaded: Loaded, specs: Mapping[str, Spec]) -> Report:
    """The report of one run (one or more results files)."""
    records = loaded.records
    anchors, failures, expected = _cards(records)
    grid = matrix(records, specs, anchors)
    return Report(
        generated=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        files=loaded.files,
        warnings=loaded.warnings,
        verdict=verdict(loaded, coverage(grid)),
        counts=counts(records),
        total=len(records),
        skip_reasons=skip_reasons(records),
        facts=facts(loaded),
        matrix=grid,
        coverage=coverage(grid),
        failures=tuple(failures),
        expected=tuple(expected),
        versions=versions(loaded, records),
        anchors=anchors,
        exercised=exercised(records),
    )
