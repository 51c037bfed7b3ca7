"""Load and check the spec catalogue (``specs/catalogue.toml``)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

# CatalogueError is re-exported: callers catch ``catalogue.CatalogueError``.
from harness.errors import CatalogueError as CatalogueError
from harness.errors import check_one_of, raised_as, require

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "specs" / "catalogue.toml"
DEFAULT_SUITES = Path(__file__).resolve().parent.parent / "suites"
_FIELDS = ("id", "area", "suite", "statement", "provenance", "status")
_STATUSES = ("active", "planned")


@dataclass(frozen=True)
class Spec:
    id: str
    area: str
    suite: str
    statement: str
    provenance: str
    status: str


def load(path: Path = DEFAULT_PATH) -> dict[str, Spec]:
    """Every spec by ID, in file order."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CatalogueError(f"catalogue={str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise CatalogueError(f"catalogue={str(path)!r} is not valid TOML: {exc}") from None
    entries = data.get("spec", [])
    specs: dict[str, Spec] = {}
    for index, entry in enumerate(entries):
        spec = _parse(entry, index, path)
        if spec.id in specs:
            raise CatalogueError(f"{path}: spec id={spec.id!r} appears twice")
        specs[spec.id] = spec
    return specs


def _parse(entry: dict[str, object], index: int, path: Path) -> Spec:
    where = f"{path}: [[spec]] #{index + 1}"
    missing = [f for f in _FIELDS if not isinstance(entry.get(f), str) or not entry.get(f)]
    if missing:
        raise CatalogueError(f"{where} ({entry.get('id')!r}) lacks string fields {missing}")
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        raise CatalogueError(f"{where} ({entry['id']!r}) has unknown fields {unknown}")
    spec_id, area = str(entry["id"]), entry["area"]
    parts = spec_id.split(".")
    words = len(parts) >= 2 and all(p.replace("_", "").isalnum() and p.islower() for p in parts)
    with raised_as(CatalogueError, where):
        check_one_of("status", entry["status"], _STATUSES)
        require(words, "id", spec_id, "dotted lower_snake_case words")
        require(parts[0] == area, "id", spec_id, f"prefixed by its area {area!r}")
    return Spec(**{f: str(entry[f]) for f in _FIELDS})


def describe(specs: dict[str, Spec]) -> str:
    """The catalogue as ``python -m harness list`` prints it: by area, each spec's ID, status,
    suite, statement and provenance."""
    by_area: dict[str, list[Spec]] = {}
    for spec in specs.values():
        by_area.setdefault(spec.area, []).append(spec)
    lines = []
    for area, entries in by_area.items():
        lines.append(area)
        for spec in entries:
            lines.append(f"  {spec.id}  [{spec.status}, suite {spec.suite}]")
            lines.append(f"      {spec.statement}")
            lines.append(f"      from: {spec.provenance}")
    lines.append(f"{len(specs)} specs in {len(by_area)} areas")
    return "\n".join(lines)
