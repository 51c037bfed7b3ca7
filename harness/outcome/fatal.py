"""A pytest process's fatal error, kept beside its results file.

A process that dies of a signal (a segfault in torch's C++, an abort) writes no end record,
and Python's fault handler printed every thread's stack to a console that CI cuts to its
tail. ``FatalLog`` points the fault handler at ``results.<worker>.fatal.txt`` while the
session runs, and removes the file again when the session ends cleanly (it stays empty);
``summary`` is what the verdict of a crash says of it.
"""

from __future__ import annotations

import faulthandler
import re
import sys
from pathlib import Path
from typing import TextIO

SUFFIX = ".fatal.txt"
GLOB = f"results*{SUFFIX}"
"""A run's fatal files in its output directory, one per pytest process that died so."""
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def path_beside(results: Path) -> Path:
    """``results.gw1.jsonl`` → ``results.gw1.fatal.txt``."""
    return results.with_name(results.stem + SUFFIX)


class FatalLog:
    """The fault handler of this process writes every thread's stack to the file beside
    ``results`` until ``close``."""

    def __init__(self, results: Path) -> None:
        self.path = path_beside(results)
        self._file: TextIO | None = self.path.open("w", encoding="utf-8")
        faulthandler.enable(self._file, all_threads=True)

    def close(self) -> None:
        """Hand the fault handler back to stderr; the file goes unless something wrote it."""
        if self._file is None:
            return
        faulthandler.enable(sys.__stderr__ or 2, all_threads=True)
        self._file.close()
        self._file = None
        if self.path.stat().st_size == 0:
            self.path.unlink()


def summary(results: Path) -> str | None:
    """What killed the process of ``results``, or None when its fatal file is absent or
    empty: the fault handler's first line and the innermost frame of the thread that
    crashed, and the file that holds every thread's stack."""
    path = path_beside(results)
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    lines = text.splitlines()
    if not lines:
        return None
    where = _innermost_frame_of_current_thread(lines)
    at = f" in {where}" if where else ""
    return f"{lines[0].strip()}{at} (every thread's stack: {path})"


def _innermost_frame_of_current_thread(lines: list[str]) -> str | None:
    for index, line in enumerate(lines):
        if line.startswith("Current thread"):
            for frame in lines[index + 1 :]:
                match = _FRAME.match(frame)
                if match:
                    return f"{match['func']} ({match['file']}:{match['line']})"
            return None
    return None
