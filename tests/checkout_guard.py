"""A plugin for the harness's own test runs: they must never write or delete anything in the
checkout's ``reports/`` (a user's conformance records live there). It snapshots the guarded
directories when the session starts and fails the session, naming each change, when they
differ at its end. ``DISTCONF_GUARDED_DIRS`` (``os.pathsep``-separated) replaces the
default, for the guard's own test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DEFAULT = (Path(__file__).resolve().parent.parent / "reports",)
_KEY = pytest.StashKey[dict[str, tuple[int, int]]]()

Snapshot = dict[str, tuple[int, int]]


def guarded() -> tuple[Path, ...]:
    configured = os.environ.get("DISTCONF_GUARDED_DIRS")
    return tuple(Path(p) for p in configured.split(os.pathsep)) if configured else DEFAULT


def snapshot(directories: tuple[Path, ...]) -> Snapshot:
    """Every file under ``directories``: its size and modification time."""
    found: Snapshot = {}
    for directory in directories:
        for path in sorted(directory.rglob("*")) if directory.is_dir() else []:
            if path.is_file():
                stat = path.stat()
                found[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return found


def changes(before: Snapshot, after: Snapshot) -> list[str]:
    gone = [f"deleted {p}" for p in before if p not in after]
    made = [f"created {p}" for p in after if p not in before]
    changed = [f"changed {p}" for p in before if p in after and before[p] != after[p]]
    return gone + made + changed


def _is_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    if _is_controller(session.config):
        session.config.stash[_KEY] = snapshot(guarded())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_KEY, None)
    if before is None:
        return
    found = changes(before, snapshot(guarded()))
    if found:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = "\n".join(f"  {change}" for change in found)
        message = f"the harness's own tests touched the checkout's reports:\n{lines}"
        if reporter is not None:
            reporter.write_line(f"ERROR: {message}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
