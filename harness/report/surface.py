"""``python -m harness surface DIR ...``: which options of torch's in-scope public API the runs
in ``DIR`` drew, per area.

Each DIR is a run's output directory (its ``surface`` folder read) or a surface folder
itself; the surface files of every DIR are added up. Each option of the running torch's
inventory (``torchkit.surface.inventory``) is:

- **drawn**: the run gave it at least two values: two explicit ones, or an explicit one in
  some calls and its default in others;
- **fixed**: one value only: passed always alike, or never passed while its callable was
  called (fixed at its default);
- **absent**: its callable was never called (from outside torch);
- **refused**: a spec declares it out of scope (``specs/surface_refused.toml``).

The share drawn is drawn over the options not refused. ``--baseline`` compares with an
earlier ``--json`` output: an option drawn there and fixed or absent here is a drop.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import CatalogueError, ReportError, check_one_of, fail
from harness.outcome import outputs
from harness.report import recorded, surface_refused
from harness.torchkit import surface

STATUSES = ("drawn", "fixed", "absent", "refused")
SHOWN_VALUES = 6
"""Values listed per option (the most passed first; the others counted)."""


@dataclass
class Called:
    """What the surface files say of one callable: its calls, and per option the values
    passed explicitly with how many calls passed each."""

    calls: int = 0
    options: dict[str, Counter[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Recorded:
    calls: dict[str, Called]
    files: int
    tests: int
    torch_versions: tuple[str, ...]


@dataclass(frozen=True)
class Row:
    """One option's line of the table."""

    area: str
    option: str
    """``torch.distributed.fsdp.fully_shard(mesh)``."""
    shown: str
    """``fully_shard(mesh)``."""
    status: str
    values: tuple[str, ...]
    note: str = ""


@dataclass(frozen=True)
class Surface:
    """The figures of ``python -m harness surface``."""

    torch: str
    recorded: Recorded
    rows: tuple[Row, ...]
    callables: dict[str, tuple[int, int]]
    """Per area: callables called, callables in scope."""
    warnings: tuple[str, ...] = ()

    def counts(self, area: str | None = None) -> dict[str, int]:
        rows = [row for row in self.rows if area is None or row.area == area]
        counted = Counter(row.status for row in rows)
        return {status: counted[status] for status in STATUSES} | {"options": len(rows)}

    def share(self, area: str | None = None) -> float:
        counts = self.counts(area)
        in_scope = counts["options"] - counts["refused"]
        return 100.0 * counts["drawn"] / in_scope if in_scope else 0.0

    def summary(self) -> str:
        """The report's line: ``Public API options drawn: X of Y (Z %)``."""
        counts = self.counts()
        in_scope = counts["options"] - counts["refused"]
        return (
            f"Public API options drawn: {counts['drawn']} of {in_scope} ({self.share():.1f} %); "
            + ", ".join(f"{area} {self.share(area):.0f} %" for area in self.callables)
        )


def files_in(directory: Path, name: str = "DIR") -> list[Path]:
    """The surface files of ``directory`` (a run's output directory or its surface folder)."""
    how = "a run records them with `harness run --surface`"
    return recorded.files_in(
        directory, folder=outputs.SURFACE, pattern=surface.FILE_GLOB, how=how, name=name
    )


def read(directories: Sequence[Path]) -> Recorded:
    """The sum of the surface files of ``directories``."""
    paths = [path for directory in directories for path in files_in(directory)]
    calls: dict[str, Called] = {}
    tests: set[str] = set()
    versions: set[str] = set()
    for path in paths:
        for record in _records(path):
            if record.get("kind") == "header":
                versions.add(str(record.get("torch") or "unknown"))
                continue
            tests.add(str(record["test"]))
            _add(calls, record["calls"])
    return Recorded(
        calls,
        len(paths),
        len(tests - {surface.OUTSIDE_TESTS, surface.RANK_PROCESSES}),
        tuple(sorted(versions)),
    )


def _records(path: Path) -> Iterable[dict[str, Any]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as exc:
        raise ReportError(f"{str(path)!r} must be a surface file of a run: {exc}") from None
    for record in records:
        if not _well_formed(record):
            raise ReportError(
                f"{str(path)!r} must be a surface file of a run: a header, then records of "
                f"'test' and 'calls' ({str(record)[:80]!r} is neither)"
            )
        yield record


def _well_formed(record: Any) -> bool:
    if not isinstance(record, dict):
        return False
    if record.get("kind") == "header":
        return True
    calls = record.get("calls")
    return (
        isinstance(record.get("test"), str)
        and isinstance(calls, dict)
        and all(
            isinstance(c, dict)
            and isinstance(c.get("calls"), int)
            and isinstance(c.get("options"), dict)
            for c in calls.values()
        )
    )


def _add(calls: dict[str, Called], recorded: dict[str, Any]) -> None:
    for api, record in recorded.items():
        called = calls.setdefault(api, Called())
        called.calls += record["calls"]
        for option, values in record["options"].items():
            called.options.setdefault(option, Counter()).update(
                {str(value): int(count) for value, count in values.items()}
            )


def measure(
    recorded: Recorded,
    apis: Sequence[surface.Api],
    refused: dict[str, surface_refused.Refusal],
    torch: str,
) -> Surface:
    """The status of every option of ``apis`` (the inventory of ``torch``) in ``recorded``."""
    rows = tuple(
        _row(api, option, recorded.calls.get(api.key), refused)
        for api in apis
        for option in api.options
    )
    callables: dict[str, tuple[int, int]] = {}
    for area in surface.AREAS:
        in_area = [api for api in apis if api.area == area]
        called = sum(1 for api in in_area if api.key in recorded.calls)
        callables[area] = (called, len(in_area))
    options = {api.option_id(option.name) for api in apis for option in api.options}
    warnings = [
        f"{name} is refused in {surface_refused.DEFAULT_PATH.name} but is no option of torch "
        f"{torch}'s inventory"
        for name in sorted(set(refused) - options)
    ]
    if recorded.torch_versions != (torch,):
        warnings.append(f"the files were recorded on another torch than {torch}")
    return Surface(torch, recorded, rows, callables, tuple(warnings))


def _row(
    api: surface.Api,
    option: surface.Option,
    called: Called | None,
    refused: dict[str, surface_refused.Refusal],
) -> Row:
    name = api.option_id(option.name)
    shown = f"{api.qualname}({option.name})"
    values = called.options.get(option.name, Counter()) if called else Counter[str]()
    listed = _listed(values, called, option)
    status = _status(values, called, option)
    if name in refused:
        note = f"{refused[name].reason}" + (" (yet the run drew it)" if status == "drawn" else "")
        return Row(api.area, name, shown, "refused", listed, note)
    return Row(api.area, name, shown, status, listed)


def _status(values: Counter[str], called: Called | None, option: surface.Option) -> str:
    if called is None or called.calls == 0:
        return "absent"
    effective = set(values)
    if sum(values.values()) < called.calls and option.default is not None:
        effective.add(option.default)
    drawn = len(effective) >= 2 or surface.OTHER in effective
    return "drawn" if drawn else "fixed"


def _listed(values: Counter[str], called: Called | None, option: surface.Option) -> tuple[str, ...]:
    """The values the run gave the option, the most passed first: each explicit one with
    its count, then its default with the calls that left it so."""
    listed = [f"{value} ×{count}" for value, count in values.most_common()]
    left_default = (called.calls if called else 0) - sum(values.values())
    if left_default > 0:
        listed.append(f"default {option.default} ×{left_default}")
    if len(listed) > SHOWN_VALUES:
        listed[SHOWN_VALUES:] = [f"+{len(listed) - SHOWN_VALUES} more"]
    return tuple(listed)


def describe(figures: Surface, *, area: str | None = None) -> str:
    """The figures as ``python -m harness surface`` prints them."""
    seen = figures.recorded
    lines = [
        f"torch {figures.torch}: {len(figures.rows)} options of "
        f"{sum(total for _, total in figures.callables.values())} callables in scope",
        f"surface files: {seen.files} ({seen.tests} tests), recorded on torch "
        f"{', '.join(seen.torch_versions) or 'unknown'}",
        "",
        *_totals(figures),
    ]
    for name in [area] if area else list(figures.callables):
        lines += ["", *_area_table(figures, name)]
    return "\n".join(lines + [f"warning: {text}" for text in figures.warnings])


def _totals(figures: Surface) -> list[str]:
    header = f"{'area':<20}{'options':>8}{'drawn':>7}{'fixed':>7}{'absent':>8}{'refused':>9}"
    lines = [f"{header}{'drawn %':>9}  callables called"]
    for area in [*figures.callables, None]:
        counts = figures.counts(area)
        called, total = (
            figures.callables[area]
            if area
            else tuple(map(sum, zip(*figures.callables.values(), strict=True)))
        )
        lines.append(
            f"{area or 'all':<20}{counts['options']:>8}{counts['drawn']:>7}{counts['fixed']:>7}"
            f"{counts['absent']:>8}{counts['refused']:>9}{figures.share(area):>9.1f}  "
            f"{called} of {total}"
        )
    return lines


def _area_table(figures: Surface, area: str) -> list[str]:
    rows = [row for row in figures.rows if row.area == area]
    counts = figures.counts(area)
    in_scope = counts["options"] - counts["refused"]
    width = max((len(row.shown) for row in rows), default=10) + 2
    lines = [f"{area}: {counts['drawn']} of {in_scope} options drawn ({figures.share(area):.1f} %)"]
    for row in rows:
        said = row.note if row.status == "refused" else ", ".join(row.values)
        lines.append(f"  {row.shown:<{width}}{row.status:<9}{said}".rstrip())
    return lines


def as_json(figures: Surface) -> str:
    areas = {
        area: figures.counts(area) | {"share": round(figures.share(area), 2)}
        for area in figures.callables
    }
    document = {
        "torch": figures.torch,
        "recorded_on": list(figures.recorded.torch_versions),
        "areas": areas,
        "all": figures.counts() | {"share": round(figures.share(), 2)},
        "options": {
            row.option: {"area": row.area, "status": row.status, "values": list(row.values)}
            for row in figures.rows
        },
    }
    return json.dumps(document, indent=1) + "\n"


def dropped(baseline: Path, figures: Surface) -> list[str]:
    """The options ``baseline`` (an earlier ``--json`` output) says were drawn that
    ``figures`` finds fixed, absent or gone from the inventory, each as ``option: now``."""
    try:
        document = json.loads(baseline.read_text(encoding="utf-8"))
        before = {name: entry["status"] for name, entry in document["options"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ReportError(
            f"--baseline={str(baseline)!r} must be the --json output of harness surface: {exc}"
        ) from None
    now = {row.option: row.status for row in figures.rows}
    return [
        f"{name}: drawn -> {now.get(name, 'not in the inventory')}"
        for name, status in sorted(before.items())
        if status == "drawn" and now.get(name) not in ("drawn", "refused")
    ]


def of_this_torch(directories: Sequence[Path], refused_path: Path | None = None) -> Surface:
    """The figures of the runs in ``directories`` against the running torch's inventory."""
    import torch

    refused = surface_refused.load(refused_path or surface_refused.DEFAULT_PATH)
    return measure(read(directories), surface.inventory(), refused, str(torch.__version__))


def summary_of(results: Sequence[Path]) -> str | None:
    """The report's line for the runs of ``results`` (files, or directories of them) that
    left surface files; None where none did."""
    runs = sorted({path if path.is_dir() else path.parent for path in results})
    folders = [run / outputs.SURFACE for run in runs if any(_surface_files(run))]
    if not folders:
        return None
    try:
        return of_this_torch(folders).summary()
    except (ReportError, CatalogueError) as exc:
        return f"Public API options drawn: not known ({exc})"


def _surface_files(run: Path) -> Iterable[Path]:
    folder = run / outputs.SURFACE
    return folder.glob(surface.FILE_GLOB) if folder.is_dir() else ()


def command(
    directories: Sequence[Path],
    *,
    area: str | None = None,
    json_path: Path | None = None,
    baseline: Path | None = None,
) -> int:
    """``python -m harness surface``: print the figures (and write them as JSON); exit code
    0, or 1 where an option the baseline drew is no longer drawn. Every input is checked
    before torch is imported."""
    if area is not None:
        check_one_of("--area", area, surface.AREAS)
    if json_path is not None:
        outputs.check_file("--json", json_path)
    if baseline is not None and not baseline.is_file():
        fail("--baseline", str(baseline), "the --json output of an earlier harness surface")
    for directory in directories:
        files_in(directory)
    figures = of_this_torch(directories)
    print(describe(figures, area=area))
    if json_path is not None:
        outputs.write_whole(json_path, as_json(figures))
        print(f"figures: {json_path}")
    if baseline is None:
        return 0
    drops = dropped(baseline, figures)
    print(f"dropped from drawn since {baseline}: {len(drops)}")
    for line in drops:
        print(f"  {line}")
    return 1 if drops else 0
