"""The results record schema and its JSONL store.

A results file is one JSON object per line, each with a ``kind``:

- ``header`` (first): ``schema``, ``started``, versions (``python``, ``torch``, ``cuda``,
  ``nccl``, ``hypothesis``, ``numpy``, ``pytest``, ``distconf``), the ``accelerator`` torch
  sees, ``platform``, ``git_sha`` (``+dirty`` when uncommitted), ``argv``, and the run's
  ``runner``, ``world_sizes``, ``device``, ``backend`` (the process group's: ``threaded`` on
  the thread runner), ``backend_plugins``, ``profile``, ``seed``, ``derandomize``,
  ``max_examples``, and ``faults`` (the fault IDs injected: a mutation run, not a
  conformance verdict); ``run_id``, the same in every file of one run (an xdist worker's
  too): a reader takes the files of one run, never another's beside them; ``pid`` and
  ``worker`` (the xdist worker's ID, or None) of the process writing the file.
- ``start`` (before each test runs): ``nodeid``. A start with no ``test`` record after it
  names the test that was running when the session died.
- ``test`` (one per test outcome): the fields of ``TestRecord``.
- ``end`` (last, only when the session finished): ``finished``, ``duration``, ``exitstatus``
  (pytest's), when the session was interrupted, ``interrupted`` (why), on the torchrun
  runner, ``refused_connections`` (how many its driver's listener refused) and, in a run's
  main file when xdist's workers ran its tests, ``workers`` (how many: each recorded its
  tests in a file of its own beside it, ``results.gwN.jsonl``).
- ``noise`` (before the end record, and after it from ``harness run``): torch's known noise
  kept off the run's console (``harness.outcome.noise``): ``what``, ``count``, ``example``
  and ``source`` (``warnings``: Python warnings, counted by each pytest process;
  ``stderr``: lines torch's C++ printed, counted by ``harness run`` in the run's main file).
- ``killed`` (after the last, written by ``harness run``, never by pytest): the session's
  processes were killed because the test ``nodeid`` had run ``seconds``, past the
  ``test_timeout`` and the ``grace`` that follows it (``harness.forked``).

Every record is flushed as it is written, so a run that is interrupted or crashes keeps every
record written before; a missing ``end`` record tells the reader so. A file is written by
one session at a time: its writer holds an exclusive ``flock`` on it, and a second session
given the same file is refused rather than truncating it. ``read_results`` is the one
reader of a file, and ``harness.outcome.verdict.of_results`` the one reading of a run's files:
passed, failed, interrupted, crashed, partial or nothing ran. A file whose header names a
schema this distconf does not read (``READS``), or that has no header, is read all the same
and says so (``Results.schema_problem``): its verdict is partial, never green.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from harness.errors import DistconfError, check_one_of, fail

SCHEMA = 4
"""4 added ``noise`` records and the end record's ``workers``; 3 added the header's
``run_id``, ``pid`` and ``worker``, ``killed`` records and the end record's
``refused_connections``; 2 added ``start`` records and the end record's ``interrupted``.
Every earlier schema is read as well."""
READS = (1, 2, 3, 4)
"""The schemas this distconf reads."""
STATUSES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "timeout", "crashed")
SEVERITY = ("crashed", "timeout", "error", "failed", "xpassed", "xfailed", "skipped", "passed")
"""Worst first."""
TITLES = {
    "passed": "passed",
    "failed": "failed",
    "xfailed": "expected failure",
    "xpassed": "unexpected pass",
    "skipped": "skipped",
    "error": "error",
    "timeout": "timeout",
    "crashed": "crashed",
}
"""The words for each status."""


_TEXT_LIMIT = 20_000


@dataclass
class TestRecord:
    """One test's outcome on one World (runner × world size × device)."""

    __test__ = False  # a record, not a pytest test class

    nodeid: str
    spec: str | None
    runner: str | None
    world_size: int | None
    device: str | None
    status: str
    duration: float
    examples: int | None = None
    """Hypothesis test cases run, shrinking included."""
    examples_to_failure: int | None = None
    """The test case that failed first (1-based), before any shrinking."""
    seconds_to_failure: float | None = None
    """Seconds from the test's start to the end of its first failing test case."""
    falsifying_example: str | None = None
    error: str | None = None
    traceback: str | None = None
    primary_rank: int | None = None
    rank_statuses: dict[int, str] | None = None
    skip_reason: str | None = None
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per comparison name: worst ``max_abs``, ``max_rel``, ``max_ulp`` and the ``rtol``,
    ``atol`` they were held to."""
    references: list[str] = field(default_factory=list)
    """The single-device implementations compared against (device and optimizer)."""
    exercised: dict[str, int] = field(default_factory=dict)
    """Per label a test names (``parity.exercise``: a program step's op and the placements it
    met), how many of its examples reached it."""
    profile: str | None = None
    seed: str | None = None
    reproduce: str | None = None
    """A shell command that re-runs this test with the same World and hypothesis settings."""
    expectation: dict[str, Any] | None = None
    """The known deviation (``specs/expectations``) this test ran under: status, reason, link,
    source, conditions, fingerprint, verified (the releases it was seen on), verified_here
    (this torch among them) and, for a failure that is not the deviation, mismatch (why)."""
    kind: str = "test"

    def __post_init__(self) -> None:
        check_one_of("status", self.status, STATUSES)


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _git(directory: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_sha(directory: Path) -> str | None:
    """HEAD's SHA, with "+dirty" when the working tree has uncommitted changes."""
    sha = _git(directory, "rev-parse", "HEAD")
    if not sha:
        return None
    return f"{sha}+dirty" if _git(directory, "status", "--porcelain") else sha


def accelerator_versions() -> dict[str, str | None]:
    """The accelerator this torch sees, and its CUDA and NCCL versions (imports torch)."""
    import torch

    accelerator = torch.accelerator.current_accelerator()
    nccl = None
    # CUDA-specific: only torch.cuda tells NCCL's version
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        raw = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]  # CUDA-specific
        nccl = ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)
    return {
        "accelerator": accelerator.type if accelerator is not None else None,
        "cuda": torch.version.cuda,
        "nccl": nccl,
    }


def environment_stamp(**run: Any) -> dict[str, Any]:
    """The header record: versions, platform, git SHA and the run's own settings."""
    return {
        "kind": "header",
        "schema": SCHEMA,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _version("torch"),
        "hypothesis": _version("hypothesis"),
        "numpy": _version("numpy"),
        "pytest": _version("pytest"),
        "distconf": _version("distconf"),
        "git_sha": git_sha(Path(__file__).resolve().parent),
        "argv": sys.argv,
        "pid": os.getpid(),
        **run,
    }


def _clip(text: str | None) -> str | None:
    if text is None or len(text) <= _TEXT_LIMIT:
        return text
    return text[:_TEXT_LIMIT] + f"\n... ({len(text) - _TEXT_LIMIT} more characters clipped)"


class ResultsWriter:
    """Appends records to a JSONL file, flushing and syncing each one; the file is this
    writer's alone until it is closed (``InvalidArgument`` on ``results`` while another
    writer holds it)."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._opened = time.monotonic()
        self._file: TextIO | None = _open_alone(path)
        self._write(header)

    def write_test(self, record: TestRecord) -> None:
        data = asdict(record)
        data["traceback"] = _clip(record.traceback)
        data["error"] = _clip(record.error)
        data["falsifying_example"] = _clip(record.falsifying_example)
        self._write(data)

    def write_start(self, nodeid: str) -> None:
        self._write({"kind": "start", "nodeid": nodeid})

    def write_noise(self, records: list[dict[str, object]]) -> None:
        for record in records:
            self._write({**record, "kind": "noise"})

    def close(self, **end: Any) -> None:
        if self._file is not None:
            finished = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            duration = round(time.monotonic() - self._opened, 3)
            self._write({"kind": "end", "finished": finished, "duration": duration, **end})
            self._file.close()
            self._file = None

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            raise DistconfError(f"results file {self.path} is already closed")
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())


def _open_alone(path: Path) -> TextIO:
    """``path`` emptied for writing, held with an exclusive ``flock`` until it is closed
    (the kernel drops it with the process, however that ends). Nothing is emptied while
    another writer holds it: two sessions given one file would interleave their records
    and lose one session's."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        header = read_results(path).header or {}
        writer = f"pid {header['pid']}" if "pid" in header else "another session"
        fail(
            "results",
            str(path),
            f"a file no other session is writing, and {writer} (started "
            f"{header.get('started', '?')}) is writing it",
        )
    os.ftruncate(descriptor, 0)
    return os.fdopen(descriptor, "w", encoding="utf-8")


@dataclass
class Results:
    """A results file read back: its header, test records, end record and unreadable lines."""

    header: dict[str, Any] | None
    tests: list[dict[str, Any]]
    end: dict[str, Any] | None
    bad_lines: list[int]
    replaced_bytes: bool = False
    """Some bytes were not UTF-8 and were read as U+FFFD."""
    started: list[str] = field(default_factory=list)
    """The node IDs of the ``start`` records, in order."""
    killed: list[dict[str, Any]] = field(default_factory=list)
    """The ``killed`` records: ``harness run`` ended the session past a test's timeout."""
    noise: list[dict[str, Any]] = field(default_factory=list)
    """The ``noise`` records: torch's known noise kept off the run's console."""

    @property
    def unfinished(self) -> list[str]:
        """Tests that started but recorded no outcome: the session died while running them."""
        finished = {record.get("nodeid") for record in self.tests}
        return [nodeid for nodeid in self.started if nodeid not in finished]

    @property
    def schema_problem(self) -> str | None:
        """Why this distconf's reading of the file may not be what it means (no header, or a
        schema it does not read), or None."""
        if self.header is None:
            return "no header record, so its schema is unknown"
        schema = self.header.get("schema")
        if type(schema) is not int or schema not in READS:
            known = ", ".join(map(str, READS))
            return f"schema={schema!r} is not one this distconf reads ({known})"
        return None


def read_results(path: Path) -> Results:
    """Read ``path``; lines that are not JSON records are reported, not fatal, and bytes that
    are not UTF-8 are replaced (and reported) rather than stopping the read."""
    raw = path.read_bytes()
    try:
        text, replaced = raw.decode("utf-8"), False
    except UnicodeDecodeError:
        text, replaced = raw.decode("utf-8", errors="replace"), True
    header, end, tests, bad, started = None, None, [], [], []
    others: dict[str, list[dict[str, Any]]] = {"killed": [], "noise": []}
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad.append(number)
            continue
        kind = record.get("kind") if isinstance(record, dict) else None
        if kind == "header":
            header = record
        elif kind == "end":
            end = record
        elif kind == "test":
            tests.append(record)
        elif kind == "start" and isinstance(record.get("nodeid"), str):
            started.append(record["nodeid"])
        elif kind in others:
            others[kind].append(record)
        else:
            bad.append(number)
    return Results(header, tests, end, bad, replaced, started, **others)


def record_kill(path: Path, **fields: Any) -> None:
    """Append a ``killed`` record to ``path`` (whose session's processes are gone)."""
    append_records(path, [{"kind": "killed", **fields}])


def append_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Append ``records`` to ``path``, whose session's processes are gone (``harness run``'s
    own records: ``killed``, ``noise``)."""
    with path.open("a", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, default=str) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
