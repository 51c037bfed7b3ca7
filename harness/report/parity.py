"""Parity of distributed against reference values: per spec and comparison, the worst
comparison over every test, shown with the criterion it was held to and coloured by the
verdict that criterion gave (``harness.parity.Verdict``, recorded with the comparison).

Every criterion is ``|a − b| <= atol + rtol·|b|`` elementwise (a: distributed, b: reference),
its ``atol`` sometimes a multiple of one device's float32 error and both zero for an exact
one, so the chart puts them on one scale: how much of what its criterion allowed the worst
element used (log scale), the criterion's limit at 1×. A record written before comparisons
carried their verdict says "criterion not recorded" and takes neither colour: its figures
are maxima taken separately, which no criterion can be read from. The template draws the
SVG from these numbers."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from harness.parity import Verdict
from harness.report.model import column_of
from harness.report.records import Metric, Record

WIDTH = 1000
LABEL_X = 16
PLOT_X = 330
PLOT_W = 520
VALUE_X = PLOT_X + PLOT_W + 12
TOP = 34
ROW_H = 34
HEAD_H = 22

Judged = Literal["within", "outside", "unrecorded"]
NOT_RECORDED = "criterion not recorded"


@dataclass(frozen=True)
class ParityRow:
    """The worst of one comparison (``name``) of one spec over every test that made it:
    ``worst`` with the criterion it was held to and that criterion's verdict."""

    spec: str
    name: str
    worst: Metric
    worst_in: str
    tests: int
    held: Verdict | None
    """The verdict recorded with ``worst``; None for an old record."""
    criterion: str
    verdict: Judged
    outside: str | None
    """``n of m elements`` outside the criterion; None when within or not recorded."""


@dataclass(frozen=True)
class Bar:
    """One comparison's row of the chart: a bar as long as the share of its allowance the
    worst element used, or ``note`` where there is no bar to draw; ``detail`` (the
    criterion and the worst comparison's figures) goes under it."""

    y: float
    label: str
    width: float
    note: str | None
    verdict: Judged
    value: str
    detail: str


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
    limit_x: float
    """Where the criterion's limit (1× the allowance) is."""
    headings: tuple[Heading, ...]
    bars: tuple[Bar, ...]
    ticks: tuple[Tick, ...]


@dataclass(frozen=True)
class Parity:
    rows: tuple[ParityRow, ...]
    chart: Chart


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


def verdict(metric: Metric) -> Judged:
    """What the comparison's criterion gave; ``unrecorded`` for an old record."""
    held = metric.verdict
    if held is None:
        return "unrecorded"
    return "within" if held.within else "outside"


def criterion(metric: Metric) -> str:
    """The criterion the comparison was held to, its tolerances written in:
    ``|a−b| ≤ 1.00e-06 + 1.00e-04·|b|``, ``|a−b| ≤ 32 × one device's float32 error
    (9.54e-07) + 1.00e-06``, ``exact: a = b``."""
    held, rtol, atol = metric.verdict, metric.rtol, metric.atol
    if held is None or rtol is None or atol is None:
        return NOT_RECORDED
    if rtol == 0 and atol == 0:
        return "exact: a = b"
    terms = []
    if held.float32 is not None:
        built_on = held.float32.multiple * held.float32.error
        terms.append(
            f"{fmt(held.float32.multiple)} × one device's float32 error ({fmt(held.float32.error)})"
        )
        if atol > built_on:
            terms.append(fmt(atol - built_on))
    elif atol > 0:
        terms.append(fmt(atol))
    if rtol > 0:
        terms.append(f"{fmt(rtol)}·|b|")
    return "|a−b| ≤ " + " + ".join(terms)


def _outside(metric: Metric) -> str | None:
    held = metric.verdict
    if held is None or held.within:
        return None
    return f"{held.outside} of {held.elements} elements"


def _severity(metric: Metric) -> tuple[float, ...]:
    """Orders comparisons worst last: outside, then not recorded, then within; among those,
    by the share of its allowance used (an old record has only its raw errors)."""
    held = metric.verdict
    if held is None:
        return (1, metric.max_rel, metric.max_abs)
    return (0 if held.within else 2, held.allowance_used, metric.max_rel, metric.max_abs)


def rows(records: Sequence[Record]) -> tuple[ParityRow, ...]:
    grouped: dict[tuple[str, str], list[tuple[Metric, Record]]] = defaultdict(list)
    for record in records:
        for metric in record.metrics:
            grouped[(record.spec or "(no spec)", metric.name)].append((metric, record))
    out = []
    for (spec, name), pairs in sorted(grouped.items()):
        worst, where = pairs[0]
        for metric, record in pairs[1:]:
            if _severity(metric) > _severity(worst):
                worst, where = metric, record
        out.append(
            ParityRow(
                spec=spec,
                name=name,
                worst=worst,
                worst_in=column_of(where).label,
                tests=len(pairs),
                held=worst.verdict,
                criterion=criterion(worst),
                verdict=verdict(worst),
                outside=_outside(worst),
            )
        )
    return tuple(out)


def _decades(table: Sequence[ParityRow]) -> tuple[int, int]:
    """The chart's range in decades: every finite share used and the limit (1×) inside."""
    used = [r.held.allowance_used for r in table if r.held is not None]
    positive = [v for v in used if v > 0 and math.isfinite(v)] + [1.0]
    lo = min(math.floor(math.log10(min(positive))) - 1, -1)  # the smallest bar stays visible
    hi = max(math.ceil(math.log10(max(positive))), 1)
    return lo, hi


def _ticks(lo: int, hi: int) -> tuple[Tick, ...]:
    step = max(1, math.ceil((hi - lo) / 10))
    span = hi - lo
    return tuple(
        Tick(PLOT_X + PLOT_W * (d - lo) / span, f"{10.0**d:g}×") for d in range(lo, hi + 1, step)
    )


def _detail(row: ParityRow) -> str:
    m = row.worst
    figures = f"max abs {fmt(m.max_abs)} · max rel {fmt(m.max_rel)}"
    if row.verdict == "unrecorded":
        return f"{figures} · rtol {fmt(m.rtol)} · atol {fmt(m.atol)} (maxima taken separately)"
    outside = f" · {row.outside} outside" if row.outside else ""
    return f"{row.criterion}{outside} · {figures}"


def _bar(row: ParityRow, y: float, x: float) -> Bar:
    """``x``: the bar's length in the plot for a share used; used only for a bar drawn."""
    held = row.held
    width, note, value = 0.0, None, "—"
    if held is None:
        note = NOT_RECORDED
    elif held.allowance_used == 0:
        note, value = "exact (0)", "0×"
    elif math.isinf(held.allowance_used):  # a difference where nothing was allowed
        width, value = PLOT_W, "OUTSIDE"
    else:
        width = max(x, 2.0)
        value = f"{fmt(held.allowance_used)}×" + (" OUTSIDE" if row.verdict == "outside" else "")
    return Bar(y, row.name, width, note, row.verdict, value, _detail(row))


def chart(table: Sequence[ParityRow]) -> Chart:
    """Bars grouped by spec (``table`` holds at least one comparison)."""
    lo, hi = _decades(table)

    def x(value: float) -> float:
        if not value > 0:
            return 0.0
        clipped = min(max(math.log10(value), lo), hi)
        return PLOT_W * (clipped - lo) / (hi - lo)

    headings, bars, y = [], [], float(TOP)
    for index, row in enumerate(table):
        if index == 0 or table[index - 1].spec != row.spec:
            headings.append(Heading(y + 15, row.spec))
            y += HEAD_H
        bars.append(_bar(row, y, x(row.held.allowance_used) if row.held is not None else 0.0))
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
        limit_x=PLOT_X + x(1.0),
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
