"""Compare a run with a baseline run: new failures, fixes, other changes and metric drift.

Records are matched by a key. ``exact`` keys are spec + runner + device + world size (a test
without a spec: its node id); ``spec`` keys are spec + world size, for runs that share no
runner/device combination (thread vs process runner, CPU vs CUDA). ``auto`` picks ``exact``
when the two runs have a key in common, else ``spec``. Several records under one key count
as one: the worst status, the worst metric of each name.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from harness.errors import check_one_of
from harness.report.model import SEVERITY, column_of, facts, worst
from harness.report.records import Loaded, Metric, Record, SourceFile

Match = Literal["auto", "exact", "spec"]
MATCHES = ("auto", "exact", "spec")
DRIFT = 2.0
NOISE = 0.01
"""A metric drifts when its max_rel grows or shrinks by a factor of ``DRIFT`` while the
larger of the two is at least ``NOISE`` × rtol (below that, changes are rounding), or when
it crosses its tolerance."""
_FIXED = ("passed", "xfailed")
"""A failure is fixed when it passes or turns into its known deviation (not when skipped)."""
_COMPARED_FACTS = (
    "torch",
    "CUDA",
    "NCCL",
    "hypothesis",
    "python",
    "git SHA",
    "profile",
    "seed",
    "runners",
    "devices",
    "world sizes",
    "started",
)


@dataclass(frozen=True)
class Side:
    """The records of one run under one key."""

    status: str
    unexpected: bool
    columns: str
    metrics: Mapping[str, Metric]
    link: str | None


@dataclass(frozen=True)
class Change:
    key: str
    before: Side | None
    after: Side | None


@dataclass(frozen=True)
class Drift:
    key: str
    name: str
    before: Metric
    after: Metric
    factor: str
    worse: bool


@dataclass(frozen=True)
class FactPair:
    label: str
    now: str
    base: str

    @property
    def differs(self) -> bool:
        return self.now != self.base


@dataclass(frozen=True)
class Comparison:
    mode: str
    explanation: str
    files: tuple[SourceFile, ...]
    warnings: tuple[str, ...]
    facts: tuple[FactPair, ...]
    matched: int
    new_failures: tuple[Change, ...]
    fixes: tuple[Change, ...]
    still_failing: tuple[Change, ...]
    other_changes: tuple[Change, ...]
    only_now: tuple[Change, ...]
    only_base: tuple[Change, ...]
    drifts: tuple[Drift, ...]
    steady_metrics: int


def _key(record: Record, mode: str) -> str:
    if mode == "exact":
        return f"{record.spec or record.nodeid} · {column_of(record).label}"
    name = record.spec or re.sub(r"\[[^\]]*\]$", "", record.nodeid)
    return f"{name} · {column_of(record).ws}"


def _worst_metrics(records: Sequence[Record]) -> dict[str, Metric]:
    metrics: dict[str, Metric] = {}
    for record in records:
        for metric in record.metrics:
            held = metrics.get(metric.name)
            if held is None or (not metric.within, metric.max_rel) > (
                not held.within,
                held.max_rel,
            ):
                metrics[metric.name] = metric
    return metrics


def _side(records: Sequence[Record], anchors: Mapping[int, str]) -> Side:
    return Side(
        status=worst(r.status for r in records),
        unexpected=any(r.unexpected for r in records),
        columns=", ".join(dict.fromkeys(column_of(r).label for r in records)),
        metrics=_worst_metrics(records),
        link=next((anchors[id(r)] for r in records if id(r) in anchors), None),
    )


def _sides(records: Sequence[Record], mode: str, anchors: Mapping[int, str]) -> dict[str, Side]:
    grouped: dict[str, list[Record]] = defaultdict(list)
    for record in records:
        grouped[_key(record, mode)].append(record)
    return {key: _side(rs, anchors) for key, rs in sorted(grouped.items())}


def _mode(now: Sequence[Record], base: Sequence[Record], match: Match) -> str:
    if match != "auto":
        return match
    shared = {_key(r, "exact") for r in now} & {_key(r, "exact") for r in base}
    return "exact" if shared else "spec"


def _combos(records: Sequence[Record]) -> str:
    return ", ".join(sorted({f"{r.runner} · {r.device}" for r in records}))


def _explain(mode: str, now: Sequence[Record], base: Sequence[Record]) -> str:
    if mode == "exact":
        return (
            "Records are matched by spec, runner, device and world size (a test without a spec"
            " by its node id). Where several tests share a key, the worst outcome stands for"
            " them and each metric is the worst of them."
        )
    return (
        f"Records are matched by spec and world size only (this run: {_combos(now)};"
        f" baseline: {_combos(base)}), so outcomes of different runners or devices are set"
        " side by side; each row names the runner and device on either side. Where several"
        " tests share a key, the worst outcome stands for them."
    )


def _factor(before: float, after: float) -> float:
    if before == after:
        return 1.0
    if before == 0:
        return math.inf
    return after / before


def _noticeable(error: float, rtol: float | None) -> bool:
    """Whether an error is large enough for its changes to mean something (not rounding)."""
    return error >= NOISE * rtol if rtol else error > 0


def _factor_text(before: float, after: float) -> str:
    if before == 0:
        return "was exact"
    if after == 0:
        return "now exact"
    return f"×{after / before:.3g}"


def drifts(
    key: str, before: Mapping[str, Metric], after: Mapping[str, Metric]
) -> tuple[list[Drift], int]:
    """Drifting metrics of one key, and how many held steady."""
    found, steady = [], 0
    for name in sorted(before.keys() & after.keys()):
        b, a = before[name], after[name]
        factor = _factor(b.max_rel, a.max_rel)
        moved = not 1 / DRIFT < factor < DRIFT and _noticeable(max(b.max_rel, a.max_rel), a.rtol)
        if b.within == a.within and not moved:
            steady += 1
            continue
        worse = factor > 1 or (b.within and not a.within)
        found.append(Drift(key, name, b, a, _factor_text(b.max_rel, a.max_rel), worse))
    return found, steady


def _classify(now: Mapping[str, Side], base: Mapping[str, Side]) -> dict[str, list[Change]]:
    kinds: dict[str, list[Change]] = defaultdict(list)
    for key in sorted(now.keys() | base.keys()):
        before, after = base.get(key), now.get(key)
        change = Change(key, before, after)
        if after is None:
            kinds["only_base"].append(change)
        elif after.unexpected and (before is None or not before.unexpected):
            kinds["new_failures"].append(change)
        elif before is None:
            kinds["only_now"].append(change)
        elif before.unexpected and after.unexpected:
            kinds["still_failing"].append(change)
        elif before.unexpected and after.status in _FIXED:
            kinds["fixes"].append(change)
        elif before.status != after.status:
            kinds["other_changes"].append(change)
    return kinds


def _fact_pairs(now: Loaded, base: Loaded) -> tuple[FactPair, ...]:
    before = {f.label: f for f in facts(base)}
    pairs = []
    for fact in facts(now):
        if fact.label in _COMPARED_FACTS:
            pairs.append(FactPair(fact.label, fact.shown, before[fact.label].shown))
    return tuple(pairs)


def _by_severity(change: Change) -> int:
    return SEVERITY.index(change.after.status) if change.after else len(SEVERITY)


def compare(
    now: Loaded, base: Loaded, anchors: Mapping[int, str], match: Match = "auto"
) -> Comparison:
    """How ``now`` differs from ``base``; ``anchors`` link a record to its failure card."""
    check_one_of("match", match, MATCHES)
    mode = _mode(now.records, base.records, match)
    after, before = _sides(now.records, mode, anchors), _sides(base.records, mode, {})
    kinds = _classify(after, before)
    drifting, steady = [], 0
    for key in sorted(after.keys() & before.keys()):
        found, held = drifts(key, before[key].metrics, after[key].metrics)
        drifting += found
        steady += held
    drifting.sort(key=lambda d: (not d.worse, d.key, d.name))
    return Comparison(
        mode=mode,
        explanation=_explain(mode, now.records, base.records),
        files=base.files,
        warnings=base.warnings,
        facts=_fact_pairs(now, base),
        matched=len(after.keys() & before.keys()),
        new_failures=tuple(sorted(kinds["new_failures"], key=_by_severity)),
        fixes=tuple(kinds["fixes"]),
        still_failing=tuple(kinds["still_failing"]),
        other_changes=tuple(kinds["other_changes"]),
        only_now=tuple(kinds["only_now"]),
        only_base=tuple(kinds["only_base"]),
        drifts=tuple(drifting),
        steady_metrics=steady,
    )
