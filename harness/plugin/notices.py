"""The torchrun runner's notices on the terminal as they happen: where the driver waits for
agents, a refused connection, a listener beyond loopback. They are logged (``distconf.torchrun``)
while a test runs, where pytest captures the standard streams, and from the listener's thread,
where suspending pytest's capture is not safe; so they are written to a copy of the standard
error pytest had before it captured anything (its capture is suspended at configure time).
pytest's own log capture still sees them."""

from __future__ import annotations

import contextlib
import logging
import os

import pytest

from harness.runners.torchrun.world import NOTICES

_STDERR = 2


class TerminalNotices(logging.Handler):
    """Each record, a line on ``descriptor`` (a whole line per write: threads do not mix)."""

    def __init__(self, descriptor: int) -> None:
        super().__init__(logging.WARNING)
        self.descriptor = descriptor

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = "\n" + self.format(record) + "\n"
            os.write(self.descriptor, line.encode("utf-8", errors="replace"))
        except Exception:
            self.handleError(record)


def show_on_terminal(config: pytest.Config) -> None:
    """For the session: the notices written to the terminal's standard error at once."""
    try:
        descriptor = os.dup(_STDERR)
    except OSError:
        return  # no standard error to write to: pytest's log capture keeps them
    handler = TerminalNotices(descriptor)
    logger = logging.getLogger(NOTICES)
    level = logger.level
    logger.setLevel(logging.WARNING)  # whatever level pytest's --log-level gives the root
    logger.addHandler(handler)

    def remove() -> None:
        logger.removeHandler(handler)
        logger.setLevel(level)
        with contextlib.suppress(OSError):
            os.close(descriptor)

    config.add_cleanup(remove)
