"""The HTML report: structure, escaping, damaged and empty inputs, the baseline diff.

Rendered from the frozen fixtures of ``tests/fixtures/report`` (two results files, one per
pytest process, a baseline run and a small catalogue); no torch, no World."""

from __future__ import annotations

import json
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from harness.report import ReportError, build_page, render_report, screenshot
from harness.report.compare import drifts
from harness.report.model import split_stacks
from harness.report.records import Metric

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "report"
RUN = [FIXTURES / "results.jsonl", FIXTURES / "results.gw1.jsonl"]
BASELINE = [FIXTURES / "baseline" / "results.jsonl"]
CATALOGUE = FIXTURES / "catalogue.toml"
SCRIPT = "<script>alert(1)</script>"
IMG = '"><img src=x onerror=alert(1)>'
VOID = {"meta", "br", "col", "hr", "img", "input", "link", "source", "wbr"}


class Node:
    def __init__(self, tag: str, attrs: dict[str, str | None]) -> None:
        self.tag, self.attrs, self.children, self.parts = tag, attrs, [], []

    @property
    def classes(self) -> set[str]:
        return set((self.attrs.get("class") or "").split())

    @property
    def text(self) -> str:
        return " ".join(" ".join(self.parts).split())

    def iter(self):
        yield self
        for child in self.children:
            yield from child.iter()

    def find_all(self, tag=None, cls=None):
        return [
            n
            for n in self.iter()
            if (tag is None or n.tag == tag) and (cls is None or cls in n.classes)
        ]

    def by_id(self, ident):
        return next(n for n in self.iter() if n.attrs.get("id") == ident)


class Tree(HTMLParser):
    """A tiny DOM: every node keeps the text of its whole subtree."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#root", {})
        self.stack = [self.root]
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs))
        self.tags.append((tag, node.attrs))
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self.stack[-1].children.append(Node(tag, dict(attrs)))

    def handle_endtag(self, tag):
        for index in range(len(self.stack) - 1, 0, -1):
            if self.stack[index].tag == tag:
                del self.stack[index:]
                return

    def handle_data(self, data):
        for node in self.stack:
            node.parts.append(data)


def parse(html: str) -> Tree:
    tree = Tree()
    tree.feed(html)
    tree.close()
    return tree


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> tuple[str, Tree]:
    out = tmp_path_factory.mktemp("report") / "report.html"
    assert render_report(RUN, out, baseline=BASELINE, catalogue_path=CATALOGUE) == out
    html = out.read_text(encoding="utf-8")
    return html, parse(html)


def _render(tmp_path, results, **kwargs) -> tuple[str, Tree]:
    out = tmp_path / "report.html"
    render_report(results, out, catalogue_path=CATALOGUE, **kwargs)
    html = out.read_text(encoding="utf-8")
    return html, parse(html)


def test_every_section_is_there_and_the_verdict_is_red(rendered):
    _, tree = rendered
    root = tree.root
    for section in ("verdict", "summary", "matrix", "failures", "expected", "parity"):
        assert root.by_id(section)
    for section in ("baseline", "environment", "files", "uncatalogued"):
        assert root.by_id(section)
    verdict = root.by_id("verdict")
    assert "fail" in verdict.classes
    assert "5 unexpected outcomes" in verdict.text
    assert "1 crashed, 1 timeout, 1 error, 1 failed, 1 unexpected pass" in verdict.text


def test_the_versions_section_sorts_the_run_into_the_triage_categories(rendered):
    _, tree = rendered
    versions = tree.root.by_id("versions")
    tiles = {
        t.find_all(cls="t")[0].text: int(t.find_all(cls="n")[0].text)
        for t in versions.find_all("div", "tile")
    }
    assert tiles == {"new": 4, "different": 0, "fixed": 1, "unverified": 0, "known": 1}
    text = versions.text
    assert "new failures" in text and "deviations fixed: an expected failure passed" in text
    assert "fixed in " in text and "known deviation" in text


def test_summary_counts_every_status_and_groups_skip_reasons(rendered):
    _, tree = rendered
    tiles = {
        t.find_all(cls="t")[0].text: int(t.find_all(cls="n")[0].text)
        for t in tree.root.by_id("summary").find_all("div", "tile")
    }
    assert tiles == {
        "passed": 8,
        "failed": 1,
        "expected failure": 1,
        "unexpected pass": 1,
        "skipped": 3,
        "error": 1,
        "timeout": 1,
        "crashed": 1,
    }
    summary = tree.root.by_id("summary")
    rows = [r.text for r in summary.find_all("tr")[1:]]
    assert rows[0].startswith("2 runner lacks <op>")  # grouped, most frequent first
    assert rows[1].startswith("1 needs 2 GPUs")
    assert "7 of 8 active specs ran; 1 planned; 2 spec IDs outside the catalogue" in summary.text


def _matrix_rows(table):
    rows = {}
    for tr in table.find_all("tr"):
        spec = tr.find_all(cls="specid")
        if spec:
            cells = [td.find_all(cls="st")[0] for td in tr.find_all("td", "cell")]
            rows[spec[0].text] = [(c.classes - {"st", "expected"}).pop() for c in cells]
    return rows


def test_matrix_has_a_row_per_catalogue_spec_with_gaps_and_planned(rendered):
    _, tree = rendered
    matrix = tree.root.by_id("matrix")
    tables = matrix.find_all("table", "matrix")
    rows = _matrix_rows(tables[0])
    assert list(rows) == [
        "placements.distribute.roundtrip",
        "placements.redistribute.roundtrip",
        "placements.distribute.partial_sum_keeps_dtype",
        "placements.redistribute.partial_target_rejected",
        "placements.mesh.three_d_strided",
        "uneven.shard.torch_chunk",
        "uneven.fully_shard.params",
        "uneven.fully_shard.grads",
        "uneven.fully_shard.step_parity",
    ]
    headers = [th.text for th in tables[0].find_all("th", "col")]
    assert headers == ["ws2", "ws1", "ws2"]  # processes·cpu, then threads·cpu
    assert rows["placements.distribute.roundtrip"] == ["passed", "passed", "failed"]
    assert rows["placements.redistribute.partial_target_rejected"] == ["missing"] * 3
    assert rows["placements.mesh.three_d_strided"] == ["planned"] * 3
    assert rows["uneven.fully_shard.params"] == ["crashed", "missing", "error"]
    assert rows["placements.distribute.partial_sum_keeps_dtype"][1:] == ["xfailed", "xpassed"]
    assert "placements · 3 of 5 specs ran" in matrix.text
    unknown = _matrix_rows(tables[1])
    assert list(unknown) == ["(no spec)", "demo.not_catalogued"]


def test_a_failing_cell_links_to_its_failure(rendered):
    _, tree = rendered
    links = [a.attrs["href"] for a in tree.root.by_id("matrix").find_all("a", "failed")]
    assert len(links) == 1
    card = tree.root.by_id(links[0].removeprefix("#"))
    assert "placements.distribute.roundtrip" in card.text


def test_each_failure_has_its_example_ranks_stacks_metrics_and_reproducer(rendered):
    _, tree = rendered
    cards = tree.root.by_id("failures").find_all("article", "card")
    statuses = [(c.classes - {"card"}).pop() for c in cards]
    assert statuses == ["crashed", "timeout", "error", "failed", "xpassed"]
    for card in cards:
        assert card.find_all("pre", "cmd")[0].text.startswith("python -m pytest ")
    failed = cards[3]
    assert "Falsifying example: test_roundtrip(" in failed.find_all("pre", "example")[0].text
    assert "rank 1: error ★" in failed.find_all(cls="primary")[0].text
    assert "OUTSIDE tolerance" in failed.text
    assert "4.19e+06" in failed.text  # the ULPs
    timeout = cards[1]
    stacks = timeout.find_all("details", "stack")
    assert [s.find_all("summary")[0].text.split(" File")[0] for s in stacks] == [
        "rank 0 (timeout)",
        "rank 1 (waiting)",
    ]
    assert "line 18, in _hang" in stacks[0].text  # where rank 0 was stuck
    assert "line 19, in _hang" in stacks[1].find_all("summary")[0].text
    xpassed = cards[4]
    assert "Known deviation (xfail)" in xpassed.text
    expected = tree.root.by_id("expected")
    assert "github.com/pytorch/pytorch/issues/123456" in expected.find_all("a")[0].attrs["href"]


def test_hostile_strings_are_escaped_everywhere(rendered):
    html, tree = rendered
    assert SCRIPT not in html
    assert "<img" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html  # nodeid, error, traceback
    assert "&lt;img src=x onerror=alert(1)&gt;" in html  # example, skip reason
    assert "&amp;amp;" in html  # an "&amp;" in a result stays literal text
    assert "Ωμέγα ✓ 日本語" in html
    allowed = {"html", "head", "meta", "title", "style", "body", "main", "header", "h1", "h2"}
    allowed |= {"h3", "nav", "a", "section", "div", "ul", "li", "table", "tr", "th", "td", "b"}
    allowed |= {"span", "strong", "details", "summary", "pre", "article", "p", "colgroup", "col"}
    allowed |= {"svg", "text", "line", "rect"}
    assert {tag for tag, _ in tree.tags} <= allowed
    for tag, attrs in tree.tags:
        assert not [name for name in attrs if name.startswith("on")], tag
        assert not (attrs.get("href") or "").startswith("javascript:"), tag
    hrefs = [a["href"] for tag, a in tree.tags if tag == "a"]
    assert all(h.startswith("#") or h.startswith("https://github.com/") for h in hrefs)


def test_the_page_is_self_contained(rendered):
    html, tree = rendered
    assert not [t for t, a in tree.tags if t in ("script", "link", "img", "iframe")]
    assert not [a for _, a in tree.tags if a.get("src")]
    assert "Content-Security-Policy" in html


def test_parity_chart_and_numbers(rendered):
    page = build_page(RUN, catalogue_path=CATALOGUE)
    assert page.parity is not None
    rows = {(r.spec, r.name): r for r in page.parity.rows}
    grads = rows[("uneven.fully_shard.grads", "grad/float32")]
    assert grads.tests == 2 and grads.worst_in == "processes · cpu · ws2"  # the worse of two
    assert not rows[("placements.distribute.roundtrip", "local/float32")].worst.within
    # The fixtures predate comparisons recording their verdict: shown, judged by no criterion
    bars = page.parity.chart.bars
    assert [b.note for b in bars] == ["criterion not recorded"] * 4
    assert {b.verdict for b in bars} == {"unrecorded"}
    _, tree = rendered
    parity = tree.root.by_id("parity")
    assert not parity.find_all("rect")  # no bar: neither green nor red
    assert "OUTSIDE" not in parity.text and "9.90e-06" in parity.text


def test_baseline_shows_new_failures_fixes_and_drift(rendered):
    page = build_page(RUN, baseline=BASELINE, catalogue_path=CATALOGUE)
    cmp = page.comparison
    assert cmp is not None and cmp.mode == "exact"
    new = {
        c.key: (c.before and c.before.status, c.after and c.after.status) for c in cmp.new_failures
    }
    assert new["placements.distribute.roundtrip · threads · cpu · ws2"] == ("passed", "failed")
    assert [c.key for c in cmp.fixes] == ["uneven.fully_shard.step_parity · threads · cpu · ws2"]
    assert [c.key for c in cmp.still_failing] == [
        "placements.redistribute.roundtrip · threads · cpu · ws2"
    ]
    drift = {(d.key, d.name): d for d in cmp.drifts}
    grads = drift[("uneven.fully_shard.grads · threads · cpu · ws2", "grad/float32")]
    assert grads.worse and grads.factor == "×10"
    assert cmp.steady_metrics == 1  # grad/float64 did not move
    assert [c.key for c in cmp.only_base] == [
        "placements.redistribute.partial_target_rejected · threads · cpu · ws2"
    ]
    torch = next(f for f in cmp.facts if f.label == "torch")
    assert torch.differs and (torch.now, torch.base) == ("2.13.0+cpu", "2.12.0+cpu")
    _, tree = rendered
    section = tree.root.by_id("baseline")
    assert "4 new failures · 1 fix" in section.text
    assert "×10 ▲ worse" in section.text
    assert "matched by spec, runner, device and world size" in section.text


def test_baseline_of_another_runner_is_matched_by_spec_and_world_size():
    processes = [FIXTURES / "results.gw1.jsonl"]
    cmp = build_page(processes, baseline=BASELINE, catalogue_path=CATALOGUE).comparison
    assert cmp is not None and cmp.mode == "spec"
    assert "this run: processes · cpu; baseline: threads · cpu" in cmp.explanation
    drift = {(d.key, d.name): d for d in cmp.drifts}
    assert drift[("uneven.fully_shard.grads · ws2", "grad/float32")].worse
    forced = build_page(RUN, baseline=BASELINE, catalogue_path=CATALOGUE, match="spec")
    assert forced.comparison is not None and forced.comparison.mode == "spec"


def _damaged(tmp_path) -> Path:
    lines = (FIXTURES / "results.jsonl").read_text(encoding="utf-8").splitlines()
    body = lines[:-1]  # no end record: the run was interrupted
    body.insert(3, "garbage that is not JSON")
    body.append(lines[2][:60])  # truncated last line, no newline
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(body), encoding="utf-8")
    return path


def test_a_corrupt_file_renders_with_a_warning_naming_file_and_lines(tmp_path):
    path = _damaged(tmp_path)
    _, tree = _render(tmp_path, [path])
    warnings = tree.root.by_id("warnings").text
    assert f"{path}: lines 4, 16 could not be read" in warnings
    assert f"{path}: no end record: the run did not finish, results are partial" in warnings
    assert "no: partial" in tree.root.by_id("files").text
    assert "4, 16" in tree.root.by_id("files").text


def test_results_without_an_end_record_are_shown_crashed_not_green(tmp_path):
    lines = (FIXTURES / "results.jsonl").read_text(encoding="utf-8").splitlines()
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join([lines[0], lines[1]]) + "\n", encoding="utf-8")  # header, a pass
    _, tree = _render(tmp_path, [path])
    verdict = tree.root.by_id("verdict")
    assert "crashed" in verdict.classes
    assert f"Crashed: no end record in {path}" in verdict.text


def test_unreadable_lines_without_failures_are_partial_not_green(tmp_path):
    lines = (FIXTURES / "results.jsonl").read_text(encoding="utf-8").splitlines()
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join([lines[0], lines[1], "{trunc", lines[-1]]) + "\n", encoding="utf-8")
    _, tree = _render(tmp_path, [path])
    verdict = tree.root.by_id("verdict")
    assert "partial" in verdict.classes
    assert "1 record line(s) could not be read" in verdict.text


def test_a_clean_passing_run_is_green(tmp_path):
    lines = (FIXTURES / "results.jsonl").read_text(encoding="utf-8").splitlines()
    path = tmp_path / "results.jsonl"
    end = lines[-1].replace('"exitstatus": 1', '"exitstatus": 0')  # its failures are cut
    path.write_text("\n".join([lines[0], lines[1], end]) + "\n", encoding="utf-8")
    html, tree = _render(tmp_path, [path])
    assert "pass" in tree.root.by_id("verdict").classes
    assert "All conformant" in tree.root.by_id("verdict").text
    assert 'id="warnings"' not in html


def test_bytes_that_are_not_utf8_do_not_stop_the_report(tmp_path):
    path = tmp_path / "results.jsonl"
    data = (FIXTURES / "results.jsonl").read_bytes()
    path.write_bytes(data + b"\xff\xfe broken\n")
    _, tree = _render(tmp_path, [path])
    warnings = tree.root.by_id("warnings").text
    assert "bytes that are not UTF-8 were replaced" in warnings
    assert "line 16 could not be read" in warnings


@pytest.mark.parametrize("content", ["", '{"kind": "header", "schema": 1}\n{"kind": "end"}\n'])
def test_an_empty_run_is_an_error_naming_the_file(tmp_path, content):
    path = tmp_path / "results.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ReportError, match=r"no test records in .*results\.jsonl"):
        render_report([path], tmp_path / "report.html", catalogue_path=CATALOGUE)
    assert not (tmp_path / "report.html").exists()


def test_a_missing_file_is_an_error_naming_it(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ReportError, match=r"nope\.jsonl"):
        render_report([*RUN, missing], tmp_path / "r.html", catalogue_path=CATALOGUE)
    with pytest.raises(ReportError, match=r"nope\.jsonl"):
        render_report(RUN, tmp_path / "r.html", baseline=[missing], catalogue_path=CATALOGUE)
    with pytest.raises(ReportError, match="no results files"):
        render_report([], tmp_path / "r.html")


def test_a_directory_stands_for_its_results_files(tmp_path):
    page = build_page([FIXTURES], catalogue_path=CATALOGUE)
    assert [Path(f.path).name for f in page.report.files] == ["results.gw1.jsonl", "results.jsonl"]
    assert page.report.total == 17
    with pytest.raises(ReportError, match="holds no results"):
        build_page([tmp_path], catalogue_path=CATALOGUE)


def test_an_unknown_status_counts_as_an_error_with_a_warning(tmp_path):
    lines = (FIXTURES / "results.jsonl").read_text(encoding="utf-8").splitlines()
    path = tmp_path / "results.jsonl"
    odd = lines[1].replace('"status": "passed"', '"status": "<b>weird</b>"')
    path.write_text("\n".join([lines[0], odd, lines[-1]]) + "\n", encoding="utf-8")
    html, tree = _render(tmp_path, [path])
    assert "has status '<b>weird</b>'" in tree.root.by_id("warnings").text
    assert "&lt;b&gt;weird&lt;/b&gt;" in html
    assert "<b>weird" not in html
    assert "1 unexpected outcome" in tree.root.by_id("verdict").text


def test_split_stacks_separates_the_head_from_each_ranks_stack():
    error = "deadline expired\n  rank 0: timeout\nPython stack of every rank at the deadline:\n"
    error += '--- rank 0 (timeout) ---\n  File "/x/site-packages/a.py", line 1, in f\n    f()\n'
    error += '  File "/w/suite.py", line 9, in g\n    hang()\n\n--- rank 1 (waiting) ---\n  ...\n'
    head, stacks = split_stacks(error)
    assert head == "deadline expired\n  rank 0: timeout"
    assert [s.title for s in stacks] == ["rank 0 (timeout)", "rank 1 (waiting)"]
    assert stacks[0].where == 'File "/w/suite.py", line 9, in g · hang()'
    assert split_stacks("plain") == ("plain", ())


def test_screenshot_says_when_chromium_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CHROMIUM", raising=False)
    with pytest.raises(screenshot.ScreenshotError, match="no Chromium found"):
        screenshot.find_chromium()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium (apt: chromium)")
def test_screenshot_of_the_fixture_report(rendered, tmp_path):
    html, _ = rendered
    report = tmp_path / "report.html"
    report.write_text(html, encoding="utf-8")
    png = screenshot.main(report, tmp_path / "report.png")
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG")
    height = int.from_bytes(data[20:24], "big")
    assert int.from_bytes(data[16:20], "big") == screenshot.WIDTH and height > 3000


def test_drift_ignores_rounding_but_not_growth_or_a_crossed_tolerance():
    def metric(max_rel, max_abs=0.0):
        return Metric("m", max_abs, max_rel, None, 1e-4, 1e-6)

    def drifting(before, after):
        found, steady = drifts("k", {"m": before}, {"m": after})
        assert len(found) + steady == 1
        return found

    assert not drifting(metric(0.0), metric(2e-9))  # far below rtol: rounding
    assert not drifting(metric(4e-6), metric(6e-6))  # within a factor of two
    [grew] = drifting(metric(5e-7), metric(5e-6))
    assert grew.worse and grew.factor == "×10"
    [crossed] = drifting(metric(9e-5, 1e-3), metric(1.1e-4, 1e-3))  # ×1.2, but now outside
    assert crossed.worse


def test_what_examples_exercised_is_listed_per_spec_most_first(tmp_path):
    lines = (FIXTURES / "results.jsonl").read_text(encoding="utf-8").splitlines()
    test = json.loads(lines[1])
    test["exercised"] = {"neg: S(0) -> S(0)": 3, "sum: S(0) -> P(sum)": 7, "<b>bad</b>": 1}
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join([lines[0], json.dumps(test), lines[-1]]) + "\n", encoding="utf-8")
    html, tree = _render(tmp_path, [path])
    section = tree.root.by_id("exercised").text
    assert section.index("sum: S(0) -> P(sum)") < section.index("neg: S(0) -> S(0)")
    assert "3 distinct" in section
    assert "<b>bad</b>" not in html, "labels are escaped"


def test_a_run_that_counted_nothing_has_no_exercised_section(tmp_path):
    lines = (FIXTURES / "results.jsonl").read_text(encoding="utf-8").splitlines()
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join([lines[0], lines[1], lines[-1]]) + "\n", encoding="utf-8")
    html, _ = _render(tmp_path, [path])
    assert 'id="exercised"' not in html
