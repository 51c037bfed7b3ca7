"""The distconf command line: ``python -m harness run | list``.

``run`` drives the suites through pytest with the distconf plugin and summarises the results
file it wrote; ``list`` prints the spec catalogue.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from harness import catalogue
from harness.profiles import PROFILES
from harness.results import UNEXPECTED, is_unexpected, read_results
from harness.runners import DEVICES, RUNNERS


def _suite_files(names: list[str]) -> list[Path]:
    available = sorted(
        p.stem.removeprefix("test_") for p in catalogue.DEFAULT_SUITES.glob("test_*.py")
    )
    if not names:
        return [catalogue.DEFAULT_SUITES]
    unknown = [n for n in names if n not in available]
    if unknown:
        raise SystemExit(
            f"error: --suite={','.join(unknown)!r} is not a suite; choose from {available}"
        )
    return [catalogue.DEFAULT_SUITES / f"test_{name}.py" for name in names]


def _split(values: list[str]) -> list[str]:
    return [part for value in values for part in value.split(",") if part]


def _run(args: argparse.Namespace) -> int:
    import pytest

    out = Path(args.out)
    results = out / "results.jsonl"
    for stale in out.glob("results*.jsonl"):  # never summarise an earlier run's records
        stale.unlink()
    seed = args.seed
    if seed is None and args.profile != "ci":  # a random run must still be reproducible
        seed = random.randrange(2**32)
        print(f"distconf: hypothesis seed {seed} (reproduce with --seed {seed})")
    pytest_args = [
        *map(str, _suite_files(_split(args.suite))),
        "-p",
        "harness.plugin",
        f"--runner={args.runner}",
        f"--world-sizes={args.world_sizes}",
        f"--device={args.device}",
        f"--rank-timeout={args.rank_timeout}",
        # A backstop for a driver-side hang; ranks are bounded by --rank-timeout per call.
        f"--timeout={args.test_timeout}",
        f"--hypothesis-profile={args.profile}",
        f"--distconf-results={results}",
        "-p",
        "no:cacheprovider",
        # harness is imported before pytest starts; its modules need no assertion rewriting.
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
        "-q",
        *(["--hypothesis-seed", str(seed)] if seed is not None else []),
        *([f"--junitxml={args.junit}", "-o", "junit_family=xunit2"] if args.junit else []),
        *args.pytest_args,
    ]
    exit_code = int(pytest.main(pytest_args))
    # One file per pytest process: results.jsonl, and results.gwN.jsonl per xdist worker.
    files = sorted(out.glob("results*.jsonl"))
    if not files:
        print(
            f"error: no results were written to {results} (pytest exit code {exit_code})",
            file=sys.stderr,
        )
        return exit_code or 3
    unexpected = summarise(files)
    report_code = _write_report(files, out / "report.html")
    if exit_code == 0 and (unexpected or report_code):
        return 1
    return exit_code


def _write_report(files: list[Path], html: Path, mutation_table: Path | None = None) -> int:
    from harness.report import ReportError, render_report

    try:
        render_report(files, html, mutation_table=mutation_table)
    except ReportError as exc:
        print(f"error: no report: {exc}", file=sys.stderr)
        return 1
    print(f"report: {html}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from harness.report import ReportError, render_report

    try:
        html = render_report(
            [Path(p) for p in args.results],
            Path(args.output),
            baseline=[Path(p) for p in args.baseline],
            catalogue_path=Path(args.catalogue) if args.catalogue else None,
            match=args.match,
            mutation_table=Path(args.mutation) if args.mutation else None,
        )
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {html}")
    return 0


def summarise(paths: list[Path]) -> int:
    """Print a row per spec (status per world size); return the number of unexpected outcomes."""
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
    unexpected = 0
    for spec in sorted(rows):
        cells, examples, seconds = [], 0, 0.0
        for size in sizes:
            records = rows[spec].get(size, [])
            statuses = sorted(
                {r["status"] for r in records}, key=lambda s: (s not in UNEXPECTED, s)
            )
            unexpected += sum(is_unexpected(r) for r in records)
            examples += sum(r.get("examples") or 0 for r in records)
            seconds += sum(r.get("duration") or 0.0 for r in records)
            cells.append("+".join(statuses) or "-")
        print(f"{spec:<48}" + "".join(f"{c:>16}" for c in cells) + f"{examples:>10}{seconds:>9.1f}")
    for path, results in read.items():
        if results.bad_lines:
            print(f"warning: unreadable lines in {path}: {results.bad_lines}")
        if results.end is None:
            print(f"warning: {path} has no end record: the run did not finish, results are partial")
    print(f"{unexpected} unexpected outcome(s)")
    return unexpected


def _list(args: argparse.Namespace) -> int:
    specs = catalogue.load(Path(args.catalogue) if args.catalogue else catalogue.DEFAULT_PATH)
    by_area: dict[str, list[catalogue.Spec]] = defaultdict(list)
    for spec in specs.values():
        by_area[spec.area].append(spec)
    for area, entries in by_area.items():
        print(f"{area}")
        for spec in entries:
            print(f"  {spec.id}  [{spec.status}, suite {spec.suite}]")
            print(f"      {spec.statement}")
            print(f"      from: {spec.provenance}")
    print(f"{len(specs)} specs in {len(by_area)} areas")
    return 0


def _mutate(args: argparse.Namespace) -> int:
    from harness import faults
    from harness.mutation import mutate

    try:
        files = [str(Path(f).resolve()) for f in _split(args.fault_file)]
        faults.load_files(files)
    except faults.FaultError as exc:
        raise SystemExit(f"error: --fault-file: {exc}") from None
    if args.list:
        for fault in faults.FAULTS.values():
            print(
                f"{fault.id}  [{fault.area}]\n    {fault.summary}\n"
                f"    stands for: {fault.bug_class}"
            )
        print(f"{len(faults.FAULTS)} faults")
        return 0
    if args.jobs < 1:
        raise SystemExit(f"error: --jobs={args.jobs!r} must be a positive int")
    config = mutate.RunConfig(
        runner=args.runner,
        device=args.device,
        profile=args.profile,
        world_sizes=args.world_sizes,
        rank_timeout=args.rank_timeout,
        suites=tuple(_split(args.suite)),
        fault_files=tuple(files),
    )
    _suite_files(list(config.suites))  # unknown suite names fail before any run
    out = Path(args.out)
    try:
        result = mutate.mutate(config, _split(args.faults), out, jobs=args.jobs)
    except faults.FaultError as exc:
        raise SystemExit(f"error: --faults: {exc}") from None
    mutate.print_table(result)
    if result.clean:
        suite_runs = sorted(p for p in Path(result.clean["results"]).iterdir() if p.is_dir())
        _write_report(suite_runs, out / "report.html", out / "mutation.json")
    print(f"table: {out / 'mutation.json'}")
    caught, total = result.score
    return 2 if result.void else int(caught < total)


def _bench(args: argparse.Namespace) -> int:
    from harness import bench

    return bench.main(
        args.what, args.world_size, args.examples, args.calls, args.trials, args.runner, args.json
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the conformance suites")
    run.add_argument(
        "--suite", action="append", default=[], help="suite name (repeatable or comma-separated)"
    )
    run.add_argument("--runner", choices=RUNNERS, default="threads")
    run.add_argument("--world-sizes", default="1,2,3,4", help="comma-separated (default: 1,2,3,4)")
    run.add_argument("--device", choices=DEVICES, default="cpu")
    run.add_argument(
        "--profile", choices=PROFILES, default="ci", help="hypothesis profile (default: ci)"
    )
    run.add_argument("--seed", type=int, default=None, help="hypothesis seed for a random profile")
    run.add_argument("--rank-timeout", type=float, default=60.0, help="seconds per world.run call")
    run.add_argument("--test-timeout", type=float, default=1800.0, help="seconds per test")
    run.add_argument("--out", default=os.path.join("reports", "latest"), help="output directory")
    run.add_argument("--junit", default=None, help="also write JUnit XML here (CI annotations)")
    run.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    run.set_defaults(handler=_run)
    listing = commands.add_parser("list", help="print the spec catalogue")
    listing.add_argument(
        "--catalogue", default=None, help="catalogue file (default: the packaged one)"
    )
    listing.set_defaults(handler=_list)
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
    _add_mutate(commands)
    bench = commands.add_parser("bench", help="print benchmark figures")
    bench.add_argument("what", nargs="?", choices=("properties", "overhead", "all"), default="all")
    bench.add_argument("--runner", choices=RUNNERS, default="threads", help="for properties")
    bench.add_argument("--world-size", type=int, default=4, help="for properties")
    bench.add_argument("--examples", type=int, default=300, help="examples per property")
    bench.add_argument("--calls", type=int, default=300, help="world.run calls per row")
    bench.add_argument("--trials", type=int, default=2, help="spawn-per-check trials per row")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(handler=_bench)
    return parser


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
    mutate.add_argument("--suite", action="append", default=[], help="suites (default: all)")
    mutate.add_argument("--runner", choices=RUNNERS, default="threads")
    mutate.add_argument("--device", choices=DEVICES, default="cpu")
    mutate.add_argument("--world-sizes", default="1,2,3,4")
    mutate.add_argument("--profile", choices=PROFILES, default="ci")
    mutate.add_argument("--rank-timeout", type=float, default=60.0)
    mutate.add_argument(
        "--jobs",
        type=int,
        default=_usable_cpus(),
        help=f"suite/fault runs at once (default: the usable CPUs, here {_usable_cpus()})",
    )
    mutate.add_argument("--out", default=os.path.join("reports", "mutate"))
    mutate.set_defaults(handler=_mutate)


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return int(args.handler(args))
