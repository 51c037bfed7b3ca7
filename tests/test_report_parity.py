"""The report's parity section shows the criterion each comparison was held to and colours it
by that criterion's verdict, from hand-written results records; no torch, no World."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from harness.report import build_page, render_report
from harness.report.parity import ParityRow

CATALOGUE = Path(__file__).resolve().parent / "fixtures" / "report" / "catalogue.toml"
GREEN, RED = "#4ac26b", "#cf222e"
HEADER = {"kind": "header", "schema": 1, "torch": "2.13.0+cpu", "runner": "threads"}
END = {"kind": "end", "finished": "2026-11-21T08:22:57+0000", "duration": 1.0, "exitstatus": 0}

# Passed under |a-b| <= atol + rtol*|b| although max abs > atol and max rel > rtol: the two
# maxima are at different elements (as optim.fsdp.mixed_precision).
MIXED = {
    "max_abs": 2e-8,
    "max_rel": 5e-5,
    "max_ulp": 3.0,
    "rtol": 2e-6,
    "atol": 1e-8,
    "allowance_used": 0.625,
    "outside": 0,
    "elements": 40,
}
# Held to 32x one device's float32 error + 1e-6 (as tp.transformer.training): rtol is 0,
# and a relative error of 1347 at an element near zero is well inside.
FLOAT32_ERROR = 5.4e-5
FLOAT32 = {
    "max_abs": 2.28e-5,
    "max_rel": 1346.9,
    "max_ulp": 2.1e10,
    "rtol": 0.0,
    "atol": 32 * FLOAT32_ERROR + 1e-6,
    "allowance_used": 0.0131,
    "outside": 0,
    "elements": 64,
    "float32_multiple": 32.0,
    "float32_error": FLOAT32_ERROR,
}
FAILED = {
    "max_abs": 0.5,
    "max_rel": 0.25,
    "max_ulp": 4194304.0,
    "rtol": 1e-4,
    "atol": 1e-6,
    "allowance_used": 2480.0,
    "outside": 3,
    "elements": 40,
}
# Written before comparisons carried their verdict: maxima taken separately.
OLD = {"max_abs": 5.96e-08, "max_rel": 9.9e-06, "max_ulp": 96.0, "rtol": 1e-4, "atol": 1e-6}


def _test(spec: str, metrics: dict[str, dict[str, Any]], **fields: Any) -> dict[str, Any]:
    world_size = fields.pop("world_size", 2)
    return {
        "kind": "test",
        "nodeid": f"suites/test_x.py::test_{spec}[threads-ws{world_size}-cpu]",
        "spec": spec,
        "runner": "threads",
        "world_size": world_size,
        "device": "cpu",
        "status": "passed",
        "duration": 0.5,
        "examples": 10,
        "metrics": metrics,
        **fields,
    }


def _results(tmp_path: Path, *tests: dict[str, Any]) -> list[Path]:
    path = tmp_path / "results.jsonl"
    lines = [json.dumps(line) for line in (HEADER, *tests, END)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [path]


class _Section(HTMLParser):
    """The parity section: its text; per comparison the chart draws (by ``names``), its
    bar's fill (None: no bar) and the other texts of its row; the table's rows, each as its
    cells' texts."""

    def __init__(self, names: set[str]) -> None:
        super().__init__(convert_charrefs=True)
        self.names, self.inside, self.text = names, False, ""
        self.bars: dict[str, dict[str, Any]] = {}
        self.bar: dict[str, Any] | None = None
        self.table: list[list[str]] = []
        self.in_table = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "section":
            self.inside = found.get("id") == "parity"
        if not self.inside:
            return
        if tag == "rect" and found.get("height") == "14" and self.bar is not None:
            self.bar["fill"] = found.get("fill")
        if tag == "table":
            self.bar, self.in_table = None, True
        if tag == "tr" and self.in_table:
            self.table.append([])

    def handle_data(self, data: str) -> None:
        if not self.inside or not data.strip():
            return
        self.text += data + " "
        if data.strip() in self.names and not self.in_table:
            self.bar = self.bars[data.strip()] = {"fill": None, "texts": []}
        elif self.bar is not None:
            self.bar["texts"].append(data.strip())
        elif self.in_table and self.table:
            self.table[-1].append(data.strip())

    def handle_endtag(self, tag: str) -> None:
        if tag == "section":
            self.inside = self.in_table = False


def _render(tmp_path: Path, *tests: dict[str, Any]) -> tuple[_Section, dict[str, ParityRow]]:
    """The rendered section, and the rows the page shaped it from (after the HTML: what a
    reader sees is checked first)."""
    results = _results(tmp_path, *tests)
    out = render_report(results, tmp_path / "report.html", catalogue_path=CATALOGUE)
    section = _Section({name for test in tests for name in test["metrics"]})
    section.feed(out.read_text(encoding="utf-8"))
    page = build_page(results, catalogue_path=CATALOGUE)
    assert page.parity is not None
    return section, {row.name: row for row in page.parity.rows}


def _table_row(section: _Section, name: str) -> list[str]:
    return next(row for row in section.table if name in row)


def test_a_pass_under_atol_plus_rtol_is_green_with_that_criterion(tmp_path: Path) -> None:
    section, rows = _render(tmp_path, _test("uneven.fully_shard.params", {"param/float32": MIXED}))
    criterion = "|a−b| ≤ 1.00e-08 + 2.00e-06·|b|"
    bar = section.bars["param/float32"]
    assert bar["fill"] == GREEN
    assert "0.625×" in bar["texts"]
    assert any(text.startswith(criterion) for text in bar["texts"])
    assert _table_row(section, "param/float32")[2:4] == [criterion, "0.625"]
    assert "within" in _table_row(section, "param/float32")
    assert "OUTSIDE" not in section.text
    assert (rows["param/float32"].verdict, rows["param/float32"].criterion) == ("within", criterion)


def test_a_float32_multiple_shows_that_criterion_not_its_zero_rtol(tmp_path: Path) -> None:
    section, rows = _render(
        tmp_path, _test("uneven.fully_shard.step_parity", {"tp_transformer/float32": FLOAT32})
    )
    criterion = "|a−b| ≤ 32 × one device's float32 error (5.40e-05) + 1.00e-06"
    bar = section.bars["tp_transformer/float32"]
    assert bar["fill"] == GREEN and "0.0131×" in bar["texts"]
    assert any(text.startswith(criterion) for text in bar["texts"])
    assert criterion in _table_row(section, "tp_transformer/float32")
    assert "rtol 0" not in section.text
    row = rows["tp_transformer/float32"]
    assert (row.verdict, row.criterion) == ("within", criterion)


def test_a_failed_comparison_is_red_with_its_criterion_and_count(tmp_path: Path) -> None:
    failed = _test("uneven.fully_shard.grads", {"grad/float32": FAILED}, status="failed")
    section, rows = _render(tmp_path, failed)
    criterion = "|a−b| ≤ 1.00e-06 + 1.00e-04·|b|"
    bar = section.bars["grad/float32"]
    assert bar["fill"] == RED and "2480× OUTSIDE" in bar["texts"]
    assert any(text.startswith(f"{criterion} · 3 of 40 elements outside") for text in bar["texts"])
    cells = _table_row(section, "grad/float32")
    assert criterion in cells and "OUTSIDE" in cells and "3 of 40 elements" in cells
    row = rows["grad/float32"]
    assert (row.verdict, row.criterion, row.outside) == ("outside", criterion, "3 of 40 elements")


def test_an_old_record_without_its_criterion_is_neutral(tmp_path: Path) -> None:
    section, rows = _render(tmp_path, _test("uneven.fully_shard.grads", {"grad/float32": OLD}))
    bar = section.bars["grad/float32"]
    assert bar["fill"] is None  # no bar: neither green nor red
    assert "criterion not recorded" in bar["texts"]
    assert "criterion not recorded" in _table_row(section, "grad/float32")
    assert "not recorded" in _table_row(section, "grad/float32")  # the verdict
    assert "within" not in section.text and "OUTSIDE" not in section.text
    row = rows["grad/float32"]
    assert (row.verdict, row.criterion) == ("unrecorded", "criterion not recorded")


def test_a_damaged_verdict_reads_as_not_recorded(tmp_path: Path) -> None:
    damaged = {**OLD, "allowance_used": "0.5", "outside": 0, "elements": 2}
    section, _ = _render(tmp_path, _test("uneven.fully_shard.grads", {"grad/float32": damaged}))
    bar = section.bars["grad/float32"]
    assert bar["fill"] is None and "criterion not recorded" in bar["texts"]


def test_the_worst_over_tests_is_the_one_nearest_its_limit_with_its_own_figures(
    tmp_path: Path,
) -> None:
    # A larger error under a looser criterion, and a smaller one nearer its own limit.
    loose = {**MIXED, "max_abs": 1e-3, "max_rel": 0.5, "rtol": 1.0, "allowance_used": 0.5}
    tight = {**MIXED, "max_abs": 9.5e-9, "max_rel": 3.4e-5, "allowance_used": 0.9}
    section, rows = _render(
        tmp_path,
        _test("uneven.fully_shard.params", {"param/float32": loose}, world_size=2),
        _test("uneven.fully_shard.params", {"param/float32": tight}, world_size=4),
    )
    cells = _table_row(section, "param/float32")
    assert cells[2:6] == ["|a−b| ≤ 1.00e-08 + 2.00e-06·|b|", "0.9", "9.50e-09", "3.40e-05"]
    assert "threads · cpu · ws4" in cells
    row = rows["param/float32"]
    assert (row.worst.max_abs, row.worst.rtol, row.worst_in) == (
        9.5e-9,
        2e-6,
        "threads · cpu · ws4",
    )


def test_an_exact_criterion_that_failed_fills_the_plot_in_red(tmp_path: Path) -> None:
    exact = {**FAILED, "rtol": 0.0, "atol": 0.0, "allowance_used": float("inf")}
    section, _ = _render(tmp_path, _test("uneven.shard.torch_chunk", {"local/float32": exact}))
    bar = section.bars["local/float32"]
    assert bar["fill"] == RED and "OUTSIDE" in bar["texts"]
    assert any(text.startswith("exact: a = b · 3 of 40 elements outside") for text in bar["texts"])
