"""pytest in a forked child, so that whatever ends it (``os._exit`` in a rank thread, a
signal, memory, this process's deadline) leaves this process alive to read the records and
give the verdict.

Signals: the child leads a process group of its own. Where this process owns the terminal,
the child's group is made the terminal's foreground group while it runs, so a Ctrl-C reaches
the child, its xdist workers and rank processes directly, exactly once, and never this
process; a SIGINT or SIGTERM sent to this process alone (a script, a CI runner, ``timeout``)
is forwarded to the child's whole group, as the terminal would send it. In every pytest
process of the run SIGTERM is an interrupt as SIGINT is (``interrupt_on_sigterm``). Either
way pytest sees one interrupt, closes its Worlds and writes the end record that says the run
was interrupted; rank processes ignore SIGINT and die of SIGTERM, and their driver, which is
interrupted at the same moment, removes what they leave.

Deadline: pytest-timeout ends a test that runs past the test timeout, from inside the child,
and cannot where no Python code runs (a rank thread stuck in C code holding the GIL, a
deadlock). This process reads the ``start`` records of the child's results files as they are
written: when a test has run ``test_timeout`` + ``KILL_GRACE`` seconds, it kills the child's
process group and appends a ``killed`` record to that test's results file, which the verdict
reads ("crashed while running X", and why).

Stderr: given a ``noise.LineFilter``, what the child and every process it starts write to
stderr goes through a pipe this process reads, line by line, passing on to its own stderr
every line but torch's known noise, which the filter counts (``harness.outcome.noise``).

Temporary files: the child, and every process it starts (xdist workers, multiprocessing's
fork server, rank processes, torchrun), has a directory of the run's own as its temporary
directory (``TMPDIR``). Once the child ended, however it ended, this process kills what is
left of the child's process group and removes that directory: a run leaves nothing in the
temporary directory it was given. Should this process be killed outright, a stand-in in the
child's group interrupts the run, then does the same (``_end_with_parent``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.outcome import noise, results

_INTERNAL_ERROR = 3
"""pytest's exit code for an internal error: the child's, should ``pytest.main`` raise."""
_INTERRUPTED = 2
"""pytest's exit code for an interrupted session: the child's, should one come before pytest
runs a session."""
KILL_GRACE = 30.0
"""Seconds a test may run past the test timeout before this process ends the child: time for
pytest-timeout's own expiry to fail the test and for its teardown."""
ORPHAN_GRACE = 60.0
"""Seconds an orphaned run (``harness run`` killed outright) has to end once interrupted,
before what is left of it is killed."""
_POLL = 0.2
DRAIN = 5.0
"""Seconds to wait, once the child's group ended, for the last of what it wrote to stderr."""
RESULTS_GLOB = "results*.jsonl"
SignalHandler = Callable[[int, Any], Any] | int | None


def run_pytest(
    arguments: Sequence[str],
    *,
    results_dir: Path | None = None,
    test_timeout: float = 0.0,
    environment: Mapping[str, str] | None = None,
    sift: noise.LineFilter | None = None,
) -> int:
    """``pytest.main(arguments)`` in a forked child; its exit code (negative: the signal that
    ended it). With ``results_dir`` and a ``test_timeout`` (0: none), a test that runs past it
    and ``KILL_GRACE`` in the results files there ends the child's process group.
    ``environment``: variables set in the child (and so in every process it starts). With
    ``sift``, what the child's processes write to stderr passes through it: torch's known
    noise is counted there, and the rest goes on to this process's stderr."""
    import pytest

    deadline = None
    if results_dir is not None and test_timeout > 0:
        deadline = _TestDeadline(results_dir, test_timeout)
    temporary = tempfile.mkdtemp(prefix="distconf-run-")
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        with _stderr_through(sift) as stderr:
            child = os.fork()
            if child == 0:
                if stderr.writing is not None:
                    os.dup2(stderr.writing, 2)
                    stderr.close()
                _run_child(
                    lambda: int(pytest.main(list(arguments))),
                    parent,
                    temporary,
                    environment or {},
                )
            stderr.close()
            with contextlib.suppress(OSError):  # the child may already have done it, or exited
                os.setpgid(child, child)
            with _forwarding_signals(child), _terminal_given_to(child):
                status = _wait(child, deadline)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return os.waitstatus_to_exitcode(status)


@dataclass
class _Pipe:
    """The write end of the pipe the child's stderr goes to, until this process closes its
    copy (once the child was forked: the pipe ends when the child's processes do)."""

    writing: int | None

    def close(self) -> None:
        if self.writing is not None:
            os.close(self.writing)
            self.writing = None


@contextlib.contextmanager
def _stderr_through(sift: noise.LineFilter | None) -> Iterator[_Pipe]:
    """A pipe (none without ``sift``) whose lines a thread passes on to this process's
    stderr, but those ``sift`` calls known noise; once the block ended, the thread has read
    everything the child's processes wrote, or ``DRAIN`` seconds passed (a process that left
    the child's group may hold the pipe open)."""
    if sift is None:
        yield _Pipe(None)
        return
    reading, writing = os.pipe()
    pipe = _Pipe(writing)
    pump = threading.Thread(target=_pass_on, args=(reading, sift), daemon=True)
    pump.start()
    try:
        yield pipe
    finally:
        pipe.close()
        pump.join(DRAIN)


def _pass_on(reading: int, sift: noise.LineFilter) -> None:
    with os.fdopen(reading, "rb") as pipe:
        for line in pipe:
            if sift.passed(line.decode("utf-8", errors="replace").rstrip("\r\n")):
                with contextlib.suppress(OSError):
                    os.write(2, line)


def _run_child(
    main: Callable[[], int], parent: int, temporary: str, environment: Mapping[str, str]
) -> None:
    code = _INTERNAL_ERROR
    try:
        os.setpgid(0, 0)
        interrupt_on_sigterm()
        _end_with_parent(parent, temporary)
        os.environ["TMPDIR"] = tempfile.tempdir = temporary
        os.environ.update(environment)
        code = main()
    except KeyboardInterrupt:
        code = _INTERRUPTED
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def interrupt_on_sigterm() -> SignalHandler:
    """From now on, in this process: the first SIGTERM raises ``KeyboardInterrupt`` in the
    main thread, as SIGINT does (pytest closes its Worlds and records the interrupt); a later
    one changes nothing, the interrupt being under way (a SIGTERM sent to every process of a
    run reaches a pytest process twice: directly, and forwarded by ``harness run``). The
    handler it replaced; None, and nothing done, outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None
    received = False

    def interrupt(signum: int, _frame: object) -> None:
        nonlocal received
        if not received:
            received = True
            raise KeyboardInterrupt(signal.Signals(signum).name)

    return signal.signal(signal.SIGTERM, interrupt)


def _end_with_parent(parent: int, temporary: str) -> None:
    """A group of its own takes the child out of reach of a kill aimed at the parent's group
    (a CI timeout's SIGKILL). So a stand-in for the parent, forked into the child's group,
    waits for the parent or the child to end. Should the parent go first, it interrupts the
    child's group (SIGTERM) and, once the child ended or ``ORPHAN_GRACE`` passed (where no
    Python code runs, nothing ends on its own), removes the run's temporary directory and
    kills the group, itself last: while it lives, no other group can take the group's ID."""
    group = os.getpid()
    if os.fork() != 0:
        return
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # the run's interrupts are not the stand-in's
        if parent in _ended([parent, group], None):
            _kill_group(group, signal.SIGTERM)
            _ended([group], ORPHAN_GRACE)
            shutil.rmtree(temporary, ignore_errors=True)
            _kill_group(group)
    finally:
        os._exit(0)


def _ended(pids: Sequence[int], timeout: float | None) -> set[int]:
    """Which of ``pids`` ended, once one has or ``timeout`` seconds (None: no limit) passed."""
    if hasattr(os, "pidfd_open"):  # Linux: no polling, no pid reuse
        handles, ended = {}, set()
        for pid in pids:
            try:
                handles[os.pidfd_open(pid)] = pid
            except ProcessLookupError:
                ended.add(pid)
        try:
            if not ended:
                ready, _, _ = select.select(list(handles), [], [], timeout)
                ended = {handles[handle] for handle in ready}
        finally:
            for handle in handles:
                os.close(handle)
        return ended
    deadline = None if timeout is None else time.monotonic() + timeout
    while all(map(_alive, pids)) and (deadline is None or time.monotonic() < deadline):
        time.sleep(_POLL)
    return {pid for pid in pids if not _alive(pid)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _wait(child: int, deadline: _TestDeadline | None) -> int:
    """The child's wait status, once it exited and what remains of its group was killed;
    meanwhile, the child's group is killed when a test runs past the deadline."""
    overdue: list[_Running] = []
    while True:
        status = _reap(child)
        if status is not None:
            break
        if deadline is not None and not overdue:
            overdue = deadline.overdue()
            if overdue:
                deadline.announce(overdue)
                _kill_group(child)
        time.sleep(_POLL)
    if deadline is not None:
        deadline.record(overdue)  # now that nothing of the child writes to its files
    return status


def _reap(child: int) -> int | None:
    """The child's wait status once it exited (the rest of its group killed first), else
    None. Where ``waitid`` can leave the child unreaped, its group is killed while the
    child's zombie still holds the group's ID, which no other group can then take."""
    if hasattr(os, "waitid"):
        if os.waitid(os.P_PID, child, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            return None
        _kill_group(child)
        return os.waitpid(child, 0)[1]
    pid, status = os.waitpid(child, os.WNOHANG)
    if pid == 0:
        return None
    _kill_group(child)
    return status


def _kill_group(group: int, how: signal.Signals = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, how)


@dataclass(frozen=True)
class _Running:
    path: Path
    nodeid: str
    seconds: float


@dataclass
class _Progress:
    """How far this process read one results file, and the test running there since when
    (this process's clock: when it first read the test's ``start`` record)."""

    offset: int = 0
    running: str | None = None
    since: float = 0.0


@dataclass
class _TestDeadline:
    """The test timeout, read off the results files in ``directory`` as they grow."""

    directory: Path
    test_timeout: float
    progress: dict[Path, _Progress] = field(default_factory=dict)

    def overdue(self) -> list[_Running]:
        """The tests that have run past the test timeout and the grace."""
        now = time.monotonic()
        found = []
        for path in sorted(self.directory.glob(RESULTS_GLOB)):
            progress = self.progress.setdefault(path, _Progress())
            self._read(path, progress, now)
            seconds = now - progress.since
            if progress.running is not None and seconds > self.test_timeout + KILL_GRACE:
                found.append(_Running(path, progress.running, seconds))
        return found

    def announce(self, overdue: list[_Running]) -> None:
        for running in overdue:
            print(
                f"distconf: {running.nodeid} has run {running.seconds:.0f} s, past "
                f"--test-timeout={self.test_timeout:g} s and {KILL_GRACE:g} s of grace, and "
                "pytest-timeout did not end it: killing pytest's processes",
                file=sys.stderr,
                flush=True,
            )

    def record(self, overdue: list[_Running]) -> None:
        for running in overdue:
            results.record_kill(
                running.path,
                nodeid=running.nodeid,
                seconds=round(running.seconds, 1),
                test_timeout=self.test_timeout,
                grace=KILL_GRACE,
            )

    @staticmethod
    def _read(path: Path, progress: _Progress, now: float) -> None:
        try:
            with path.open("rb") as handle:
                handle.seek(progress.offset)
                data = handle.read()
        except OSError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        progress.offset += len(complete)
        for line in complete.splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                kind = record.get("kind") if isinstance(record, dict) else None
                if kind == "start":
                    progress.running, progress.since = str(record.get("nodeid")), now
                elif kind in ("test", "end"):
                    progress.running = None


@contextlib.contextmanager
def _forwarding_signals(child: int) -> Iterator[None]:
    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _terminal_given_to(child: int) -> Iterator[None]:
    """Make the child's group the terminal's foreground group while the block runs, where
    this process's group holds the terminal now; otherwise nothing."""
    terminal = _foreground_terminal()
    if terminal is None:
        yield
        return
    own_group = os.getpgrp()
    try:
        os.tcsetpgrp(terminal, child)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        # Taking the terminal back from the background raises SIGTTOU, unless it is ignored.
        previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        try:
            os.tcsetpgrp(terminal, own_group)
        finally:
            signal.signal(signal.SIGTTOU, previous)


def _foreground_terminal() -> int | None:
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        try:
            descriptor = stream.fileno()
            if os.isatty(descriptor) and os.tcgetpgrp(descriptor) == os.getpgrp():
                return descriptor
        except (AttributeError, OSError, ValueError):
            continue
    return None
