"""The commands that measure what runs covered: ``reach`` (``harness.report.reach``: the
DTensor ops the runs reached) and ``surface`` (``harness.report.surface``: the options of
torch's public API the runs drew). Parsing and dispatch only."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from harness.cli.help import PROG, Command, add_command

COMMANDS = {
    "reach": Command(
        "which of the ops DTensor has a sharding rule for the runs reached",
        "Counts which of the aten overloads DTensor has a sharding rule for (in the running "
        "torch) the runs dispatched, from the reach files `run --reach` leaves in OUT/reach; "
        "--missing lists the ops never reached.",
        f"{PROG} reach reports/latest --missing",
        "the ops the last run reached, and those it never did",
    ),
    "surface": Command(
        "which options of torch's public API the runs drew, per area",
        "Prints, per area of torch's in-scope public API (in the running torch), each option "
        "as drawn (two values or more), fixed (one), absent (its callable never called) or "
        "refused (specs/surface_refused.toml), and the share drawn, from the surface files "
        "`run --surface` leaves in OUT/surface. With --baseline, exit code 1 when an option "
        "the baseline drew is no longer drawn.",
        f"{PROG} surface reports/latest --area fsdp2",
        "the FSDP2 options the last run drew",
    ),
}


def add_reach(commands: Any) -> None:
    reach = add_command(commands, "reach", COMMANDS["reach"])
    reach.add_argument("dirs", nargs="+", help="runs' output directories (or reach folders)")
    reach.add_argument("--missing", action="store_true", help="list the ops never reached")
    reach.add_argument(
        "--json", default=None, help="also write the figures here, as JSON (default: none)"
    )
    reach.set_defaults(handler=_reach)


def _reach(args: argparse.Namespace) -> int:
    from harness.report import reach

    json_path = Path(args.json) if args.json else None
    return reach.command([Path(d) for d in args.dirs], missing=args.missing, json_path=json_path)


def add_surface(commands: Any) -> None:
    from harness.torchkit.surface import AREAS

    surface = add_command(commands, "surface", COMMANDS["surface"])
    surface.add_argument("dirs", nargs="+", help="runs' output directories (or surface folders)")
    surface.add_argument(
        "--area",
        default=None,
        help=f"one area's table only, one of {', '.join(AREAS)} (default: every area's)",
    )
    surface.add_argument(
        "--json", default=None, help="also write the figures here, as JSON (default: none)"
    )
    surface.add_argument(
        "--baseline",
        default=None,
        help="the --json output of an earlier run: list the options it drew that this one "
        "does not (default: none)",
    )
    surface.set_defaults(handler=_surface)


def _surface(args: argparse.Namespace) -> int:
    from harness.report import surface

    return surface.command(
        [Path(d) for d in args.dirs],
        area=args.area,
        json_path=Path(args.json) if args.json else None,
        baseline=Path(args.baseline) if args.baseline else None,
    )
