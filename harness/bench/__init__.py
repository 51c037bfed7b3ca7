"""Benchmarks that print figures (never timed assertions): ``python -m harness bench``.

``properties``: examples per second of the placement properties (``properties.py``).
``overhead``: milliseconds per ``world.run`` for the thread and process runners at world
sizes 2 and 4, on a trivial and on a placement body, against spawning ranks per check, and the
torchrun runner's at world size 4 (two local "nodes") against the process runner's
(``overhead.py``).
``soak``: a World per runner takes thousands of calls, every tenth failing; calls lost or
misattributed, memory growth and slowdown (``soak.py``; not part of ``all``).

The submodules load when their benchmark runs: rank processes unpickle ``soak``'s functions
and need none of the others' imports (hypothesis, the strategies).
"""

from __future__ import annotations

import json
from typing import Any

from harness.errors import check_int


def run_properties(world_size: int, examples: int, runner: str) -> dict[str, Any]:
    from harness.bench import properties

    rows = properties.bench_properties(world_size, examples, runner)
    print(f"\nproperties: runner={runner}, world size {world_size}")
    print(f"{'property':<14}{'examples':>10}{'seconds':>10}{'examples/s':>12}")
    for row in rows:
        print(
            f"{row['property']:<14}{row['examples']:>10}{row['seconds']:>10.2f}"
            f"{row['examples_per_second']:>12.1f}"
        )
    examples_run = sum(r["examples"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    print(f"{'both':<14}{examples_run:>10}{seconds:>10.2f}{examples_run / seconds:>12.1f}")
    return {"runner": runner, "world_size": world_size, "rows": rows}


def run_overhead(world_sizes: list[int], calls: int, trials: int) -> list[dict[str, Any]]:
    from harness.bench import overhead

    rows = []
    print("\nworld.run against spawn-per-check (gloo, CPU)")
    print(f"{'runner':<11}{'ws':>3}{'body':>11}{'ms/call':>10}{'spawn ms':>11}{'ratio':>10}")
    for world_size in world_sizes:
        for body in ("trivial", "placement"):
            spawn_ms = overhead.time_spawn_per_check(world_size, body, trials)
            for runner in ("threads", "processes"):
                call_ms = overhead.time_calls(runner, world_size, body, calls)
                row = {
                    "runner": runner,
                    "world_size": world_size,
                    "body": body,
                    "ms_per_call": call_ms,
                    "spawn_ms_per_check": spawn_ms,
                    "ratio": spawn_ms / call_ms,
                }
                rows.append(row)
                print(
                    f"{runner:<11}{world_size:>3}{body:>11}{call_ms:>10.3f}"
                    f"{spawn_ms:>11.0f}{row['ratio']:>9.0f}x"
                )
    rows += _torchrun_rows(rows, calls)
    return rows


def _torchrun_rows(rows: list[dict[str, Any]], calls: int) -> list[dict[str, Any]]:
    """The torchrun runner at world size 4 (two local "nodes" of two ranks), against the
    process runner's rows of this run."""
    from harness.bench import overhead

    processes = {
        r["body"]: r["ms_per_call"]
        for r in rows
        if r["runner"] == "processes" and r["world_size"] == 4
    }
    print("\ntorchrun (--nnodes 2 --nproc-per-node 2) against processes, world size 4")
    print(f"{'runner':<11}{'ws':>3}{'body':>11}{'ms/call':>10}{'processes':>11}{'ratio':>10}")
    torchrun_rows = []
    for body in ("trivial", "placement"):
        call_ms = overhead.time_calls("torchrun", 4, body, calls)
        against = processes.get(body)
        row = {"runner": "torchrun", "world_size": 4, "body": body, "ms_per_call": call_ms}
        row["processes_ms_per_call"] = against
        torchrun_rows.append(row)
        shown = f"{against:>11.3f}{call_ms / against:>9.2f}x" if against else f"{'-':>11}"
        print(f"{'torchrun':<11}{4:>3}{body:>11}{call_ms:>10.3f}{shown}")
    return torchrun_rows


SOAK_CALLS, OVERHEAD_CALLS = 2000, 300
"""The default ``calls`` of each benchmark."""


def main(
    what: str,
    world_size: int,
    examples: int,
    calls: int | None,
    trials: int,
    runner: str | None,
    as_json: bool,
) -> int:
    """``what``: ``properties``, ``overhead``, ``all`` (both) or ``soak``; ``runner`` None:
    the default runner for ``properties``, every runner for ``soak``."""
    if what == "soak":
        from harness.bench import soak

        runners = (runner,) if runner else soak.SOAK_RUNNERS
        return soak.main(calls or SOAK_CALLS, world_size, runners, as_json)
    calls = calls or OVERHEAD_CALLS
    check_int("world_size", world_size)
    for name, value in (("examples", examples), ("calls", calls), ("trials", trials)):
        check_int(name, value)
    report: dict[str, Any] = {}
    if what in ("properties", "all"):
        report["properties"] = run_properties(world_size, examples, runner or "threads")
    if what in ("overhead", "all"):
        report["overhead"] = run_overhead([2, 4], calls, trials)
    if as_json:
        print(json.dumps(report))
    return 0
