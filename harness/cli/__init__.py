"""The distconf command line: ``python -m harness run | list | report | expectations | mutate |
bench | reach | surface``.

Argument parsing and dispatch only: ``run`` is ``harness.session.run``, ``mutate`` is
``harness.mutation.mutate.command``, ``report`` is ``harness.report.render_report``, ``bench``
is ``harness.bench.main``, ``expectations`` is ``harness.outcome.review``; ``reach`` and
``surface`` are declared in ``measures``, each command's help made by ``help``. A value an option
does not accept, or an input that cannot be read, is refused before anything runs:
``error: --option=value must be ...`` and exit code 4 (pytest's usage error, which a run's bad
pytest options give too).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from harness import catalogue
from harness.cli import measures
from harness.cli.help import PROG, WIDTH, Command, add_command, examples, listed
from harness.config import (
    DEFAULTS,
    MUTATE_OUT,
    RUN_OPTIONS,
    TORCHRUN_OPTIONS,
    RunConfig,
    as_option,
    available_suites,
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
from harness.profiles import PROFILES, describe_profiles
from harness.runners import RUNNERS

USAGE_ERROR = 4
BROKEN_PIPE = 128 + signal.SIGPIPE
"""The exit code of a command whose reader left (``| head``): a shell's for a tool SIGPIPE
ended."""
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
    config = _config(args, junit=junit, workers=jobs, reach=args.reach, surface=args.surface)
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


_ABOUT = textwrap.fill(
    "distconf checks that PyTorch's distributed training stack computes what one device "
    "computes: DTensor placements and programs, uneven shards, fully_shard (FSDP2), HSDP, "
    "tensor parallelism, ZeRO, optimizers, state dicts and DCP checkpoints, on cases "
    "Hypothesis draws, with ranks as threads, processes (gloo, nccl, ...), torchrun's, or "
    "simulated.",
    width=WIDTH,
)
_COMMANDS = {
    "run": Command(
        "run the conformance suites: a row per spec, the verdict, results and an HTML report",
        "Runs the suites (every one unless --suite names some) at each world size, prints a "
        "row per spec and the run's verdict, and writes the results (results*.jsonl) and "
        "report.html to --out. The exit code is the verdict's: 0 pass, 1 fail, 2 "
        "interrupted, 3 crashed or partial, 4 a refused option, 5 nothing checked, 6 a known "
        "deviation changed, 7 one fixed, 8 one not verified on this torch.",
        f"{PROG} run --suite placements --world-sizes 1,2 --profile dev",
        "DTensor placements at 1 and 2 ranks, 10 examples a property",
    ),
    "list": Command(
        "print the spec catalogue: every requirement the suites check",
        "Prints the spec catalogue: each requirement's ID, its suite and what it states.",
        f"{PROG} list",
        "the catalogue",
    ),
    "report": Command(
        "render a run's results as one HTML page, compared with another run's if given",
        "Renders the results of a run (its directory, its results.jsonl, or results*.jsonl "
        "files) as one self-contained HTML page; --baseline compares it with another run.",
        f"{PROG} report reports/latest/results.jsonl -o report.html",
        "the report of the last run",
    ),
    "expectations": Command(
        "what a run says of each known deviation of torch; record a review",
        "check: lists what a run says of each known deviation (specs/expectations/*.toml): "
        "still there, fixed, not verified on its torch. update: records it in those files.",
        f"{PROG} expectations check reports/latest",
        "the known deviations the last run met",
    ),
    "mutate": Command(
        "score the suites: one run per injected fault of torch, and which the suites caught",
        "Runs the suites once clean and once per fault injected into torch's distributed "
        "stack (harness/faults), stopping each at its first failure; prints the score and "
        "writes mutation.json and report.html to --out.",
        f"{PROG} mutate --faults uneven.padding_leaks --suite uneven --world-sizes 2,3",
        "is one fault caught?",
    ),
    "bench": Command(
        "print benchmark figures: examples/s, world.run against spawn-per-check, soak",
        "Prints benchmark figures: examples a second per property and runner (properties), "
        "the cost of a world.run call against a spawn per check (overhead), and calls with "
        "failures injected (soak).",
        f"{PROG} bench properties --examples 50",
        "examples/s, 50 examples a property",
    ),
}


def _parser() -> argparse.ArgumentParser:
    every = _COMMANDS | measures.COMMANDS
    parser = _Parser(
        prog=PROG,
        usage=f"{PROG} [-h] COMMAND [OPTIONS]",
        description=f"{_ABOUT}\n\n{listed(every)}",
        epilog=f"{examples(every)}\n\n'{PROG} COMMAND --help' gives a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # Listed in the description, in the user's words: argparse's own list would say it again.
    commands = parser.add_subparsers(dest="command", required=True, help=argparse.SUPPRESS)
    run = _add_command(commands, "run")
    _add_run_options(run, out=DEFAULTS.out)
    run.add_argument(
        "--junit", default=None, help="also write JUnit XML here, for CI (default: none)"
    )
    run.add_argument(
        "--reach",
        action="store_true",
        help="record the DTensor ops the run reaches in OUT/reach (measured by harness reach)",
    )
    run.add_argument(
        "--surface",
        action="store_true",
        help="record the options each test passes to torch's public API in OUT/surface "
        "(measured by harness surface)",
    )
    run.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="pytest-xdist workers, each with its own Worlds (default: the usable CPUs, here "
        f"{_usable_cpus()}, and 1 on the torchrun runner; 1: one process; a -n among the "
        "pytest arguments wins)",
    )
    run.add_argument(
        "pytest_args", nargs="*", help="more pytest arguments, after -- (-k EXPR, -x, ...)"
    )
    run.set_defaults(handler=_run)
    listing = _add_command(commands, "list")
    listing.add_argument(
        "--catalogue", default=None, help="catalogue file (default: the packaged one)"
    )
    listing.set_defaults(handler=_list)
    _add_report(commands)
    _add_expectations(commands)
    _add_mutate(commands)
    _add_bench(commands)
    measures.add_reach(commands)
    measures.add_surface(commands)
    return parser


def _add_command(commands: Any, name: str) -> argparse.ArgumentParser:
    return add_command(commands, name, _COMMANDS[name])


def _add_run_options(parser: argparse.ArgumentParser, *, out: Path) -> None:
    """The options of a run (``RunConfig``): those the plugin takes too from
    ``config.RUN_OPTIONS`` and ``TORCHRUN_OPTIONS``; every default taken from ``DEFAULTS``."""
    parser.add_argument(
        "--suite",
        action="append",
        default=[],
        metavar="NAME",
        help=f"a suite to run, one of {', '.join(available_suites())} (repeatable or "
        "comma-separated; default: every suite)",
    )
    for option in RUN_OPTIONS:
        parser.add_argument(option.spelling, **option.keywords())
    parser.add_argument(
        "--profile",
        choices=PROFILES,
        default=DEFAULTS.profile,
        help=f"how many examples Hypothesis draws a property: {describe_profiles()} (default: "
        f"{DEFAULTS.profile})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="Hypothesis' seed, to repeat a run (default: none; a random profile draws one and "
        "prints it)",
    )
    parser.add_argument(
        "--test-timeout",
        type=float,
        default=DEFAULTS.test_timeout,
        help="seconds one test may take in the driver, a backstop for a hang outside the ranks "
        f"(0: none; default: {DEFAULTS.test_timeout:g})",
    )
    parser.add_argument(
        "--out",
        default=str(out),
        help=f"where the results files and report.html go; an earlier run's there are moved to "
        f"OUT/earlier/ (default: {out})",
    )
    torchrun = parser.add_argument_group("torchrun runner (README: Several machines)")
    for option in TORCHRUN_OPTIONS:
        torchrun.add_argument(option.spelling, **option.keywords())


def _add_report(commands: Any) -> None:
    report = _add_command(commands, "report")
    report.add_argument(
        "results",
        nargs="+",
        help="a run's results: its directory, its results.jsonl (its workers' files beside it "
        "come with it), or results*.jsonl files",
    )
    output = os.path.join("reports", "report.html")
    report.add_argument(
        "-o", "--output", default=output, help=f"the HTML file to write (default: {output})"
    )
    report.add_argument(
        "--baseline",
        action="append",
        default=[],
        help="results of another run to compare with, as RESULTS (repeatable; default: none)",
    )
    report.add_argument(
        "--match",
        choices=("auto", "exact", "spec"),
        default="auto",
        help="pair baseline records by spec+runner+device+world size (exact), by spec+world "
        "size (spec, for thread vs process or CPU vs CUDA runs), or pick (auto; the default)",
    )
    report.add_argument("--catalogue", default=None, help="catalogue file (default: packaged)")
    report.add_argument(
        "--mutation",
        default=None,
        help="a mutation.json of `mutate`: adds the fault table (default: none)",
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
    parser = _add_command(commands, "expectations")
    parser.add_argument(
        "action",
        choices=("check", "update"),
        help="check: list what the run says about each expectation; update: record a review",
    )
    parser.add_argument(
        "results",
        nargs="+",
        help="a run's results: its directory, its results.jsonl (its workers' files beside it "
        "come with it), or results*.jsonl files",
    )
    parser.add_argument(
        "--expectations",
        default=None,
        help="the directory of known-deviation *.toml files (default: specs/expectations)",
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
    mutate = _add_command(commands, "mutate")
    mutate.add_argument(
        "--faults", action="append", default=[], help="fault IDs (default: the whole catalogue)"
    )
    mutate.add_argument("--list", action="store_true", help="print the fault catalogue and exit")
    mutate.add_argument(
        "--fault-file",
        action="append",
        default=[],
        help="a Python file defining FAULTS = (harness.faults.Fault, ...): adds its faults to "
        "the catalogue (repeatable; default: none)",
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
    bench = _add_command(commands, "bench")
    bench.add_argument(
        "what",
        nargs="?",
        choices=("properties", "overhead", "all", "soak"),
        default="all",
        help="properties: examples/s per property; overhead: world.run against spawn-per-check; "
        "soak: calls with failures injected; all (the default): properties and overhead",
    )
    bench.add_argument(
        "--runner",
        choices=tuple(runner for runner in RUNNERS if runner != "torchrun"),
        default=None,
        help="properties (default: threads and local side by side) and soak (default: threads "
        "and processes; local has no soak); overhead times every runner, torchrun's at world "
        "size 4",
    )
    bench.add_argument(
        "--world-size", type=int, default=4, help="for properties and soak (default: 4)"
    )
    bench.add_argument(
        "--examples", type=int, default=300, help="examples per property (default: 300)"
    )
    bench.add_argument(
        "--calls",
        type=int,
        default=None,
        help="world.run calls per row (default: overhead 300, soak 2000)",
    )
    bench.add_argument(
        "--trials", type=int, default=2, help="spawn-per-check trials per row (default: 2)"
    )
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(handler=_bench)


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    """The command line's exit code; quiet, as a Unix tool, when the reader of its output
    went away (``python -m harness list | head``)."""
    try:
        code = _dispatch(argv)
    except BrokenPipeError:
        return _reader_left()
    except SystemExit:  # argparse's --help and usage errors: what they printed is flushed here
        if not _flushed():
            return _reader_left()
        raise
    return code if _flushed() else _reader_left()


def _dispatch(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return int(handler(args))
    except _REFUSED as exc:
        print(f"error: {exc}", file=sys.stderr)
    return USAGE_ERROR


def _flushed() -> bool:
    """Flush stdout now, where a reader that left is heard, not at the interpreter's exit;
    whether its reader was still there."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return False
    return True


def _reader_left() -> int:
    """End quietly: stdout's reader is gone. What is still buffered goes to /dev/null (the
    interpreter's flush at exit would report the pipe once more), and the exit code is the
    one a shell gives a tool SIGPIPE ended."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return BROKEN_PIPE
