"""``mutate`` judges its runs as ``harness run`` does (``harness.outcome.verdict``): a fault is
caught only by an outcome the run's triage calls unexpected, never by a flaky deviation that
simply did not show, and a fault run that did not finish says nothing about its fault."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.config import RunConfig
from harness.faults import Fault, Patch
from harness.mutation import mutate
from harness.outcome.results import SCHEMA, ResultsWriter, TestRecord

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = "placements.program.matches_one_device"
FLAKY = {
    "status": "flaky",
    "reason": "met by some draws only",
    "source": "torch-2.13.toml #41",
    "verified": ["2.13.0"],
    "verified_here": True,
}
NOOP = Fault(
    id="own.noop",
    area="placements",
    bug_class="none: its patch puts back what was there",
    summary="patches DTensor.full_tensor with itself",
    patches=(Patch("torch.distributed.tensor:DTensor.full_tensor", lambda original: original),),
)
CONFIG = RunConfig(world_sizes=(1, 2), suites=("placements", "uneven"))
PHASES = (["placements"], ["uneven"])


def _test(name: str, status: str, duration: float = 1.0, **fields: Any) -> TestRecord:
    spec = fields.pop("spec", f"s.{name}")
    return TestRecord(f"{name}[threads-ws2-cpu]", spec, "threads", 2, "cpu", status, duration,
                      **fields)  # fmt: skip


def _flaky_pass(duration: float = 3.0) -> TestRecord:
    """The program property passing where its flaky deviation was expected: an xpass that
    pytest's --exitfirst does not stop at, as on a clean run at the ci profile."""
    return _test("program", "xpassed", duration, spec=PROGRAM, expectation=FLAKY)


def _launching(
    monkeypatch: pytest.MonkeyPatch,
    runs: dict[str, list[TestRecord]],
    *,
    end: dict[str, Any] | None = None,
    started: dict[str, list[str]] | None = None,
) -> list[str]:
    """``mutate._launch`` writing each phase's records with ``ResultsWriter`` as a fault run's
    session would (a start record before each test; ``end``: its end record, None: it
    died); the suites of each run launched, in order."""
    launched: list[str] = []

    def launch(config: RunConfig) -> tuple[int, float]:
        assert config.faults == (NOOP.id,) and config.exitfirst
        suite = ",".join(config.suites)
        launched.append(suite)
        header = {"kind": "header", "schema": SCHEMA, "faults": list(config.faults)}
        writer = ResultsWriter(config.out / "results.jsonl", header)
        for record in runs[suite]:
            writer.write_start(record.nodeid)
            writer.write_test(record)
        for nodeid in (started or {}).get(suite, []):
            writer.write_start(nodeid)
        closing = {"exitstatus": 0} if end is None else end
        if closing:
            writer.close(**closing)
        return int(closing.get("exitstatus", -9)), 2.0

    monkeypatch.setattr(mutate, "_launch", launch)
    return launched


def test_a_fault_that_patches_nothing_survives_where_a_flaky_deviation_passes(
    monkeypatch, tmp_path
):
    launched = _launching(
        monkeypatch,
        {
            "placements": [_test("a", "passed"), _flaky_pass(), _test("b", "passed")],
            "uneven": [_test("c", "passed"), _flaky_pass()],
        },
    )
    result = mutate.fault_run(NOOP, CONFIG, tmp_path, PHASES)
    assert launched == ["placements", "uneven"]  # the flaky pass stopped no phase
    assert not result.caught and result.problem is None and result.specs == []
    assert mutate._row(result, 38).split()[:2] == ["own.noop", "SURVIVED"]


def test_a_fault_caught_by_a_real_failure_is_caught_by_it_not_by_the_flaky_pass(
    monkeypatch, tmp_path
):
    failing = _test("fails", "failed", 9.0, seconds_to_failure=0.5, examples_to_failure=4,
                    falsifying_example="case=X")  # fmt: skip
    launched = _launching(
        monkeypatch,
        {"placements": [_test("a", "passed"), _flaky_pass(3.0), failing], "uneven": []},
        end={"exitstatus": 1},
    )
    result = mutate.fault_run(NOOP, CONFIG, tmp_path, PHASES)
    assert launched == ["placements"]
    assert (result.caught, result.test, result.status) == (True, failing.nodeid, "failed")
    assert result.specs == ["s.fails"]  # not the flaky spec
    assert (result.seconds_to_detect, result.examples_to_detect) == (4.5, 4)
    assert result.counterexample == "case=X"


def test_a_fault_run_cut_short_without_a_catch_is_no_result_not_survived(monkeypatch, tmp_path):
    """An INTERNALERROR after the first test (exit status 3) ended the phase: it says nothing
    of the fault, and the next phase is not run as if this one had passed."""
    launched = _launching(
        monkeypatch,
        {"placements": [_test("a", "passed"), _flaky_pass()], "uneven": [_test("c", "passed")]},
        end={"exitstatus": 3},
    )
    result = mutate.fault_run(NOOP, CONFIG, tmp_path, PHASES)
    assert launched == ["placements"]
    assert not result.caught
    assert result.problem is not None
    assert "the run of placements (exit code 3) did not finish: crashed: Crashed: pytest " in (
        result.problem
    )
    assert mutate._row(result, 38).split()[1:3] == ["NO", "RESULT"]


def test_a_fault_that_kills_the_session_is_caught_by_the_test_it_was_running(monkeypatch, tmp_path):
    launched = _launching(
        monkeypatch,
        {"placements": [_test("a", "passed", 2.0), _flaky_pass(1.0)], "uneven": []},
        end={},
        started={"placements": ["dies[threads-ws2-cpu]"]},
    )
    result = mutate.fault_run(NOOP, CONFIG, tmp_path, PHASES)
    assert launched == ["placements"]
    assert (result.caught, result.test, result.status) == (True, "dies[threads-ws2-cpu]", "crashed")
    assert result.seconds_to_detect == 3.0
    assert "started and recorded no outcome" in (result.counterexample or "")


def test_a_clean_run_with_a_flaky_pass_anchors_the_score(monkeypatch, tmp_path):
    def launch(config: RunConfig) -> tuple[int, float]:
        writer = ResultsWriter(config.out / "results.jsonl", {"kind": "header", "schema": SCHEMA})
        for record in (_test("a", "passed"), _flaky_pass()):
            writer.write_test(record)
        writer.close(exitstatus=0)
        return 0, 1.0

    monkeypatch.setattr(mutate, "_launch", launch)
    clean = mutate.clean_run(CONFIG, tmp_path / "clean", ["placements"])
    assert (clean["verdict"], clean["unexpected"], clean["tests"]) == ("pass", [], 2)
    assert mutate._passed(clean)


NOOP_FILE = """
from harness.faults import Fault, Patch

FAULTS = (
    Fault(
        id="own.noop",
        area="placements",
        bug_class="none: its patch puts back what was there",
        summary="patches DTensor.full_tensor with itself",
        patches=(Patch("torch.distributed.tensor:DTensor.full_tensor", lambda original: original),),
    ),
)
"""


def test_mutate_scores_a_fault_that_patches_nothing_as_surviving(tmp_path):
    """End to end, one suite at world size 2: the program property passes where its flaky
    deviation was expected, on the clean run and with the fault, and the fault survives."""
    (tmp_path / "noop_faults.py").write_text(NOOP_FILE)
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "harness", "mutate", "--suite", "placements", "--world-sizes", "2",
        "--profile", "dev", "--seed", "1", "--fault-file", str(tmp_path / "noop_faults.py"),
        "--faults", "own.noop", "--jobs", "1", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert "score: 0/1 faults caught" in output
    table = json.loads((out / "mutation.json").read_text())
    assert table["clean"]["verdict"] == "pass" and table["void"] is None
    [row] = table["results"]
    assert (row["fault"], row["caught"], row["problem"]) == ("own.noop", False, None)
    records = (out / "faults" / "own.noop" / "phase-1" / "results.jsonl").read_text()
    passed = [json.loads(line) for line in records.splitlines() if '"xpassed"' in line]
    assert [(r["spec"], r["expectation"]["status"]) for r in passed] == [(PROGRAM, "flaky")], (
        "the program property's flaky deviation showed at this seed: choose one where it passes"
    )
