"""The distconf command line: ``python -m harness run | list | report | expectations | mutate |
bench``.

Argument parsing and dispatch only: ``run`` is ``harness.session.run``, ``mutate`` is
``harness.mutation.mutate.command``, ``report`` is ``harness.report.render_report``, ``bench``
is ``harness.bench.main``, ``expectations`` is ``harness.outcome.review``. A value an option
does not accept, or an input that cannot be read, is refused before anything runs:
``error: --option=value must be ...`` and exit code 4 (pytest's usage error, which a run's bad
pytest options give too).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from harness import catalogue
from harness.config import (
    DEFAULTS,
    MUTATE_OUT,
    RUN_OPTIONS,
    TORCHRUN_OPTIONS,
    RunConfig,
    as_option,
    from_options,
    split_names,
)
from harness.errors import (
    CatalogueError,
    ExpectationError,
    FaultError,
    InvalidArgument,
    ReportError,
    check_int,
)
from harness.outcome import outputs
from harness.profiles import PROFILES
from harness.runners import RUNNERS

USAGE_ERROR = 4
_REFUSED = (InvalidArgument, FaultError, ReportError, CatalogueError, ExpectationError)
"""Errors in what the user gave (options, fault files, results, catalogue): a usage error."""


class _Parser(argparse.ArgumentParser):
    """argparse, refusing a malformed command line with distconf's usage-error code."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def _run(args: argparse.Namespace) -> int:
    from harness import session

    junit = Path(args.junit) if args.junit else None
    jobs = args.jobs
    if jobs is None:  # torchrun's agents attach to one driver
        jobs = 1 if args.runner == "torchrun" else _usable_cpus()
    config = _config(args, junit=junit, workers=jobs, reach=args.reach)
    try:
        return session.run(config, extra=args.pytest_args)
    except InvalidArgument as exc:  # the machine refused the options (session.run checks it)
        raise as_option(exc) from None


def _config(args: argparse.Namespace, **more: Any) -> RunConfig:
    """The run options of ``run`` and ``mutate`` as a validated RunConfig; a refused value is
    named as its option (``--world-sizes``)."""
    try:
        return from_options(
            vars(args),
            test_timeout=args.test_timeout,
            profile=args.profile,
            seed=args.seed,
            suites=split_names(args.suite),
            out=Path(args.out),
            **more,
        )
    except InvalidArgument as exc:
        raise as_option(exc, {"workers": "--jobs"}) from None


def _list(args: argparse.Namespace) -> int:
    path = Path(args.catalogue) if args.catalogue else catalogue.DEFAULT_PATH
    print(catalogue.describe(catalogue.load(path)))
    return 0


def _report(args: argparse.Namespace) -> int:
    from harness.report import render_report

    html = render_report(
        [Path(p) for p in args.results],
        Path(args.output),
        baseline=[Path(p) for p in args.baseline],
        catalogue_path=Path(args.catalogue) if args.catalogue else None,
        match=args.match,
        mutation_table=Path(args.mutation) if args.mutation else None,
    )
    print(f"report: {html}")
    return 0


def _mutate(args: argparse.Namespace) -> int:
    from harness import faults
    from harness.mutation import mutate

    fault_files = tuple(str(Path(f).resolve()) for f in split_names(args.fault_file))
    with _named("--fault-file"):
        faults.load_files(fault_files)
    if args.list:
        mutate.print_catalogue()
        return 0
    config = _config(args, fault_files=fault_files)
    fault_ids = split_names(args.faults)
    with _named("--faults"):
        faults.select(fault_ids)
    check_int("--jobs", args.jobs)
    try:
        config.check_outputs()
        with outputs.locked(config.out):  # each of its runs holds its own directory too
            return mutate.command(config, fault_ids, jobs=args.jobs)
    except InvalidArgument as exc:
        raise as_option(exc) from None


@contextlib.contextmanager
def _named(option: str) -> Iterator[None]:
    """A ``FaultError`` in the block names the option its input came from."""
    try:
        yield
    except FaultError as exc:
        raise FaultError(f"{option}: {exc}") from None


def _bench(args: argparse.Namespace) -> int:
    from harness import bench

    return bench.main(
        args.what, args.world_size, args.examples, args.calls, args.trials, args.runner, args.json
    )


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m harness", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the conformance suites")
    _add_run_options(run, out=DEFAULTS.out)
    run.add_argument("--junit", default=None, help="also write JUnit XML here (CI annotations)")
    run.add_argument(
        "--reach",
        action="store_true",
        help="record the DTensor ops the run reaches in OUT/reach (measured by harness reach)",
    )
    run.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="pytest-xdist workers, each with its own Worlds (default: the usable CPUs, here "
        f"{_usable_cpus()}, and 1 on the torchrun runner; 1: one process; a -n among the "
        "pytest arguments wins)",
    )
    run.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    run.set_defaults(handler=_run)
    listing = commands.add_parser("list", help="print the spec catalogue")
    listing.add_argument(
        "--catalogue", default=None, help="catalogue file (default: the packaged one)"
    )
    listing.set_defaults(handler=_list)
    _add_report(commands)
    _add_expectations(commands)
    _add_mutate(commands)
    _add_bench(commands)
    _add_reach(commands)
    return parser


def _add_run_options(parser: argparse.ArgumentParser, *, out: Path) -> None:
    """The options of a run (``RunConfig``): those the plugin takes too from
    ``config.RUN_OPTIONS`` and ``TORCHRUN_OPTIONS``; every default taken from ``DEFAULTS``."""
    parser.add_argument(
        "--suite", action="append", default=[], help="suite name (repeatable or comma-separated)"
    )
    for option in RUN_OPTIONS:
        parser.add_argument(option.spelling, **option.keywords())
    parser.add_argument(
        "--profile",
        choices=PROFILES,
        default=DEFAULTS.profile,
        help=f"hypothesis profile (default: {DEFAULTS.profile})",
    )
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed")
    parser.add_argument(
        "--test-timeout",
        type=float,
        default=DEFAULTS.test_timeout,
        help="seconds one test may take in the driver, a backstop for a hang outside the ranks "
        f"(0: none; default: {DEFAULTS.test_timeout:g})",
    )
    parser.add_argument("--out", default=str(out), help=f"output directory (default: {out})")
    torchrun = parser.add_argument_group("torchrun runner (README: Several machines)")
    for option in TORCHRUN_OPTIONS:
        torchrun.add_argument(option.spelling, **option.keywords())


def _add_report(commands: Any) -> None:
    report = commands.add_parser("report", help="render results as a self-contained HTML page")
    report.add_argument("results", nargs="+", help="results files (or directories of them)")
    report.add_argument("-o", "--output", default=os.path.join("reports", "report.html"))
    report.add_argument(
        "--baseline", action="append", default=[], help="results of another run to compare with"
    )
    report.add_argument(
        "--match",
        choices=("auto", "exact", "spec"),
        default="auto",
        help="pair baseline records by spec+runner+device+world size (exact), by spec+world "
        "size (spec, for thread vs process or CPU vs CUDA runs), or pick (auto)",
    )
    report.add_argument("--catalogue", default=None, help="catalogue file (default: packaged)")
    report.add_argument(
        "--mutation",
        default=None,
        help="a mutation.json of `mutate`: adds the fault table",
    )
    report.set_defaults(handler=_report)


def _expectations(args: argparse.Namespace) -> int:
    from harness.outcome import expectations, review

    results = [Path(p) for p in args.results]
    directory = Path(args.expectations) if args.expectations else expectations.DEFAULT_DIR
    if args.action == "check":
        return review.check(results, directory)
    return review.update(
        results, directory, verified=args.verified, fixed=args.fixed, dry_run=args.dry_run
    )


def _add_expectations(commands: Any) -> None:
    parser = commands.add_parser(
        "expectations", help="what a run says about each known deviation; record a review"
    )
    parser.add_argument(
        "action",
        choices=("check", "update"),
        help="check: list what the run says about each expectation; update: record a review",
    )
    parser.add_argument("results", nargs="+", help="results files (or directories of them)")
    parser.add_argument(
        "--expectations", default=None, help="directory of *.toml (default: specs/expectations)"
    )
    parser.add_argument(
        "--verified",
        action="store_true",
        help="update: add the run's torch to `verified` of deviations it saw as they are known",
    )
    parser.add_argument(
        "--fixed",
        action="store_true",
        help="update: end the `torch` range below the run's torch for deviations it saw fixed",
    )
    parser.add_argument("--dry-run", action="store_true", help="update: print, write nothing")
    parser.set_defaults(handler=_expectations)


def _add_mutate(commands: Any) -> None:
    mutate = commands.add_parser(
        "mutate", help="score the suites against injected faults (clean run, then one per fault)"
    )
    mutate.add_argument(
        "--faults", action="append", default=[], help="fault IDs (default: the whole catalogue)"
    )
    mutate.add_argument("--list", action="store_true", help="print the fault catalogue and exit")
    mutate.add_argument(
        "--fault-file",
        action="append",
        default=[],
        help="a Python file defining FAULTS = (harness.faults.Fault, ...): adds its faults to "
        "the catalogue (repeatable)",
    )
    _add_run_options(mutate, out=MUTATE_OUT)
    mutate.add_argument(
        "--jobs",
        type=int,
        default=_usable_cpus(),
        help=f"suite/fault runs at once (default: the usable CPUs, here {_usable_cpus()})",
    )
    mutate.set_defaults(handler=_mutate)


def _add_bench(commands: Any) -> None:
    bench = commands.add_parser("bench", help="print benchmark figures")
    bench.add_argument(
        "what",
        nargs="?",
        choices=("properties", "overhead", "all", "soak"),
        default="all",
        help="all: properties and overhead; soak: failure injection (not in all)",
    )
    bench.add_argument(
        "--runner",
        choices=tuple(runner for runner in RUNNERS if runner != "torchrun"),
        default=None,
        help="properties (default: threads and local side by side) and soak (default: threads "
        "and processes; local has no soak); overhead times every runner, torchrun's at world "
        "size 4",
    )
    bench.add_argument("--world-size", type=int, default=4, help="for properties and soak")
    bench.add_argument("--examples", type=int, default=300, help="examples per property")
    bench.add_argument(
        "--calls", type=int, default=None, help="world.run calls per row (overhead 300, soak 2000)"
    )
    bench.add_argument("--trials", type=int, default=2, help="spawn-per-check trials per row")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(handler=_bench)


def _add_reach(commands: Any) -> None:
    reach = commands.add_parser(
        "reach", help="which of the ops DTensor has a sharding rule for the runs reached"
    )
    reach.add_argument("dirs", nargs="+", help="runs' output directories (or reach folders)")
    reach.add_argument("--missing", action="store_true", help="list the ops never reached")
    reach.add_argument("--json", default=None, help="also write the figures here")
    reach.set_defaults(handler=_reach)


def _reach(args: argparse.Namespace) -> int:
    from harness.report import reach

    json_path = Path(args.json) if args.json else None
    return reach.command([Path(d) for d in args.dirs], missing=args.missing, json_path=json_path)


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return int(handler(args))
    except _REFUSED as exc:
        print(f"error: {exc}", file=sys.stderr)
    return USAGE_ERROR
