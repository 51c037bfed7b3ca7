"""The fault catalogue and ``mutate``: patches apply and revert exactly, fail loudly when their
target is gone, reach rank processes; detection is read off the results records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from harness import catalogue, faults
from harness.config import RunConfig
from harness.faults import Fault, FaultError, Patch
from harness.mutation import mutate
from harness.report.records import ReportError
from harness.report.render import build_page, render_page

MODULE = """
class Owner:
    @staticmethod
    def static(x):
        return x

    def method(self, x):
        return x


def function(x):
    return x
"""


@pytest.fixture
def victim(tmp_path, monkeypatch):
    (tmp_path / "fault_victim.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    import fault_victim

    yield fault_victim
    sys.modules.pop("fault_victim", None)


def _doubled(original):
    return lambda *args: 2 * original(*args)


def test_patches_apply_and_revert_functions_methods_and_staticmethods(victim):
    before = {name: vars(victim.Owner)[name] for name in ("static", "method")}
    fault = Fault(
        id="test.doubled",
        area="placements",
        bug_class="test",
        summary="doubles",
        patches=(
            Patch("fault_victim:function", _doubled),
            Patch("fault_victim:Owner.static", _doubled),
            Patch("fault_victim:Owner.method", _doubled),
        ),
    )
    undo = fault.apply()
    assert victim.function(3) == 6
    assert victim.Owner.static(3) == 6 and victim.Owner().static(3) == 6
    assert victim.Owner().method(3) == 6
    undo()
    assert victim.function(3) == 3
    assert {name: vars(victim.Owner)[name] for name in before} == before


def test_a_fault_applies_all_of_its_patches_or_none(victim):
    fault = Fault(
        id="test.half",
        area="placements",
        bug_class="test",
        summary="second target is gone",
        patches=(Patch("fault_victim:function", _doubled), Patch("fault_victim:gone", _doubled)),
    )
    with pytest.raises(FaultError, match="'gone' does not exist in torch"):
        fault.apply()
    assert victim.function(3) == 3


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("fault_victim:Owner.gone", "'gone' does not exist"),
        ("fault_victim:Missing.static", "'Missing' does not exist"),
        ("no_such_module_here:f", "cannot import no_such_module_here"),
        ("fault_victim.function", "must look like 'package.module:Owner.name'"),
    ],
)
def test_a_missing_target_is_a_loud_error_naming_it(victim, target, message):
    with pytest.raises(FaultError, match=message):
        Patch(target, _doubled).apply()


@pytest.mark.parametrize("fault", list(faults.FAULTS.values()), ids=lambda f: f.id)
def test_every_catalogued_fault_applies_to_this_torch_and_reverts(fault):
    targets = [patch._resolve() for patch in fault.patches]
    before = [vars(owner).get(name, owner.__dict__.get(name)) for owner, name in targets]
    undo = fault.apply()
    assert [getattr(owner, name) for owner, name in targets] != before
    undo()
    assert [vars(owner).get(name, owner.__dict__.get(name)) for owner, name in targets] == before


def test_the_catalogue_has_unique_ids_in_known_areas_and_covers_the_mission():
    areas = {spec.area for spec in catalogue.load().values()}
    assert len(faults.FAULTS) >= 15
    for fault in faults.FAULTS.values():
        assert fault.area in areas, f"{fault.id}: area={fault.area!r} should be one of {areas}"
        assert fault.summary and fault.bug_class and fault.patches


def test_unknown_fault_ids_are_named():
    with pytest.raises(FaultError, match=r"faults=\['nope'\] are not in the fault catalogue"):
        faults.select(["dtensor.partial_avg_as_sum", "nope"])


def test_activate_exports_to_rank_processes_and_undo_restores(monkeypatch):
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    from torch.distributed.tensor import Partial

    original = Partial._reduce_value
    undo = faults.activate(["dtensor.partial_avg_as_sum"])
    assert Partial._reduce_value is not original
    assert faults.parse(faults.os.environ[faults.ENV_VAR]) == ["dtensor.partial_avg_as_sum"]
    undo()
    assert Partial._reduce_value is original
    assert faults.ENV_VAR not in faults.os.environ


FAULT_FILE = """
from harness.faults import Fault, Patch


def _doubled(original):
    return lambda *args: 2 * original(*args)


FAULTS = (
    Fault(
        id="own.doubled",
        area="placements",
        bug_class="a vendor's own bug",
        summary="doubles",
        patches=(Patch("fault_victim:function", _doubled),),
    ),
)
"""


@pytest.fixture
def fault_file(tmp_path, victim):
    path = tmp_path / "own_faults.py"
    path.write_text(FAULT_FILE)
    yield path
    for fault_id in faults._loaded_files.pop(path.resolve(), ()):
        faults.FAULTS.pop(fault_id)


def test_a_fault_file_adds_its_faults_once_and_activate_exports_it(fault_file, victim, monkeypatch):
    monkeypatch.delenv(faults.FILES_ENV_VAR, raising=False)
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    assert [f.id for f in faults.load_files([fault_file])] == ["own.doubled"]
    assert [f.id for f in faults.load_files([fault_file])] == ["own.doubled"]  # no-op
    undo = faults.activate(["own.doubled"], [str(fault_file)])
    assert victim.function(3) == 6
    assert faults.exported_files() == [str(fault_file.resolve())]
    undo()
    assert victim.function(3) == 3 and faults.FILES_ENV_VAR not in faults.os.environ


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("FAULTS = 3", "must define FAULTS as a tuple of harness.faults.Fault; got int"),
        ("raise ImportError('boom')", "failed to import: ImportError"),
        ("import sys\nsys.exit(0)", r"failed to import: SystemExit\(0\)"),
        ("raise GeneratorExit", "failed to import: GeneratorExit"),
        ("class Stop(BaseException): pass\nraise Stop()", "failed to import: Stop"),
        (
            FAULT_FILE.replace("own.doubled", "dtensor.partial_avg_as_sum"),
            r"ids=\['dtensor.partial_avg_as_sum'\] are already in the catalogue",
        ),
    ],
)
def test_a_bad_fault_file_is_named_with_what_is_wrong(tmp_path, victim, text, message):
    path = tmp_path / "bad_faults.py"
    path.write_text(text)
    with pytest.raises(FaultError, match=message):
        faults.load_files([path])
    with pytest.raises(FaultError, match="does not exist"):
        faults.load_files([tmp_path / "missing.py"])


def test_a_ctrl_c_while_a_fault_file_imports_stays_an_interrupt(tmp_path):
    path = tmp_path / "interrupted_faults.py"
    path.write_text("raise KeyboardInterrupt")
    with pytest.raises(KeyboardInterrupt):
        faults.load_files([path])


def test_mutate_refuses_a_fault_file_that_exits_on_import_naming_it(tmp_path):
    """``sys.exit(0)`` in a fault file is a usage error naming the file, never "every fault
    caught" (exit 0) before anything ran."""
    path = tmp_path / "exits.py"
    path.write_text("import sys\nsys.exit(0)\n")
    command = [sys.executable, "-m", "harness", "mutate", "--fault-file", str(path), "--jobs",
               "1", "--out", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )  # fmt: skip
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"error: --fault-file: fault file {str(path)!r} failed to import: SystemExit(0)" in (
        done.stderr
    )
    assert not (tmp_path / "out").exists()


RANK_PROBE = """
import pytest

def patched_name(ctx):
    from torch.distributed.tensor import Partial
    return Partial._reduce_value.__name__

def test_every_rank_sees_the_fault(world):
    assert world.run(patched_name) == ["reduce_value"] * world.world_size
"""


@pytest.mark.parametrize("runner", ["threads", "processes"])
def test_a_fault_reaches_every_rank_and_the_header(pytester, runner):
    pytester.makepyfile(test_probe=RANK_PROBE)
    results = pytester.path / "r.jsonl"
    run = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        f"--runner={runner}",
        "--world-sizes=2",
        "--distconf-faults=dtensor.partial_avg_as_sum",
        f"--distconf-results={results}",
    )
    run.assert_outcomes(passed=1)
    header = json.loads(results.read_text().splitlines()[0])
    assert header["faults"] == ["dtensor.partial_avg_as_sum"]


OWN_PARTIAL_FAULT = """
from harness.faults import Fault, Patch


TARGET = "torch.distributed.tensor.placement_types:Partial._reduce_value"


def _renamed(original):
    def own_reduce(*args):
        return original(*args)

    return own_reduce


FAULTS = (
    Fault(
        id="own.renamed",
        area="placements",
        bug_class="test",
        summary="renames Partial._reduce_value",
        patches=(Patch(TARGET, _renamed),),
    ),
)
"""


@pytest.mark.parametrize("runner", ["threads", "processes"])
def test_a_fault_file_reaches_every_rank(pytester, runner):
    (pytester.path / "own_faults.py").write_text(OWN_PARTIAL_FAULT)
    pytester.makepyfile(test_probe=RANK_PROBE.replace('"reduce_value"', '"own_reduce"'))
    run = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        f"--runner={runner}",
        "--world-sizes=2",
        "--distconf-faults=own.renamed",
        f"--distconf-fault-files={pytester.path / 'own_faults.py'}",
    )
    run.assert_outcomes(passed=1)


def test_an_unknown_fault_option_is_a_usage_error(pytester):
    pytester.makepyfile(test_probe="def test_x():\n    pass\n")
    run = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--distconf-faults=nope")
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    assert "--distconf-faults: faults=['nope'] are not in the fault catalogue" in run.stderr.str()


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
    assert written["score"] == {"caught": 2, "faults": 2} and written["finished"]


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
    }
    data = {
        "schema": 1,
        "config": {"runner": "threads", "profile": "ci", "world_sizes": "1,2"},
        "clean": {"tests": 10, "seconds": 60.0},
        "results": [row, {**row, "fault": "x.survivor", "caught": False, "specs": []}],
        "score": {"caught": 1, "faults": 2},
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
