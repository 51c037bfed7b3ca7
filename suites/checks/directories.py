"""The directories a check's checkpoints go to: made by the driver, the same path for every
rank of every World it hands the path to, removed when the check ends (ranks make none)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def driver_directory(prefix: str) -> Iterator[str]:
    """A new directory named ``prefix...`` for the duration of the block."""
    root = tempfile.mkdtemp(prefix=prefix)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
