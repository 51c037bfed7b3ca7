"""Render a report: read the results, shape them (``model``, ``parity``, ``compare``) and
lay them out with the Jinja2 templates of ``templates/`` (autoescaped: every string from a
result is escaped; no template marks result data safe)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import jinja2

from harness import catalogue
from harness.errors import CatalogueError, ReportError
from harness.outcome import outputs
from harness.report import compare, model, mutation, parity, reach, records, surface


@dataclass(frozen=True)
class Page:
    title: str
    report: model.Report
    parity: parity.Parity | None
    comparison: compare.Comparison | None
    mutation: mutation.Detection | None = None
    reach: str | None = None
    """How many of the ops DTensor has a rule for the run reached, where it recorded them."""
    surface: str | None = None
    """How many options of torch's public API the run drew, where it recorded them."""


def _seconds(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.2f} s" if value < 60 else f"{value / 60:.1f} min"


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("harness.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["num"] = parity.fmt
    env.filters["seconds"] = _seconds
    env.globals["TITLES"] = model.TITLES
    return env


def _catalogue(path: Path | None) -> dict[str, catalogue.Spec]:
    try:
        return catalogue.load(path or catalogue.DEFAULT_PATH)
    except CatalogueError as exc:
        raise ReportError(str(exc)) from None


def _title(report: model.Report) -> str:
    facts = {f.label: f.shown for f in report.facts}
    sha = facts.get("git SHA", "—")[:12]
    return f"distconf report · torch {facts.get('torch', '—')} · {sha}"


def build_page(
    results: Sequence[Path],
    *,
    baseline: Sequence[Path] = (),
    catalogue_path: Path | None = None,
    match: compare.Match = "auto",
    mutation_table: Path | None = None,
) -> Page:
    """Everything the page shows, without HTML (for tests and other front ends)."""
    if not results:
        raise ReportError("no results files given")
    loaded = records.load(results)
    specs = _catalogue(catalogue_path)
    report = model.build(loaded, specs)
    comparison = None
    if baseline:
        comparison = compare.compare(loaded, records.load(baseline), report.anchors, match)
    detection = mutation.load(mutation_table) if mutation_table else None
    return Page(
        _title(report),
        report,
        parity.parity(loaded.records),
        comparison,
        detection,
        reach.summary_of(results),
        surface.summary_of(results),
    )


def render_page(page: Page) -> str:
    return environment().get_template("report.html.j2").render(page=page)


def render_report(
    results: Sequence[Path],
    output: Path,
    *,
    baseline: Sequence[Path] = (),
    catalogue_path: Path | None = None,
    match: compare.Match = "auto",
    mutation_table: Path | None = None,
) -> Path:
    """Write the HTML report of ``results`` (files, or directories of ``results*.jsonl``)
    to ``output`` and return its path. ``baseline`` adds a comparison with another run;
    ``match`` says how its records pair up (see ``harness.report.compare``);
    ``mutation_table`` (a ``mutation.json``) adds the fault-detection section.

    Raises ``ReportError`` when a file is missing, no test record was found or the page
    cannot be written (a full disk): the page is written whole or not at all, never cut
    short where its verdict already shows."""
    page = build_page(
        results,
        baseline=baseline,
        catalogue_path=catalogue_path,
        match=match,
        mutation_table=mutation_table,
    )
    html = render_page(page)
    try:
        outputs.write_whole(output, html)
    except OSError as exc:
        raise ReportError(f"cannot write {str(output)!r}: {exc.strerror or exc}") from None
    return output
