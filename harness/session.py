"""A conformance run: the one place distconf calls ``pytest.main`` for one.

``run(config)`` is ``python -m harness run``: it runs the suites through pytest with the
distconf plugin, prints a row per spec and writes the HTML report. Each of ``mutate``'s runs
is ``run`` in a process of its own (``harness.mutation.launcher``); ``harness bench`` times
properties through ``run_pytest``.
"""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness import catalogue, forked
from harness.config import RunConfig, suite_paths
from harness.errors import ReportError
from harness.outcome import junit, noise, outputs, triage, verdict
from harness.outcome.results import SEVERITY, append_records, read_results
from harness.outcome.verdict import RunVerdict
from harness.profiles import needs_seed
from harness.torchkit import reach, surface

RESULTS = "results.jsonl"
"""The results file of a run under ``config.out`` (``results.gwN.jsonl`` per xdist worker)."""
USAGE_ERROR = 4
"""pytest's exit code when it refused its command line or configuration."""


def pytest_arguments(
    config: RunConfig,
    *,
    tests: Sequence[str] = (),
    extra: Sequence[str] = (),
    run_id: str | None = None,
) -> list[str]:
    """pytest's command line for ``config``; ``tests``: node IDs relative to the suites
    directory, instead of the configured suites; ``run_id``: the run's identity, which a
    ``harness run`` gives to read back only its own results and which has the earlier run's
    records in ``config.out`` moved aside once pytest has checked its own configuration."""
    selected = [str(catalogue.DEFAULT_SUITES / t) for t in tests] or map(str, suite_paths(config))
    arguments = [
        *selected,
        "-p",
        "harness.plugin",
        *config.spelled,
        # A backstop for a driver-side hang; ranks are bounded by --rank-timeout per call.
        f"--timeout={config.test_timeout}",
        f"--hypothesis-profile={config.profile}",
        f"--distconf-results={config.out / RESULTS}",
        "-p",
        "no:cacheprovider",
        # harness is imported before pytest starts; its modules need no assertion rewriting.
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
        "-q",
        # pytest's own styles parse the whole source file of every frame of a failure (and of
        # the rank exception it chains to, deep in torch) each time it is formatted, and
        # hypothesis formats each falsifying example three times: about a tenth of a run's
        # driver time went there. A `-- --tb=long` given to `harness run` still wins.
        "--tb=native",
    ]
    if config.seed is not None:
        arguments += ["--hypothesis-seed", str(config.seed)]
    if config.junit is not None:
        arguments += [f"--junitxml={config.junit}", "-o", "junit_family=xunit2"]
    if config.strict_collectives:
        arguments.append("--strict-collectives")
    if config.faults:
        arguments.append(f"--distconf-faults={','.join(config.faults)}")
    if config.fault_files:
        arguments.append(f"--distconf-fault-files={','.join(config.fault_files)}")
    if config.cheap_first:
        arguments.append(f"--distconf-cheap-first={','.join(map(str, config.cheap_first))}")
    if config.exitfirst:
        arguments.append("--exitfirst")
    if run_id is not None:
        arguments += [f"--distconf-run-id={run_id}", "--distconf-keep-earlier"]
    if config.workers > 1 and not _names_workers(extra):
        arguments += ["-n", str(config.workers)]
    # Only xdist's controller reads it: inert in a run of one process.
    arguments.append("--distconf-schedule=worlds")
    return [*arguments, *extra]


def run_pytest(config: RunConfig, *, tests: Sequence[str] = (), extra: Sequence[str] = ()) -> int:
    """pytest over the suites as ``config`` says; its exit code."""
    import pytest

    return int(pytest.main(pytest_arguments(config, tests=tests, extra=extra)))


def _names_workers(extra: Sequence[str]) -> bool:
    """Whether the extra pytest arguments choose xdist's workers themselves (they win)."""
    return any(
        a in ("-n", "--numprocesses") or a.startswith(("-n", "--numprocesses=")) for a in extra
    )


def with_seed(config: RunConfig) -> RunConfig:
    """A random profile's run must still be reproducible: draw a seed and say it."""
    if config.seed is not None or not needs_seed(config.profile):
        return config
    seed = random.randrange(2**32)
    print(f"distconf: hypothesis seed {seed} (reproduce with --seed {seed})")
    return replace(config, seed=seed)


def run(config: RunConfig, *, extra: Sequence[str] = ()) -> int:
    """``python -m harness run``: the suites, a row per spec, ``report.html``; the exit code
    of the run's verdict (``harness.outcome.verdict``), or pytest's where pytest refused to run.

    Everything is checked before anything is written: the options (``RunConfig``), the
    outputs, the plugins, the device, the backend and the world sizes this machine can hold.
    The run holds ``config.out`` (``outputs.locked``: a second run there is refused) and
    reads back only the results files its own pytest wrote (their ``run_id``). pytest moves
    an earlier run's records aside (``outputs.keep_earlier``), never deletes them, once it
    has checked its own configuration. With ``config.reach``, every process of the run records
    the DTensor ops it reaches in ``OUT/reach`` (``torchkit.reach``, through
    ``$DISTCONF_REACH_DIR``); with ``config.surface``, every pytest process the options its
    tests pass to torch's public API in ``OUT/surface`` (``torchkit.surface``, through
    ``$DISTCONF_SURFACE_DIR``)."""
    config.check_outputs()
    config.check_machine()
    with outputs.locked(config.out):
        config = with_seed(config)
        run_id = outputs.new_run_id()
        sift = noise.LineFilter()
        exit_code = forked.run_pytest(
            pytest_arguments(config, extra=extra, run_id=run_id),
            results_dir=config.out,
            test_timeout=config.test_timeout,
            environment=_recorders(config),
            sift=sift,
        )
        files, others = outputs.results_of(config.out, run_id)
        if not files:
            if exit_code != USAGE_ERROR:  # pytest said why it refused
                print(
                    f"error: no results were written to {config.out / RESULTS} "
                    f"(pytest exit code {exit_code})",
                    file=sys.stderr,
                )
            return exit_code or 3
        for path in others:
            print(f"warning: {path} was written by another run: it is not read", file=sys.stderr)
        _keep_noise(files, sift)
        judged = summarise(files, say_verdict=False)
        if config.junit is not None:
            junit.add_verdict(config.junit, judged)
        report_code = write_report(files, config.out / outputs.REPORT)
        say(judged)  # the last line of the run
    return judged.exit_code or exit_code or report_code


def _recorders(config: RunConfig) -> dict[str, str]:
    """The environment that turns on the recorders the run asks for."""
    environment = {}
    if config.reach:
        environment[reach.ENV_VAR] = str(config.out / outputs.REACH)
    if config.surface:
        environment[surface.ENV_VAR] = str(config.out / outputs.SURFACE)
    return environment


def _keep_noise(files: list[Path], sift: noise.LineFilter) -> None:
    """The stderr lines of torch's known noise the run's console was spared, counted in the
    run's main results file (its controller's, which pytest has closed)."""
    found = sift.records()
    if found:
        main = [path for path in files if not (outputs.header_of(path) or {}).get("worker")]
        append_records((main or files)[0], found)


def _print_triage(read: dict[Path, Any], tests: list[dict[str, Any]]) -> None:
    """What the run says about known deviations, per spec, for the torch it ran."""
    found = triage.findings(map(triage.seen, tests))
    if not found:
        return
    torch = ", ".join(triage.releases(r.header for r in read.values())) or "this torch"
    print(f"\ntorch {torch}:")
    for category in triage.CATEGORIES:
        lines = [triage.describe(f, torch) for f in found if f.category == category]
        if lines:
            print(f"  {triage.TITLES[category]} ({len(lines)} spec(s)):")
            print("\n".join(f"    {line}" for line in lines))


def write_report(files: list[Path], html: Path, mutation_table: Path | None = None) -> int:
    """Render ``files`` into ``html``; 0, or 1 with the reason printed when it cannot."""
    from harness.report import render_report

    try:
        render_report(files, html, mutation_table=mutation_table)
    except ReportError as exc:
        print(f"error: no report: {exc}", file=sys.stderr)
        return 1
    print(f"report: {html}")
    return 0


def summarise(paths: list[Path], *, say_verdict: bool = True) -> RunVerdict:
    """Print a row per spec (status per world size), torch's known noise kept off the
    console and (``say_verdict``) the run's verdict; return it."""
    read = {path: read_results(path) for path in paths}
    tests = [record for results in read.values() for record in results.tests]
    rows: dict[str, dict[Any, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for record in tests:
        rows[record.get("spec") or "(no spec)"][record.get("world_size")].append(record)
    sizes = sorted({r.get("world_size") for r in tests}, key=lambda s: (s is None, s))
    print(f"\ndistconf results: {', '.join(map(str, paths))}")
    header = (
        f"{'spec':<48}"
        + "".join(f"{'ws' + str(s):>16}" for s in sizes)
        + f"{'examples':>10}{'seconds':>9}"
    )
    print(header)
    print("-" * len(header))
    for spec in sorted(rows):
        cells, examples, seconds = [], 0, 0.0
        for size in sizes:
            records = rows[spec].get(size, [])
            statuses = sorted({str(r.get("status")) for r in records}, key=_worst_first)
            examples += sum(r.get("examples") or 0 for r in records)
            seconds += sum(r.get("duration") or 0.0 for r in records)
            cells.append("+".join(statuses) or "-")
        print(f"{spec:<48}" + "".join(f"{c:>16}" for c in cells) + f"{examples:>10}{seconds:>9.1f}")
    for path, results in read.items():
        if results.bad_lines:
            print(f"warning: unreadable lines in {path}: {results.bad_lines}")
        if results.end is None:
            print(f"warning: {path} has no end record: the run did not finish, results are partial")
        if results.schema_problem:
            print(f"warning: {path}: {results.schema_problem}: its records may mean otherwise")
    unexpected = sum(map(verdict.is_unexpected, tests))
    print(f"{unexpected} unexpected outcome(s)")
    _print_triage(read, tests)
    quieted = noise.totals(record for results in read.values() for record in results.noise)
    if quieted:
        print(f"torch's known noise, kept off this console: {noise.describe(quieted)}")
    judged = verdict.of_results([(str(path), results) for path, results in read.items()])
    if say_verdict:
        say(judged)
    return judged


def say(judged: RunVerdict) -> None:
    print(f"verdict: {judged.kind}: {judged.text}", flush=True)


def _worst_first(status: str) -> int:
    return SEVERITY.index(status) if status in SEVERITY else -1
