"""Load and check the spec catalogue (``specs/catalogue.toml``)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

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


class CatalogueError(ValueError):
    """The catalogue file is malformed; the message names the entry and the field."""


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
    if entry["status"] not in _STATUSES:
        raise CatalogueError(f"{where}: status={entry['status']!r} must be one of {_STATUSES}")
    spec_id = str(entry["id"])
    parts = spec_id.split(".")
    if len(parts) < 2 or not all(p.replace("_", "").isalnum() and p.islower() for p in parts):
        raise CatalogueError(f"{where}: id={spec_id!r} must be dotted lower_snake_case words")
    if parts[0] != entry["area"]:
        raise CatalogueError(f"{where}: id={spec_id!r} must start with its area {entry['area']!r}")
    return Spec(**{f: str(entry[f]) for f in _FIELDS})
