"""``python -m harness reach DIR ...``: which of the aten overloads DTensor has a sharding rule
for the runs in ``DIR`` reached.

Each DIR is a run's output directory (its ``reach`` folder read) or a reach folder itself;
the reach files of every DIR are unioned (a thread run, a local run at large world sizes and a
process run together). The figures are measured against the overloads the running torch
registers (``torchkit.reach.registered``): reached is dispatched ∩ registered; an overload
dispatched without a rule (a custom handler, an op decomposed) is counted apart. A packet is an
op with all its overloads (``aten.add`` of ``aten.add.Tensor``): reached when one of them is.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.errors import ReportError
from harness.outcome import outputs
from harness.report import recorded
from harness.torchkit import reach


@dataclass(frozen=True)
class Dispatched:
    """What the reach files of the DIRs say: the overloads dispatched, and by which torch."""

    overloads: frozenset[str]
    files: int
    torch_versions: tuple[str, ...]


@dataclass(frozen=True)
class Reach:
    """The figures of ``python -m harness reach``."""

    torch: str
    files: int
    recorded_on: tuple[str, ...]
    registered_overloads: int
    registered_packets: int
    dispatched_overloads: int
    reached_overloads: int
    reached_packets: int
    without_rule: tuple[str, ...]
    """Overloads dispatched that have no registered sharding rule."""
    missing_packets: tuple[str, ...]
    """Registered packets none of whose overloads was reached."""

    @property
    def overload_share(self) -> float:
        return _share(self.reached_overloads, self.registered_overloads)

    @property
    def packet_share(self) -> float:
        return _share(self.reached_packets, self.registered_packets)

    def summary(self) -> str:
        """The report's line: ``DTensor ops reached: X of Y overloads (Z %)``."""
        return (
            f"DTensor ops reached: {self.reached_overloads} of {self.registered_overloads} "
            f"overloads ({self.overload_share:.1f} %)"
        )


def _share(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 0.0


def files_in(directory: Path, name: str = "DIR") -> list[Path]:
    """The reach files of ``directory`` (a run's output directory or its reach folder)."""
    how = "runs record them since `harness run` sets $DISTCONF_REACH_DIR"
    return recorded.files_in(
        directory, folder=outputs.REACH, pattern=reach.FILE_GLOB, how=how, name=name
    )


def read(directories: Sequence[Path]) -> Dispatched:
    """The union of the reach files of ``directories``."""
    paths = [path for directory in directories for path in files_in(directory)]
    overloads: set[str] = set()
    versions: set[str] = set()
    for path in paths:
        names, version = _read_file(path)
        overloads.update(names)
        versions.add(version)
    return Dispatched(frozenset(overloads), len(paths), tuple(sorted(versions)))


def _read_file(path: Path) -> tuple[list[str], str]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ReportError(f"{str(path)!r} must be a reach file of a run: {exc}") from None
    names = document.get("dispatched") if isinstance(document, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ReportError(
            f"{str(path)!r} must be a reach file of a run, with a list of overload names "
            "under 'dispatched'"
        )
    return names, str(document.get("torch") or "unknown")


def measure(dispatched: Dispatched, registered: frozenset[str], torch: str) -> Reach:
    """The figures of ``dispatched`` against ``registered`` (the overloads of ``torch``)."""
    reached = dispatched.overloads & registered
    reached_packets = _packets(reached)
    registered_packets = _packets(registered)
    return Reach(
        torch=torch,
        files=dispatched.files,
        recorded_on=dispatched.torch_versions,
        registered_overloads=len(registered),
        registered_packets=len(registered_packets),
        dispatched_overloads=len(dispatched.overloads),
        reached_overloads=len(reached),
        reached_packets=len(reached_packets),
        without_rule=tuple(sorted(dispatched.overloads - registered)),
        missing_packets=tuple(sorted(registered_packets - reached_packets)),
    )


def _packets(overloads: Iterable[str]) -> set[str]:
    return {reach.packet(name) for name in overloads}


def describe(figures: Reach, *, missing: bool = False) -> str:
    """The figures as ``python -m harness reach`` prints them."""
    lines = [
        f"torch {figures.torch}: DTensor has a sharding rule for "
        f"{figures.registered_overloads} overloads ({figures.registered_packets} ops)",
        f"reach files: {figures.files}, recorded on torch {', '.join(figures.recorded_on)}",
        f"dispatched: {figures.dispatched_overloads} overloads",
        f"reached: {figures.reached_overloads} of {figures.registered_overloads} overloads "
        f"({figures.overload_share:.1f} %), {figures.reached_packets} of "
        f"{figures.registered_packets} ops ({figures.packet_share:.1f} %)",
        f"dispatched without a registered rule (custom handlers, decomposed): "
        f"{len(figures.without_rule)}",
        *(f"  {name}" for name in figures.without_rule),
    ]
    if figures.recorded_on != (figures.torch,):
        lines.append(f"warning: the files were recorded on another torch than {figures.torch}")
    if missing:
        lines.append(f"registered ops never reached: {len(figures.missing_packets)}")
        lines += [f"  {name}" for name in figures.missing_packets]
    return "\n".join(lines)


def as_json(figures: Reach) -> str:
    document = {
        **asdict(figures),
        "overload_share": round(figures.overload_share, 2),
        "packet_share": round(figures.packet_share, 2),
    }
    return json.dumps(document, indent=1) + "\n"


def of_this_torch(directories: Sequence[Path]) -> Reach:
    """The figures of the runs in ``directories`` against the running torch."""
    import torch

    dispatched = read(directories)
    return measure(dispatched, reach.registered(), str(torch.__version__))


def summary_of(results: Sequence[Path]) -> str | None:
    """The report's line for the runs of ``results`` (files, or directories of them) that
    left reach files; None where none did."""
    runs = sorted({path if path.is_dir() else path.parent for path in results})
    folders = [run / outputs.REACH for run in runs if any(_reach_files(run / outputs.REACH))]
    if not folders:
        return None
    try:
        return of_this_torch(folders).summary()
    except ReportError as exc:
        return f"DTensor ops reached: not known ({exc})"


def _reach_files(folder: Path) -> Iterable[Path]:
    return folder.glob(reach.FILE_GLOB) if folder.is_dir() else ()


def command(directories: Sequence[Path], *, missing: bool, json_path: Path | None) -> int:
    """``python -m harness reach``: print the figures (and write them as JSON); exit code 0.
    Every input is checked before torch is imported."""
    if json_path is not None:
        outputs.check_file("--json", json_path)
    for directory in directories:
        files_in(directory)
    figures = of_this_torch(directories)
    print(describe(figures, missing=missing))
    if json_path is not None:
        outputs.write_whole(json_path, as_json(figures))
        print(f"figures: {json_path}")
    return 0
