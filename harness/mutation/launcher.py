"""Conformance runs (``session.run``) in processes forked from one that already imported torch.

``mutate`` starts a process per run (a fault must never leak into another run), and a plain
``python -m harness run`` pays its imports again each time: torch and torch.distributed's
modules, pytest, hypothesis; about five CPU seconds of a fault run that often takes ten. A
forkserver that imported them once forks every run instead. It only imports: no thread,
process group or fault exists in it when it forks, and every run is a process of its own.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.config import RunConfig

PRELOAD = (
    "torch",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.optim",
    "torch.nn.parallel",
    "numpy",
    "pytest",
    "hypothesis",
    "jinja2",
    "harness.plugin",
    "harness.runners.threads",
    "harness.runners.processes",
    "harness.report",
    "harness.session",
)

_context: Any = None


def _forkserver() -> Any:
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOAD))
        _context = context
    return _context


def run(config: RunConfig, log: Path, *, extra: Sequence[str] = ()) -> int:
    """``session.run(config)`` in a forked process, its output into ``log``; its exit code
    (negative: the signal that ended it). ``extra``: more pytest arguments."""
    process = _forkserver().Process(target=_main, args=(config, str(log), list(extra)))
    process.start()
    process.join()
    assert process.exitcode is not None
    return int(process.exitcode)


def _main(config: RunConfig, log: str, extra: list[str]) -> None:
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    from harness import session

    try:
        code = session.run(config, extra=extra)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)
