"""torch's known noise: what torch prints during a run that says nothing of the run.

Two kinds, each known by its exact words, so that nothing else is ever taken for it:

- Python warnings (``KNOWN_WARNINGS``): the deprecation of ``torch.jit`` that torch warns of
  each time a module of its own scripts a function on import (``torch.distributed.optim``'s
  functional optimizers, ``torch.jit.interface``), raised from torch's files.
- Lines torch's C++ writes to stderr (``KNOWN_LINES``): the "unwaited collective calls"
  warning a process that ran functional collectives prints at its exit, and the lines that
  follow it.

The plugin and ``harness run`` keep them off the run's console and count them: the count and
one example of each go into the results (``noise`` records) and the report. Anything not
matched here is shown as it comes.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePath

RECORD = "noise"
"""The results record of one known noise: ``what``, ``count``, ``example`` and ``source``."""


@dataclass(frozen=True)
class KnownWarning:
    """A Python warning torch raises that says nothing of the run."""

    what: str
    category: type[Warning]
    message: re.Pattern[str]
    """Matches the warning's whole message."""

    def matches(self, message: str, category: type[Warning], filename: str) -> bool:
        return (
            issubclass(category, self.category)
            and "torch" in PurePath(filename).parts
            and self.message.fullmatch(message) is not None
        )


KNOWN_WARNINGS = (
    KnownWarning(
        what="torch.jit deprecation",
        category=DeprecationWarning,
        message=re.compile(
            r"`torch\.jit\.\w+` is (deprecated|not supported in Python 3\.14\+ and may "
            r"break)\. Please (switch to|use) `torch\.(compile|export)`( or `torch\.export`)?"
            r"( instead)?\."
        ),
    ),
)


def known_warning(message: str, category: type[Warning], filename: str) -> str | None:
    """The name of the known noise a Python warning is, or None."""
    for known in KNOWN_WARNINGS:
        if known.matches(message, category, filename):
            return known.what
    return None


@dataclass(frozen=True)
class KnownLines:
    """Lines torch's C++ prints to stderr that say nothing of the run: a first line and the
    lines that follow it, each exactly."""

    what: str
    first: re.Pattern[str]
    following: tuple[str, ...]


KNOWN_LINES = (
    KnownLines(
        what="unwaited collective calls at exit",
        first=re.compile(
            r"(\[rank\d+\]:)?\[W\d{4} [\d:.]+ \d* ?ProcessGroup\.cpp:\d+\] Warning: At the time "
            r"of process termination, there are still \d+ unwaited collective calls\. Please "
            r"review your program to ensure that:"
        ),
        following=(
            "1. c10d_functional.wait_tensor() is invoked on all tensors returned from "
            "c10d_functional collective,",
            "2. c10d_functional.wait_tensor() is invoked on all output tensors of async_op=True "
            "torch.distributed collective called under `with "
            "allow_inflight_collective_as_graph_input_ctx():`,",
            "before the output tensors of the collective are used. (function ~WorkRegistry)",
        ),
    ),
)


class LineFilter:
    """Reads stderr line by line: passes on each line that is not known noise, and counts
    the noise (a first line and those of its following lines that come after it)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, str] = {}
        self._following: tuple[str, ...] = ()

    def passed(self, line: str) -> bool:
        """Whether ``line`` (without its newline) is to be shown."""
        if self._following and line.rstrip() == self._following[0]:
            self._following = self._following[1:]
            return False
        self._following = ()
        for known in KNOWN_LINES:
            if known.first.fullmatch(line.rstrip()):
                self.counts[known.what] += 1
                self.examples.setdefault(known.what, "\n".join((line.rstrip(), *known.following)))
                self._following = known.following
                return False
        return True

    def records(self) -> list[dict[str, object]]:
        return records(self.counts, self.examples, source="stderr")


def records(
    counts: Counter[str], examples: dict[str, str], *, source: str
) -> list[dict[str, object]]:
    """The ``noise`` records of what was counted (``source``: ``warnings`` or ``stderr``)."""
    return [
        {"kind": RECORD, "what": what, "count": count, "example": examples.get(what, ""),
         "source": source}
        for what, count in sorted(counts.items())
    ]  # fmt: skip


def totals(found: Iterable[dict[str, object]]) -> dict[str, int]:
    """The count of each known noise over ``noise`` records (of several files)."""
    total: Counter[str] = Counter()
    for record in found:
        count = record.get("count")
        if isinstance(count, int) and not isinstance(count, bool):
            total[str(record.get("what"))] += count
    return dict(sorted(total.items()))


def describe(total: dict[str, int]) -> str:
    """``132 × torch.jit deprecation, 2 × unwaited collective calls at exit``."""
    return ", ".join(f"{count} × {what}" for what, count in total.items())
