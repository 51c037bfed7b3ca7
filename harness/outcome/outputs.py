"""What a run writes, and where: its ``--out`` directory, its results files, its report.

- ``check_directory`` and ``check_file``: an output this user can write (not a file where a
  directory is meant, nothing under ``/proc``, nothing read-only), refused before anything
  starts.
- ``locked``: one run at a time in an output directory. The run holds an exclusive ``flock``
  on ``OUT/.distconf.lock`` from before its pytest starts until its report is written; a
  second run is refused, naming the process that holds it. The kernel releases the lock when
  the last process holding it ends (the forked pytest child inherits it), so a crash never
  leaves a directory refused.
- ``keep_earlier``: an earlier run's records (with its fatal files), report, reach and
  surface folders moved to ``OUT/earlier/<its start>/``.
- ``results_of``: the results files one run wrote, told apart by the ``run_id`` of their header;
  ``with_its_workers``: a run's main results file and its xdist workers' files beside it.
- ``write_whole``: a file written all or nothing (a temp beside it, renamed over it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.errors import ReportError, fail
from harness.outcome import fatal
from harness.outcome.results import read_results

LOCK = ".distconf.lock"
"""The lock file of an output directory (``locked``)."""
RESULTS_GLOB = "results*.jsonl"
"""A run's results files in its output directory (``results.gwN.jsonl`` per xdist worker)."""
REPORT = "report.html"
REACH = "reach"
"""The folder of a run's reach files: the DTensor ops each of its processes reached."""
SURFACE = "surface"
"""The folder of a run's surface files: the options of torch's API each test passed."""


def new_run_id() -> str:
    """A run's identity: every results file of the run carries it in its header."""
    return uuid.uuid4().hex


def check_directory(name: str, path: Path) -> None:
    """Refuse ``path`` (the option ``name``) unless it is, or can be made, a directory this
    user can write files in. Probes by making and removing an empty directory: nothing is
    left behind and nothing of ``path`` is created."""
    existing = _nearest_existing(path)
    if not existing.is_dir():
        fail(name, str(path), f"a directory, and {str(existing)!r} is a file")
    _probe(name, path, existing)


def check_file(name: str, path: Path) -> None:
    """Refuse ``path`` (the option ``name``) unless this user can write a file there; an
    existing file is opened for appending, and left as it was."""
    if path.is_dir():
        fail(name, str(path), "a file, and it is a directory")
    if not path.exists():
        existing = _nearest_existing(path)
        if not existing.is_dir():
            fail(name, str(path), f"a file in a directory, and {str(existing)!r} is a file")
        _probe(name, path, existing)
        return
    try:
        with path.open("a", encoding="utf-8"):
            pass
    except OSError as exc:
        fail(name, str(path), f"a file this user can write ({exc.strerror})")


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path.cwd()


def _probe(name: str, path: Path, directory: Path) -> None:
    try:
        probe = tempfile.mkdtemp(prefix=".distconf-probe-", dir=directory)
    except OSError as exc:
        fail(
            name,
            str(path),
            f"a path this user can create and write files in (making a directory in "
            f"{str(directory)!r} failed: {exc.strerror})",
        )
    os.rmdir(probe)


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold ``out`` for one run (made if missing); refused (``InvalidArgument`` on ``out``)
    while another run holds it."""
    out.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fail(
                "out",
                str(out),
                f"a directory no other run is writing to, and {_holder(out / LOCK)} holds "
                f"its lock ({out / LOCK}): wait for it to end, or give another --out",
            )
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"the run of pid {os.getpid()} (started {started})\n".encode())
        try:
            yield
        finally:
            os.ftruncate(descriptor, 0)
    finally:
        os.close(descriptor)


def _holder(lock: Path) -> str:
    """Who holds ``lock``, as its holder wrote it (a moment after taking it)."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        text = lock.read_text(encoding="utf-8").strip()
        if text:
            return text
    return "another run"


def keep_earlier(out: Path) -> Path | None:
    """Move an earlier run's records, reach and surface folders and report in ``out`` to
    ``out/earlier/<its start>/``, so that a new run never summarises them and never loses
    them; where they went."""
    earlier = sorted(out.glob(RESULTS_GLOB)) if out.is_dir() else []
    fatal_logs = sorted(out.glob(fatal.GLOB)) if out.is_dir() else []
    if not earlier and not (out / REACH).exists() and not (out / SURFACE).exists():
        return None
    header = (read_results(earlier[0]).header if earlier else None) or {}
    stamp = re.sub(r"[^0-9A-Za-z]+", "-", str(header.get("started") or "unknown")).strip("-")
    target = out / "earlier" / stamp
    suffix = 1
    while target.exists():
        suffix += 1
        target = out / "earlier" / f"{stamp}-{suffix}"
    target.mkdir(parents=True)
    for path in [*earlier, *fatal_logs, out / REPORT, out / REACH, out / SURFACE]:
        if path.exists():
            path.rename(target / path.name)
    print(f"distconf: the earlier run's records in {out} were moved to {target}")
    return target


def header_of(path: Path) -> dict[str, Any] | None:
    """The header record of a results file (its first line), or None when it has none."""
    try:
        with path.open("rb") as file:
            record = json.loads(file.readline())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("kind") == "header" else None


def results_of(out: Path, run_id: str) -> tuple[list[Path], list[Path]]:
    """The results files in ``out`` that the run ``run_id`` wrote, and those it did not."""
    own: list[Path] = []
    other: list[Path] = []
    for path in sorted(out.glob(RESULTS_GLOB)):
        header = header_of(path) or {}
        (own if header.get("run_id") == run_id else other).append(path)
    return own, other


def with_its_workers(path: Path) -> list[Path]:
    """``path`` and, where it is a run's main results file (written by the process that is
    no xdist worker, ``results.jsonl``), the files its workers wrote beside it
    (``results.gwN.jsonl``, the same ``run_id``): the controller of a run over several
    workers records none of the tests itself. A worker's file, or one without a ``run_id``,
    stands alone."""
    header = header_of(path) or {}
    run_id = header.get("run_id")
    if not run_id or header.get("worker"):
        return [path]
    workers = [
        beside
        for beside in sorted(path.parent.glob(RESULTS_GLOB))
        if beside != path and (header_of(beside) or {}).get("run_id") == run_id
    ]
    return [path, *workers]


def one_run_in(directory: Path, name: str) -> list[Path]:
    """The results files in ``directory``; a ``ReportError`` naming each run where they are
    of several (files copied together, or left by a plain pytest run), since a summary of
    them would judge one run by another's records."""
    runs: dict[str, list[str]] = {}
    found = sorted(directory.glob(RESULTS_GLOB))
    for path in found:
        run_id = (header_of(path) or {}).get("run_id") or "without a run_id"
        runs.setdefault(str(run_id), []).append(path.name)
    if len(runs) > 1:
        held = "; ".join(f"{run}: {', '.join(names)}" for run, names in runs.items())
        raise ReportError(
            f"{name}={str(directory)!r} must hold the results of one run, and holds those "
            f"of {len(runs)} ({held}): name one run's files"
        )
    return found


def write_whole(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` all or nothing: into a temp file beside it, synced, then
    renamed over it. On an ``OSError`` (a full disk) the temp is removed and ``path`` is as
    it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    # os.open, not mkstemp: the file gets the umask's mode, as a plain open would give it.
    descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
