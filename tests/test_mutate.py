"""``mutate``: detection read off the results records, the runs it starts and in what order,
the score in all and per origin (its table, ``mutation.json``, the report's section), and
each run in a forked process of its own."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from harness import catalogue, faults
from harness.config import RunConfig
from harness.mutation import mutate
from harness.report.records import ReportError
from harness.report.render import build_page, render_page


def _record(nodeid, status, duration, spec=None, **extra):
    return {"nodeid": nodeid, "status": status, "duration": duration, "spec": spec, **extra}


def test_detection_time_is_the_earlier_tests_plus_the_time_to_the_first_failing_example():
    result = mutate.FaultResult(fault="f", area="a", bug_class="b", summary="s", caught=False)
    tests = [
        _record("t1", "passed", 2.0, "s.one"),
        _record("t2", "xfailed", 1.0, "s.two"),
        _record(
            "t3",
            "failed",
            9.0,
            "s.three",
            seconds_to_failure=0.5,
            examples_to_failure=7,
            falsifying_example="case=X",
        ),
    ]
    mutate._note_detection(result, tests, [tests[2]])
    assert (result.caught, result.test, result.specs) == (True, "t3", ["s.three"])
    assert (result.seconds_to_detect, result.examples_to_detect) == (3.5, 7)
    assert result.counterexample == "case=X"


def test_fault_runs_take_one_rank_last():
    assert mutate.detection_order((1, 2, 3, 4)) == (2, 3, 4, 1)
    assert mutate.detection_order((4, 1, 2)) == (4, 2, 1)
    assert mutate.detection_order((1,)) == (1,)


def test_suites_of_the_faults_area_run_first_on_their_own():
    specs = catalogue.load()
    available = sorted({s.suite for s in specs.values()})
    first, rest = mutate.suite_phases("zero", available, specs)
    assert first == ["zero"] and sorted(first + rest) == available


def _fake_launch(monkeypatch, statuses_by_suite):
    """_launch writing one results record per suite of the run, with the given status."""
    launched: list[list[str]] = []

    def launch(config):
        suites, out = list(config.suites), config.out
        assert config.faults and config.exitfirst and config.world_sizes == (2, 1)
        launched.append(suites)
        out.mkdir(parents=True, exist_ok=True)
        records = [
            {"kind": "test", "nodeid": f"{s}::t", "status": statuses_by_suite[s], "duration": 1.0}
            for s in suites
        ]
        failed = any(record["status"] == "failed" for record in records)
        end = {"kind": "end", "exitstatus": int(failed)}  # pytest's exit status for them
        lines = [{"kind": "header", "schema": 1}, *records, end]
        (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        return 1, 2.0

    monkeypatch.setattr(mutate, "_launch", launch)
    return launched


def test_a_fault_caught_by_its_area_suites_never_runs_the_rest(monkeypatch, tmp_path):
    launched = _fake_launch(monkeypatch, {"zero": "failed", "placements": "passed"})
    fault = faults.FAULTS["zero.round_robin_partition"]
    result = mutate.fault_run(fault, CONFIG, tmp_path, (["zero"], ["placements"]))
    assert launched == [["zero"]]
    assert result.caught and result.test == "zero::t" and result.wall_seconds == 2.0


def test_a_fault_its_area_missed_goes_on_to_the_other_suites(monkeypatch, tmp_path):
    launched = _fake_launch(monkeypatch, {"zero": "passed", "placements": "failed"})
    fault = faults.FAULTS["zero.round_robin_partition"]
    result = mutate.fault_run(fault, CONFIG, tmp_path, (["zero"], ["placements"]))
    assert launched == [["zero"], ["placements"]]
    assert result.caught and result.test == "placements::t" and result.wall_seconds == 4.0


def _fake_runs(monkeypatch, failing_suites=()):
    """clean_run and fault_run stand-ins: which ran, in which order; no subprocesses."""
    ran: list[str] = []

    def clean_run(config, out, suites):
        ran.append(f"clean:{suites[0]}")
        failed = suites[0] in failing_suites
        unexpected = [f"{suites[0]}::t: failed"] if failed else []
        return {
            "exit_code": int(failed),
            "verdict": "fail" if failed else "pass",
            "seconds": 1.0,
            "tests": 1,
            "unexpected": unexpected,
            "results": str(out),
        }

    def fault_run(fault, config, out, suites, *, cheap_first=None):
        ran.append(f"fault:{fault.id}")
        result = mutate._uncaught(fault)
        result.caught = True
        return result

    monkeypatch.setattr(mutate, "clean_run", clean_run)
    monkeypatch.setattr(mutate, "fault_run", fault_run)
    return ran


CONFIG = RunConfig(world_sizes=(1, 2), suites=("placements", "uneven"))
TWO_FAULTS = ["dtensor.partial_avg_as_sum", "uneven.padding_leaks"]


@pytest.mark.parametrize("jobs", [1, 2])
def test_mutate_runs_every_clean_suite_and_every_fault(monkeypatch, tmp_path, jobs):
    ran = _fake_runs(monkeypatch)
    result = mutate.mutate(replace(CONFIG, out=tmp_path), TWO_FAULTS, jobs=jobs)
    assert sorted(ran) == sorted(
        ["clean:placements", "clean:uneven", *(f"fault:{f}" for f in TWO_FAULTS)]
    )
    assert result.score == (2, 2) and result.void is None and result.finished
    assert result.clean["suite_runs"] == 2 and result.clean["tests"] == 2
    written = json.loads((tmp_path / "mutation.json").read_text())
    by_origin = [{"origin": "written with the property", "caught": 2, "faults": 2}]
    assert written["score"] == {"caught": 2, "faults": 2, "by_origin": by_origin}
    assert written["finished"]
    assert [r["origin"]["label"] for r in written["results"]] == ["written with the property"] * 2


def _result(fault_id, caught):
    result = mutate._uncaught(faults.FAULTS[fault_id])
    result.caught = caught
    return result


def test_the_table_scores_each_origin_and_the_json_says_each_faults(tmp_path, capsys):
    """Written with the property first, then each held-out set in the order it ran."""
    mutation = mutate.Mutation(config={}, clean={"verdict": "pass", "exit_code": 0})
    mutation.results = [
        _result("placements.partial_plus_scalar_kept_partial", True),  # DTensor depth
        _result("dtensor.partial_avg_as_sum", True),
        _result("state_dict.dcp_non_tensor_values_not_loaded", False),  # first set
        _result("placements.to_local_grad_forward_stride", True),  # DTensor depth
        mutate.FaultResult(fault="own", area="a", bug_class="b", summary="s", caught=True),
    ]
    assert mutation.by_origin() == [
        ("written with the property", 1, 1),
        ("blind, DTensor depth set", 2, 2),
        ("blind, first set", 0, 1),
        ("origin not recorded", 1, 1),
    ]
    mutate.print_table(mutation)
    printed = capsys.readouterr().out
    assert printed.endswith(
        "score: 4/5 faults caught\n  written with the property: 1/1\n"
        "  blind, DTensor depth set: 2/2\n  blind, first set: 0/1\n  origin not recorded: 1/1\n"
    )
    mutation.write(tmp_path / "mutation.json")
    written = json.loads((tmp_path / "mutation.json").read_text())
    assert written["results"][2]["origin"] == {
        "label": "blind, first set",
        "written": "blind",
        "held_out": "first",
        "upstream": ["https://github.com/pytorch/pytorch/issues/129079"],
        "survived_before": False,
    }
    assert written["score"]["by_origin"][1] == {
        "origin": "blind, DTensor depth set",
        "caught": 2,
        "faults": 2,
    }


def test_a_void_score_is_not_scored_by_origin_either(capsys):
    mutation = mutate.Mutation(config={}, void="the clean run did not pass")
    mutation.results = [_result("dtensor.partial_avg_as_sum", True)]
    mutate.print_table(mutation)
    assert capsys.readouterr().out.endswith("score: VOID — the clean run did not pass\n")


def test_the_catalogue_listing_says_each_faults_area_and_origin(capsys):
    mutate.print_catalogue()
    printed = capsys.readouterr().out.splitlines()
    assert "dtensor.partial_avg_as_sum  [placements; written with the property]" in printed
    assert "fsdp.meta_init_padded_copy_not_rebound  [fsdp_init; blind, training knobs set]" in (
        printed
    )
    assert printed[-1] == f"{len(faults.FAULTS)} faults"


def test_a_failing_clean_suite_voids_the_score_and_later_fault_runs_do_not_start(
    monkeypatch, tmp_path
):
    ran = _fake_runs(monkeypatch, failing_suites=("uneven",))
    result = mutate.mutate(replace(CONFIG, out=tmp_path), TWO_FAULTS, jobs=1)
    assert sorted(ran) == ["clean:placements", "clean:uneven"]  # and no fault run
    assert result.void and "verdict fail, exit code 1, 1 unexpected outcome(s)" in result.void
    assert [r.problem for r in result.results] == [
        "not run: a clean suite run failed before this fault's run"
    ] * 2
    assert result.score == (0, 2)


def _table(tmp_path, **overrides):
    row = {
        "fault": "dtensor.partial_avg_as_sum",
        "area": "placements",
        "bug_class": "<b>lowered</b>",
        "summary": "avg as sum",
        "caught": True,
        "specs": ["placements.redistribute.roundtrip"],
        "seconds_to_detect": 1.5,
        "examples_to_detect": 3,
        "counterexample": "<script>alert(1)</script>",
        "wall_seconds": 12.0,
        "origin": {
            "label": "blind, DTensor depth set",
            "written": "blind",
            "upstream": ["https://github.com/pytorch/pytorch/issues/1", "javascript:alert(2)"],
        },
    }
    data = {
        "schema": 1,
        "config": {"runner": "threads", "profile": "ci", "world_sizes": "1,2"},
        "clean": {"tests": 10, "seconds": 60.0},
        "results": [row, {**row, "fault": "x.survivor", "caught": False, "specs": []}],
        "score": {
            "caught": 1,
            "faults": 2,
            "by_origin": [{"origin": "blind, DTensor depth set", "caught": 1, "faults": 2}],
        },
        "finished": True,
        "void": None,
        **overrides,
    }
    path = tmp_path / "mutation.json"
    path.write_text(json.dumps(data))
    return path


FIXTURE_RUN = [Path(__file__).resolve().parent / "fixtures" / "report" / "results.jsonl"]


def test_the_report_shows_the_score_each_fault_and_escapes_them(tmp_path):
    html = render_page(build_page(FIXTURE_RUN, mutation_table=_table(tmp_path)))
    assert 'id="mutation"' in html and "1/2 faults caught" in html
    assert "x.survivor" in html and "survived" in html
    assert "<script>alert(1)</script>" not in html and "&lt;b&gt;lowered" in html


def test_the_report_scores_each_origin_and_links_only_http_reports(tmp_path):
    html = render_page(build_page(FIXTURE_RUN, mutation_table=_table(tmp_path)))
    assert "By origin: blind, DTensor depth set <strong>1/2</strong>" in html
    assert '<a href="https://github.com/pytorch/pytorch/issues/1">' in html
    assert "javascript:alert(2)" not in html


def test_a_table_of_faults_without_origins_still_renders(tmp_path):
    table = _table(tmp_path)
    data = json.loads(table.read_text())
    for row in data["results"]:
        del row["origin"]
    del data["score"]["by_origin"]
    table.write_text(json.dumps(data))
    html = render_page(build_page(FIXTURE_RUN, mutation_table=table))
    assert "1/2 faults caught" in html and "By origin" not in html


def test_a_void_score_says_why(tmp_path):
    table = _table(tmp_path, void="clean failed")
    html = render_page(build_page(FIXTURE_RUN, mutation_table=table))
    assert "score void" in html and "clean failed" in html


def test_a_malformed_table_is_a_report_error(tmp_path):
    path = tmp_path / "mutation.json"
    path.write_text("{not json")
    with pytest.raises(ReportError, match=r"mutation\.json' is malformed"):
        build_page(FIXTURE_RUN, mutation_table=path)


def test_the_launcher_runs_each_run_in_a_process_of_its_own(tmp_path):
    from harness.mutation import launcher

    common = RunConfig(suites=("placements",), world_sizes=(2,))
    select = ["-k", "distribute_tensor_matches_model"]
    faulty = replace(
        common,
        out=tmp_path / "faulty",
        faults=("dtensor.partial_avg_as_sum", "dtensor.partial_reduced_twice"),
    )
    assert launcher.run(faulty, tmp_path / "faulty.txt", extra=select) == 1
    assert "1 unexpected outcome(s)" in (tmp_path / "faulty.txt").read_text()
    clean = replace(common, out=tmp_path / "clean")
    assert launcher.run(clean, tmp_path / "clean.txt", extra=select) == 0  # nothing leaked


@pytest.mark.parametrize(
    ("expectation", "unexpected"),
    [({"status": "flaky"}, 0), ({"status": "xfail"}, 1), (None, 1)],
)
def test_a_clean_run_counts_an_unexpected_pass_as_its_verdict_does(
    monkeypatch, tmp_path, expectation, unexpected
):
    """An expected failure that did not show is unexpected, except for a flaky deviation
    (met by some examples only), as in the run's own verdict."""

    def launch(config):
        record = {"kind": "test", "nodeid": "p::t", "status": "xpassed", "duration": 1.0}
        config.out.mkdir(parents=True, exist_ok=True)
        lines = [{"kind": "header", "schema": 1}, {**record, "expectation": expectation}]
        (config.out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        return 0, 1.0

    monkeypatch.setattr(mutate, "_launch", launch)
    clean = mutate.clean_run(CONFIG, tmp_path / "clean", ["placements"])
    assert len(clean["unexpected"]) == unexpected
