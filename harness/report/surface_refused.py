"""``specs/surface_refused.toml``: the options of torch's public API a spec declares out of
scope, each with why. ``harness surface`` counts them as refused, not as options left to draw.

Each entry is a ``[[refused]]`` table: ``option`` (as ``harness surface`` names it,
``torch.optim.SGD(differentiable)``), ``reason``, and optionally ``spec``, the ID of the spec
that refuses it (one of the catalogue's)."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import catalogue
from harness.errors import CatalogueError, raised_as, require

DEFAULT_PATH = Path(__file__).resolve().parent.parent.parent / "specs" / "surface_refused.toml"
_FIELDS = ("option", "reason", "spec")
_OPTION = re.compile(r"[A-Za-z_][\w.]*\([A-Za-z_]\w*\)")
"""``module.Qual.name(option)``."""


@dataclass(frozen=True)
class Refusal:
    option: str
    reason: str
    spec: str | None


def load(path: Path = DEFAULT_PATH) -> dict[str, Refusal]:
    """The refused options by name; ``CatalogueError`` naming the file and entry where an
    entry is malformed, repeated or names no spec of the catalogue."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CatalogueError(f"refused={str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise CatalogueError(f"refused={str(path)!r} is not valid TOML: {exc}") from None
    unknown_tables = sorted(set(data) - {"refused"})
    if unknown_tables:
        raise CatalogueError(f"{path}: unknown tables {unknown_tables} (only [[refused]])")
    entries = data.get("refused", [])
    if not isinstance(entries, list):
        raise CatalogueError(f"{path}: refused must be an array of tables ([[refused]])")
    specs = catalogue.load() if any(isinstance(e, dict) and "spec" in e for e in entries) else {}
    refused: dict[str, Refusal] = {}
    for index, entry in enumerate(entries):
        where = f"{path}: [[refused]] #{index + 1}"
        refusal = _parse(entry, where, specs)
        if refusal.option in refused:
            raise CatalogueError(f"{where}: option={refusal.option!r} appears twice")
        refused[refusal.option] = refusal
    return refused


def _parse(entry: Any, where: str, specs: Mapping[str, object]) -> Refusal:
    if not isinstance(entry, dict):
        raise CatalogueError(f"{where} must be a table")
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        raise CatalogueError(f"{where} has unknown fields {unknown} (known: {list(_FIELDS)})")
    option, reason, spec = entry.get("option"), entry.get("reason"), entry.get("spec")
    with raised_as(CatalogueError, where):
        require(
            isinstance(option, str) and bool(_OPTION.fullmatch(option)),
            "option",
            option,
            "an option as harness surface names it: module.Callable(option)",
        )
        require(isinstance(reason, str) and bool(reason.strip()), "reason", reason, "a text")
        if spec is not None:
            require(spec in specs, "spec", spec, f"a spec ID of {catalogue.DEFAULT_PATH.name}")
    return Refusal(str(option), str(reason), None if spec is None else str(spec))
