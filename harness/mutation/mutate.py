"""``python -m harness mutate``: the detection score of the suites against the fault catalogue.

One clean run (its verdict must be a pass, or the score is void), and one run per fault
with the fault injected (``--distconf-faults``): the suites of the fault's area on their own
first, then, if they did not catch it, the others. With ``--jobs N`` the clean run is
split into one run per suite and N runs go at once, clean suites first: a fault run that
would start after a clean suite failed is not started. A fault run starts with the suites of
the fault's area and stops at the first failure: the fault is *caught* by the first test
``harness.outcome.verdict`` says the run caught (an outcome its triage calls unexpected, as a clean
run's verdict would: a flaky deviation that did not show is not one; or a test the session
died running), after the time and the number of examples the record says, with the shrunk
counterexample hypothesis printed. A phase that did not run to its end and caught nothing
says nothing about the fault (a problem, never "survived"). Every run is a ``session.run``
in a process of its own (forked from one that already imported torch:
``harness.mutation.launcher``) with its own results directory, so a fault can never leak
into another run, and ``mutation.json`` is rewritten after every run: an interrupted
command keeps what it measured.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from harness import catalogue, faults, session
from harness.config import RunConfig
from harness.errors import check_int
from harness.mutation import launcher
from harness.outcome import verdict
from harness.outcome.results import read_results
from harness.outcome.verdict import RunVerdict

SCHEMA = 1
NO_ORIGIN = "origin not recorded"


@dataclass
class FaultResult:
    fault: str
    area: str
    bug_class: str
    summary: str
    caught: bool
    origin: dict[str, Any] = field(default_factory=dict)
    """How the fault was written (``harness.faults.Origin.record``): its ``label``, and for a
    blind fault its held-out set and the upstream reports it re-creates."""
    specs: list[str] = field(default_factory=list)
    """The specs whose tests failed under the fault."""
    test: str | None = None
    """The first failing test."""
    status: str | None = None
    seconds_to_detect: float | None = None
    """Suite time until the first failing example: the earlier tests' durations plus the
    failing test's time to its first failing example (shrinking excluded)."""
    examples_to_detect: int | None = None
    counterexample: str | None = None
    wall_seconds: float = 0.0
    """The whole fault run: process start, collection, detection and shrinking."""
    problem: str | None = None
    """Why the run says nothing about the fault (it could not start, wrote no results)."""


@dataclass
class Mutation:
    config: dict[str, Any]
    clean: dict[str, Any] | None = None
    results: list[FaultResult] = field(default_factory=list)
    void: str | None = None
    finished: bool = False

    @property
    def score(self) -> tuple[int, int]:
        return sum(r.caught for r in self.results), len(self.results)

    def by_origin(self) -> list[tuple[str, int, int]]:
        """The score of each origin (label, caught, faults): faults written with the property
        first, then each held-out set, then the rest, each in the order its first fault ran."""
        caught: dict[str, int] = {}
        total: dict[str, int] = {}
        rank: dict[str, int] = {}
        for result in self.results:
            label = result.origin.get("label", NO_ORIGIN)
            rank.setdefault(label, _origin_rank(result.origin))
            caught[label] = caught.get(label, 0) + result.caught
            total[label] = total.get(label, 0) + 1
        ordered = sorted(total, key=rank.__getitem__)  # stable: first come, first listed
        return [(label, caught[label], total[label]) for label in ordered]

    def write(self, path: Path) -> None:
        caught, total = self.score
        by_origin = [
            {"origin": label, "caught": c, "faults": n} for label, c, n in self.by_origin()
        ]
        data = {
            "schema": SCHEMA,
            **asdict(self),
            "score": {"caught": caught, "faults": total, "by_origin": by_origin},
        }
        path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def suite_phases(
    area: str, available: Sequence[str], specs: dict[str, catalogue.Spec]
) -> tuple[list[str], list[str]]:
    """``available`` split in two: the suites that hold specs of ``area``, and the rest."""
    first = list(dict.fromkeys(s.suite for s in specs.values() if s.area == area))
    return [s for s in first if s in available], [s for s in available if s not in first]


def detection_order(world_sizes: tuple[int, ...]) -> tuple[int, ...]:
    """``world_sizes`` with size 1 last: the plugin runs every test of a size before the
    next size, a distributed fault rarely shows on one rank, and a fault run stops at its
    first failure (``(1, 2, 3, 4)`` -> ``(2, 3, 4, 1)``)."""
    return tuple(s for s in world_sizes if s != 1) + tuple(s for s in world_sizes if s == 1)


def _launch(config: RunConfig) -> tuple[int, float]:
    """``session.run(config)`` in a process of its own, its output in ``config.out/log.txt``;
    exit code and seconds."""
    config.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    code = launcher.run(config, config.out / "log.txt")
    return code, time.perf_counter() - started


def judged(out: Path) -> tuple[RunVerdict, list[dict[str, Any]]]:
    """The verdict on the run in ``out`` (``harness.outcome.verdict``, as ``harness run`` gives it)
    and its test records in the order they were written."""
    read = [(str(path), read_results(path)) for path in sorted(out.glob("results*.jsonl"))]
    return verdict.of_results(read), [record for _, results in read for record in results.tests]


def clean_run(config: RunConfig, out: Path, suites: Sequence[str]) -> dict[str, Any]:
    """Run the suites without faults; report whether the run can anchor a score."""
    code, seconds = _launch(replace(config, out=out, suites=tuple(suites)))
    run, tests = judged(out)
    return {
        "exit_code": code,
        "verdict": run.kind,
        "seconds": round(seconds, 1),
        "tests": len(tests),
        "unexpected": [f"{r.get('nodeid')}: {r.get('status')}" for r in run.caught],
        "results": str(out),
    }


def fault_run(
    fault: faults.Fault,
    config: RunConfig,
    out: Path,
    phases: Sequence[Sequence[str]],
    *,
    cheap_first: tuple[Path, ...] = (),
) -> FaultResult:
    """Run each phase's suites with ``fault`` injected, stopping after the first phase
    that caught it (``harness.outcome.verdict``: pytest's ``--exitfirst`` stops a phase at its first
    failure, not at a non-strict unexpected pass, which a flaky deviation may give).

    The fault's area suites go first in a run of their own: within one run the plugin takes
    every suite at a world size before the next size, and most faults only show from world
    size 2 on, so one run of all suites would pass through every suite at size 1 first.
    ``cheap_first``: the clean run's results, so that within a world size the tests it
    timed fastest go first."""
    faulty = replace(
        config,
        faults=(fault.id,),
        exitfirst=True,
        cheap_first=cheap_first,
        world_sizes=detection_order(config.world_sizes),
    )
    result = _uncaught(fault)
    tests: list[dict[str, Any]] = []
    for number, suites in enumerate((p for p in phases if p), start=1):
        where = out / f"phase-{number}"
        code, seconds = _launch(replace(faulty, out=where, suites=tuple(suites)))
        result.wall_seconds = round(result.wall_seconds + seconds, 1)
        run, found = judged(where)
        tests += found
        if run.caught:
            _note_detection(result, tests, run.caught)
            return result
        if not found or not run.finished:
            said = f"{run.kind}: {run.headline}" if found else "it wrote no test records"
            ended = f"signal {-code}" if code < 0 else f"exit code {code}"
            result.problem = f"the run of {', '.join(suites)} ({ended}) did not finish: {said}"
            result.problem += f"; see {where / 'log.txt'}"
            return result
    return result


def _note_detection(
    result: FaultResult, tests: Sequence[Mapping[str, Any]], caught: Sequence[Mapping[str, Any]]
) -> None:
    """``result`` caught by ``caught[0]`` (a record of ``tests``, or a test that recorded no
    outcome, after them all), after the earlier tests' time; every caught test's spec."""
    first = caught[0]
    elapsed = 0.0
    for record in tests:
        if record is first:
            break
        elapsed += record.get("duration") or 0.0
    to_failure = first.get("seconds_to_failure")
    elapsed += to_failure if to_failure is not None else first.get("duration") or 0.0
    result.caught = True
    result.test = str(first.get("nodeid"))
    result.status = str(first.get("status"))
    result.seconds_to_detect = round(elapsed, 2)
    result.examples_to_detect = first.get("examples_to_failure")
    result.counterexample = first.get("falsifying_example") or first.get("error")
    result.specs = list(dict.fromkeys(str(r["spec"]) for r in caught if r.get("spec")))


def mutate(config: RunConfig, fault_ids: Sequence[str], *, jobs: int = 1) -> Mutation:
    """The clean run and every fault, under ``config.out``; ``mutation.json`` there is kept
    current throughout. ``config`` describes every run (its suites: all when empty)."""
    check_int("jobs", jobs)
    faults.load_files(config.fault_files)
    selected = faults.select(fault_ids or list(faults.FAULTS))
    specs = catalogue.load()
    out = config.out
    available = list(config.suites) or sorted({s.suite for s in specs.values()})
    mutation = Mutation(config=_config_record(config, selected, jobs))
    (out / "clean").mkdir(parents=True, exist_ok=True)
    table = out / "mutation.json"
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        clean_parts = [
            pool.submit(clean_run, config, out / "clean" / suite, (suite,))
            for suite in longest_first(available)
        ]

        def one(fault: faults.Fault) -> FaultResult:
            if any(part.done() and not _passed(part.result()) for part in clean_parts):
                result = _uncaught(fault)
                result.problem = "not run: a clean suite run failed before this fault's run"
                return result
            phases = suite_phases(fault.area, available, specs)
            return fault_run(
                fault, config, out / "faults" / fault.id, phases, cheap_first=(out / "clean",)
            )

        width = _fault_width(fault.id for fault in selected)
        for result in pool.map(one, selected):
            mutation.results.append(result)
            mutation.clean = _merged([p.result() for p in clean_parts if p.done()], out / "clean")
            mutation.write(table)
            print(_row(result, width), flush=True)
        mutation.clean = _merged([p.result() for p in clean_parts], out / "clean")
    if not _passed(mutation.clean):
        mutation.void = (
            f"the clean run did not pass (verdict {mutation.clean['verdict']}, exit code "
            f"{mutation.clean['exit_code']}, {len(mutation.clean['unexpected'])} unexpected "
            "outcome(s)): a fault cannot be told from a failure that is already there"
        )
    mutation.finished = True
    mutation.write(table)
    return mutation


# Clean-run seconds of each suite (threads, CPU, world sizes 1-4, ci profile, 2026-11-24):
# the longest start first, so that the short fault runs fill the gaps instead of a long
# suite starting last. Only an order: a suite missing here goes after these.
_CLEAN_SECONDS = {
    "tp": 496,
    "optim_parity": 419,
    "state_dict": 320,
    "hsdp": 286,
    "fsdp_init": 254,
    "zero": 123,
    "uneven": 49,
    "placements": 43,
}


def longest_first(suites: Sequence[str]) -> list[str]:
    return sorted(suites, key=lambda suite: -_CLEAN_SECONDS.get(suite, 0))


def _passed(clean: dict[str, Any]) -> bool:
    """Whether a clean run can anchor a score: its verdict a pass (``harness.outcome.verdict``)."""
    return bool(clean["verdict"] == "pass" and clean["exit_code"] == 0)


def _merged(parts: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """One clean-run entry for the per-suite clean runs finished so far."""
    return {
        "exit_code": next((p["exit_code"] for p in parts if p["exit_code"] != 0), 0),
        "verdict": next((p["verdict"] for p in parts if p["verdict"] != "pass"), "pass"),
        "seconds": round(sum(p["seconds"] for p in parts), 1),
        "tests": sum(p["tests"] for p in parts),
        "unexpected": [entry for p in parts for entry in p["unexpected"]],
        "results": str(out),
        "suite_runs": len(parts),
    }


def _uncaught(fault: faults.Fault) -> FaultResult:
    return FaultResult(
        fault=fault.id,
        area=fault.area,
        bug_class=fault.bug_class,
        summary=fault.summary,
        caught=False,
        origin=fault.origin.record(),
    )


def _origin_rank(origin: Mapping[str, Any]) -> int:
    """Where an origin comes in ``Mutation.by_origin``: in the order of ``faults.WRITTEN``
    (with the property, blind, not stated), a result without one last."""
    written = origin.get("written")
    return faults.WRITTEN.index(written) if written in faults.WRITTEN else len(faults.WRITTEN)


def _fault_width(ids: Iterable[str]) -> int:
    return max([38, *map(len, ids)])


def _row(result: FaultResult, width: int) -> str:
    verdict = "NO RESULT" if result.problem else "caught" if result.caught else "SURVIVED"
    detect = (
        f"{result.seconds_to_detect:>8.1f}s {result.examples_to_detect or '-':>5}"
        if result.caught and result.seconds_to_detect is not None
        else f"{'-':>9} {'-':>5}"
    )
    specs = ", ".join(result.specs) or result.problem or "-"
    return f"{result.fault:<{width}} {verdict:<9} {detect} {result.wall_seconds:>7.1f}s  {specs}"


def _config_record(config: RunConfig, selected: list[faults.Fault], jobs: int) -> dict[str, Any]:
    """What ``mutation.json`` says of the runs (its schema 1: world sizes as the option
    spells them)."""
    return {
        "runner": config.runner,
        "device": config.device,
        "profile": config.profile,
        "world_sizes": config.world_sizes_text,
        "rank_timeout": config.rank_timeout,
        "suites": list(config.suites),
        "fault_files": list(config.fault_files),
        "faults": [fault.id for fault in selected],
        "jobs": jobs,
    }


def command(config: RunConfig, fault_ids: Sequence[str], *, jobs: int) -> int:
    """``python -m harness mutate``: score, table, report; 0 when every fault was caught, 1
    when one survived, 2 when the clean run failed (the score is void). (A command refused
    before anything ran exits with ``cli.USAGE_ERROR``, 4.)"""
    result = mutate(config, fault_ids, jobs=jobs)
    print_table(result)
    table = config.out / "mutation.json"
    if result.clean:
        suite_runs = sorted(p for p in Path(result.clean["results"]).iterdir() if p.is_dir())
        session.write_report(suite_runs, config.out / "report.html", table)
    print(f"table: {table}")
    caught, total = result.score
    return 2 if result.void else int(caught < total)


def print_catalogue() -> None:
    """``mutate --list``: every fault of the catalogue (fault files loaded)."""
    for fault in faults.FAULTS.values():
        where = f"{fault.area}; {fault.origin.label}"
        print(f"{fault.id}  [{where}]\n    {fault.summary}\n    stands for: {fault.bug_class}")
    print(f"{len(faults.FAULTS)} faults")


def print_table(mutation: Mutation) -> None:
    width = _fault_width(result.fault for result in mutation.results)
    print(f"\n{'fault':<{width}} {'verdict':<9} {'detect':>9} {'ex.':>5} {'run':>8}  caught by")
    for result in mutation.results:
        print(_row(result, width))
    caught, total = mutation.score
    if mutation.void:
        print(f"score: VOID — {mutation.void}")
    else:
        print(f"score: {caught}/{total} faults caught")
        for label, caught_here, faults_here in mutation.by_origin():
            print(f"  {label}: {caught_here}/{faults_here}")
