"""pytest in a forked child, so that whatever ends it (``os._exit`` in a rank thread, a
signal, memory) leaves this process alive to read the records and
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

Temporary files: the child, and every process it starts (xdist workers, multiprocessing's
fork server, rank processes, torchrun), has a directory of the run's own as its temporary
directory (``TMPDIR``). Once the child ended, however it ended, this process kills what is
left of the child's process group and removes that directory: a run leaves nothing in the
temporary directory it was given.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

_PR_SET_PDEATHSIG = 1
_INTERNAL_ERROR = 3
"""pytest's exit code for an internal error: the child's, should ``pytest.main`` raise."""
_INTERRUPTED = 2
"""pytest's exit code for an interrupted session: the child's, should one come before pytest
runs a session."""
_POLL = 0.2
SignalHandler = Callable[[int, Any], Any] | int | None


def run_pytest(arguments: Sequence[str]) -> int:
    """``pytest.main(arguments)`` in a forked child; its exit code (negative: the signal that
    ended it)."""
    import pytest

    temporary = tempfile.mkdtemp(prefix="distconf-run-")
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        child = os.fork()
        if child == 0:
            _run_child(lambda: int(pytest.main(list(arguments))), temporary)
        with contextlib.suppress(OSError):  # the child may already have done it, or exited
            os.setpgid(child, child)
        with _forwarding_signals(child), _terminal_given_to(child):
            status = _wait(child)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return os.waitstatus_to_exitcode(status)


def _run_child(main: Callable[[], int], temporary: str) -> None:
    code = _INTERNAL_ERROR
    try:
        os.setpgid(0, 0)
        interrupt_on_sigterm()
        _end_with_parent()
        os.environ["TMPDIR"] = tempfile.tempdir = temporary
        code = main()
    except KeyboardInterrupt:
        code = _INTERRUPTED
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # os._exit runs no exit handlers (multiprocessing's among them): the run's temporary
        # directory goes here too, should this process's parent be gone.
        shutil.rmtree(temporary, ignore_errors=True)
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


def _end_with_parent() -> None:
    """A group of its own takes the child out of reach of a kill aimed at the parent's group
    (a CI timeout's SIGKILL): on Linux, the child is sent SIGTERM when its parent dies."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() == 1:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)


def _wait(child: int) -> int:
    """The child's wait status, once it exited and what remains of its group was killed."""
    while True:
        status = _reap(child)
        if status is not None:
            return status
        time.sleep(_POLL)


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


def _kill_group(group: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, signal.SIGKILL)


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
