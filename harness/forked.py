"""pytest in a forked child, so that whatever ends it (``os._exit`` in a rank thread, a
signal, memory) leaves this process alive to read the records and give the verdict.

Signals: the child leads a process group of its own. Where this process owns the terminal,
the child's group is made the terminal's foreground group while it runs, so a Ctrl-C reaches
the child, its xdist workers and rank processes directly, exactly once, and never this
process; a SIGINT or SIGTERM sent to this process alone (a script, a CI runner) is forwarded
to the child. Either way pytest sees one interrupt, closes its Worlds and writes the end
record that says the run was interrupted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Sequence

_PR_SET_PDEATHSIG = 1
_INTERNAL_ERROR = 3
"""pytest's exit code for an internal error: the child's, should ``pytest.main`` raise."""


def run_pytest(arguments: Sequence[str]) -> int:
    """``pytest.main(arguments)`` in a forked child; its exit code (negative: the signal that
    ended it)."""
    import pytest

    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        code = _INTERNAL_ERROR
        try:
            os.setpgid(0, 0)
            _end_with_parent()
            code = int(pytest.main(list(arguments)))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    with contextlib.suppress(OSError):  # the child may already have done it, or exited
        os.setpgid(child, child)
    with _forwarding_signals(child), _terminal_given_to(child):
        _, status = os.waitpid(child, 0)  # retried after each forwarded signal (PEP 475)
    return os.waitstatus_to_exitcode(status)


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


@contextlib.contextmanager
def _forwarding_signals(child: int) -> Iterator[None]:
    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

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
