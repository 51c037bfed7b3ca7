"""Parity of distributed against reference values: per spec and comparison, the worst error
over every test, and the geometry of its chart (log-scale bars of ``max_rel`` with the
``rtol`` each comparison was held to). The template draws the SVG from these numbers."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from harness.report.model import column_of
from harness.report.records import Metric, Record

WIDTH = 1000
LABEL_X = 16
PLOT_X = 330
PLOT_W = 520
VALUE_X = PLOT_X + PLOT_W + 12
TOP = 34
ROW_H = 20
HEAD_H = 22


@dataclass(frozen=True)
class ParityRow:
    """The worst of one comparison (``name``) of one spec over every test that made it."""

    spec: str
    name: str
    worst: Metric
    worst_in: str
    tests: int
    max_ulp: float | None


@dataclass(frozen=True)
class Bar:
    y: float
    label: str
    width: float
    tol_x: float | None
    exact: bool
    within: bool
    value: str


@dataclass(frozen=True)
class Heading:
    y: float
    label: str


@dataclass(frozen=True)
class Tick:
    x: float
    label: str


@dataclass(frozen=True)
class Chart:
    width: int
    height: float
    plot_x: int
    plot_w: int
    value_x: int
    label_x: int
    top: int
    bottom: float
    headings: tuple[Heading, ...]
    bars: tuple[Bar, ...]
    ticks: tuple[Tick, ...]


@dataclass(frozen=True)
class Parity:
    rows: tuple[ParityRow, ...]
    chart: Chart | None


def fmt(value: float | None) -> str:
    """A short rendering of an error or tolerance: 0, 3.2e-07, 0.5, 48."""
    if value is None:
        return "—"
    if value == 0:
        return "0"
    if math.isinf(value) or math.isnan(value):
        return str(value)
    if abs(value) < 1e-3 or abs(value) >= 1e5:
        return f"{value:.2e}"
    return f"{value:.4g}"


def _worse(a: Metric, b: Metric) -> bool:
    return (not a.within, a.max_rel, a.max_abs) > (not b.within, b.max_rel, b.max_abs)


def rows(records: Sequence[Record]) -> tuple[ParityRow, ...]:
    grouped: dict[tuple[str, str], list[tuple[Metric, Record]]] = defaultdict(list)
    for record in records:
        for metric in record.metrics:
            grouped[(record.spec or "(no spec)", metric.name)].append((metric, record))
    out = []
    for (spec, name), pairs in sorted(grouped.items()):
        worst, where = pairs[0]
        for metric, record in pairs[1:]:
            if _worse(metric, worst):
                worst, where = metric, record
        ulps = [m.max_ulp for m, _ in pairs if m.max_ulp is not None]
        out.append(
            ParityRow(
                spec=spec,
                name=name,
                worst=worst,
                worst_in=column_of(where).label,
                tests=len(pairs),
                max_ulp=max(ulps) if ulps else None,
            )
        )
    return tuple(out)


def _decades(table: Sequence[ParityRow]) -> tuple[int, int] | None:
    values = [r.worst.max_rel for r in table] + [r.worst.rtol or 0.0 for r in table]
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if not positive:
        return None
    lo = math.floor(math.log10(min(positive))) - 1  # the smallest bar stays visible
    hi = max(math.ceil(math.log10(max(positive))), lo + 1)
    return lo, hi


def _ticks(lo: int, hi: int) -> tuple[Tick, ...]:
    step = max(1, math.ceil((hi - lo) / 10))
    span = hi - lo
    return tuple(Tick(PLOT_X + PLOT_W * (d - lo) / span, f"1e{d}") for d in range(lo, hi + 1, step))


def chart(table: Sequence[ParityRow]) -> Chart | None:
    """Bars grouped by spec; ``None`` when every error and tolerance is zero."""
    bounds = _decades(table)
    if bounds is None:
        return None
    lo, hi = bounds

    def x(value: float) -> float:
        clipped = min(max(math.log10(value), lo), hi)
        return PLOT_W * (clipped - lo) / (hi - lo)

    headings, bars, y = [], [], float(TOP)
    for index, row in enumerate(table):
        if index == 0 or table[index - 1].spec != row.spec:
            headings.append(Heading(y + 15, row.spec))
            y += HEAD_H
        metric = row.worst
        exact = metric.max_rel <= 0 or not math.isfinite(metric.max_rel)
        rtol = metric.rtol
        bars.append(
            Bar(
                y=y,
                label=row.name,
                width=0.0 if exact else max(x(metric.max_rel), 2.0),
                tol_x=PLOT_X + x(rtol) if rtol and rtol > 0 else None,
                exact=exact,
                within=metric.within,
                value=f"{fmt(metric.max_rel)} (rtol {fmt(rtol)})",
            )
        )
        y += ROW_H
    bottom = y + 6
    return Chart(
        width=WIDTH,
        height=bottom + 30,
        plot_x=PLOT_X,
        plot_w=PLOT_W,
        value_x=VALUE_X,
        label_x=LABEL_X,
        top=TOP,
        bottom=bottom,
        headings=tuple(headings),
        bars=tuple(bars),
        ticks=_ticks(lo, hi),
    )


def parity(records: Sequence[Record]) -> Parity | None:
    """The parity section, or ``None`` when no test recorded metrics."""
    table = rows(records)
    if not table:
        return None
    return Parity(table, chart(table))
