"""The fault-detection section: what ``python -m harness mutate`` measured (``mutation.json``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import ReportError


@dataclass(frozen=True)
class Row:
    fault: str
    area: str
    bug_class: str
    summary: str
    origin: str
    """How the fault was written (``"written with the property"``, ``"blind, <set> set"``);
    empty in a table written before faults had an origin."""
    upstream: tuple[str, ...]
    """The upstream reports a blind fault re-creates (http(s) URLs only)."""
    verdict: str
    """caught | survived | no result"""
    specs: tuple[str, ...]
    test: str | None
    seconds_to_detect: float | None
    examples_to_detect: int | None
    counterexample: str | None
    wall_seconds: float
    problem: str | None


@dataclass(frozen=True)
class OriginScore:
    origin: str
    caught: int
    total: int


@dataclass(frozen=True)
class Detection:
    caught: int
    total: int
    void: str | None
    finished: bool
    clean: dict[str, Any]
    config: dict[str, Any]
    rows: tuple[Row, ...]
    by_origin: tuple[OriginScore, ...]
    """The score of each origin as ``mutate`` wrote it (none in a table written before)."""

    @property
    def headline(self) -> str:
        if self.void:
            return "score void"
        return f"{self.caught}/{self.total} faults caught"


def _row(raw: dict[str, Any]) -> Row:
    verdict = "no result" if raw.get("problem") else "caught" if raw.get("caught") else "survived"
    origin = raw.get("origin") or {}
    return Row(
        fault=str(raw["fault"]),
        area=str(raw.get("area", "")),
        bug_class=str(raw.get("bug_class", "")),
        summary=str(raw.get("summary", "")),
        origin=str(origin.get("label", "")),
        upstream=tuple(u for u in map(str, origin.get("upstream") or ()) if _is_link(u)),
        verdict=verdict,
        specs=tuple(map(str, raw.get("specs") or ())),
        test=raw.get("test"),
        seconds_to_detect=raw.get("seconds_to_detect"),
        examples_to_detect=raw.get("examples_to_detect"),
        counterexample=raw.get("counterexample"),
        wall_seconds=float(raw.get("wall_seconds") or 0.0),
        problem=raw.get("problem"),
    )


def load(path: Path) -> Detection:
    """Read ``mutation.json``; a missing or malformed file is a ``ReportError``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        rows = tuple(_row(raw) for raw in data.get("results", []))
        score = data.get("score", {})
        by_origin = tuple(
            OriginScore(str(s["origin"]), int(s["caught"]), int(s["faults"]))
            for s in score.get("by_origin") or ()
        )
        return Detection(
            caught=int(score.get("caught", 0)),
            total=int(score.get("faults", len(rows))),
            void=data.get("void"),
            finished=bool(data.get("finished")),
            clean=data.get("clean") or {},
            config=data.get("config") or {},
            rows=rows,
            by_origin=by_origin,
        )
    except OSError as exc:
        raise ReportError(f"mutation table {str(path)!r} cannot be read: {exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ReportError(f"mutation table {str(path)!r} is malformed: {exc!r}") from None


def _is_link(value: str) -> bool:
    """Whether the report may link to ``value``: an http(s) URL, never a script."""
    return value.startswith(("https://", "http://")) and value.split() == [value]
