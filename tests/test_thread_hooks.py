"""Thread Worlds leave the process as they found it, however many calls failed.

``dist.init_process_group`` wraps ``sys.excepthook`` once per call, and a thread World calls
it once per rank of every generation (a generation is replaced after each failed call).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from harness import RankFailure, open_world

FAILURES = 300
ROOT = Path(__file__).resolve().parents[1]

_FAILING_DRIVER = f"""
from harness import RankFailure, open_world

def fails_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("rank one says no")

with open_world("threads", world_size=4) as world:
    for _ in range({FAILURES}):
        try:
            world.run(fails_on_rank_1)
        except RankFailure:
            pass
"""


def _fails_on_rank_1(ctx: Any) -> None:
    if ctx.rank == 1:
        raise ValueError("rank one says no")


def _fail_repeatedly(world: Any, times: int) -> None:
    for _ in range(times):
        with pytest.raises(RankFailure):
            world.run(_fails_on_rank_1)


def _hooks() -> tuple[Any, Any]:
    return sys.excepthook, threading.excepthook


@pytest.fixture(scope="module")
def failed_world() -> Iterator[tuple[Any, tuple[Any, Any]]]:
    """A thread World of 4 ranks after FAILURES failed calls, and the hooks before it."""
    originals = _hooks()
    with open_world("threads", world_size=4) as opened:
        world: Any = opened  # a ThreadWorld, which counts its generations
        _fail_repeatedly(world, FAILURES)
        assert world.generations >= FAILURES  # every failed call replaced the ranks
        yield world, originals


def test_hooks_are_the_originals_after_failures_and_after_close(
    failed_world: tuple[Any, tuple[Any, Any]],
) -> None:
    world, (excepthook, thread_excepthook) = failed_world
    assert sys.excepthook is excepthook
    assert threading.excepthook is thread_excepthook
    world.close()
    assert sys.excepthook is excepthook
    assert threading.excepthook is thread_excepthook


def _raised() -> tuple[type[BaseException], BaseException, TracebackType | None]:
    try:
        raise KeyError("the driver's own error")
    except KeyError as exc:
        return KeyError, exc, exc.__traceback__


def test_exceptions_print_without_a_rank_prefix(
    failed_world: tuple[Any, tuple[Any, Any]], capfd: pytest.CaptureFixture[str]
) -> None:
    # (pytest holds threading.excepthook during a test: the driver test prints through it)
    sys.excepthook(*_raised())
    err = capfd.readouterr().err
    assert 'KeyError: "the driver\'s own error"' in err, err
    assert "[rank" not in err, err


def _driver(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` as a driver script in a fresh interpreter, in ``tmp_path``."""
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


_THREAD_ERROR = """
import threading

def fails():
    raise KeyError("a driver thread's error")

thread = threading.Thread(target=fails)
thread.start()
thread.join()
raise RuntimeError("the driver gives up")
"""


def test_driver_errors_after_failures_print_normal_tracebacks(tmp_path: Path) -> None:
    result = _driver(tmp_path, _FAILING_DRIVER + _THREAD_ERROR)
    assert result.returncode == 1, result.stderr
    err = result.stderr
    assert err.startswith("Exception in thread"), err[-3000:]
    assert 'KeyError: "a driver thread\'s error"\nTraceback (most recent call last):' in err
    assert err.rstrip().endswith("RuntimeError: the driver gives up"), err[-3000:]
    for sign in ("RecursionError", "Error in sys.excepthook", "[rank"):
        assert sign not in err, err[-3000:]


_STATE = """
import os, threading
import torch
import torch.distributed as dist
from torch.distributed.tensor._sharding_prop import ShardingPropagator

def state():
    return {
        "c10d world": id(dist.distributed_c10d._world),
        "autograd multithreading": torch._C._is_multithreading_enabled(),
        "environment": dict(os.environ),
        "threads": sorted(t.name for t in threading.enumerate()),
        "default group": dist.is_initialized(),
        "fake shape propagation": ShardingPropagator.__dict__["_propagate_tensor_meta_non_cached"],
    }
"""


def test_a_closed_world_leaves_no_process_wide_state_even_when_reused(tmp_path: Path) -> None:
    result = _driver(
        tmp_path,
        _STATE
        + "before = state()\n"
        + _FAILING_DRIVER
        + textwrap.dedent(
            """
            assert world.run(lambda ctx: ctx.rank) == [0, 1, 2, 3]  # usable again after close
            world.close()
            after = state()
            for key in before:
                print(key, "changed" if before[key] != after[key] else "kept")
            """
        ),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "c10d world kept",
        "autograd multithreading kept",
        "environment kept",
        "threads kept",
        "default group kept",
        "fake shape propagation kept",
    ], result.stdout
