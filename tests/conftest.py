import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = ["pytester", "checkout_guard"]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path: the drivers make it their TMPDIR, where the fork
    server's socket must fit an AF_UNIX path (108 bytes; xdist's tmp_path can exceed it)."""
    short = Path(tempfile.mkdtemp(prefix="dc-"))
    yield short
    shutil.rmtree(short, ignore_errors=True)
