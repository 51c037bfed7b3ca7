"""The files a run's opt-in recorders (``--reach``, ``--surface``) leave in its output
directory, found for the commands that measure them."""

from __future__ import annotations

from pathlib import Path

from harness.errors import fail


def files_in(directory: Path, *, folder: str, pattern: str, how: str, name: str) -> list[Path]:
    """The files matching ``pattern`` in ``directory`` (a run's output directory) or its
    ``folder``; ``InvalidArgument`` on ``name`` where it is not a directory or holds none
    (``how`` says how a run records them)."""
    what = f"a run's output directory or its {folder} folder"
    if not directory.is_dir():
        fail(name, str(directory), f"{what} (not found)")
    inside = directory / folder
    found = sorted((inside if inside.is_dir() else directory).glob(pattern))
    if not found:
        fail(name, str(directory), f"{what}, with {pattern} files (it has none: {how})")
    return found
