"""Benchmarks that print figures (never timed assertions): ``python -m harness bench``.

``properties``: examples per second of the placement properties, on the thread and local
runners side by side unless ``--runner`` names one (``properties.py``).
``overhead``: milliseconds per ``world.run`` for the thread and process runners at world
sizes 2 and 4, on a trivial and on a placement body, against spawning ranks per check; the
torchrun runner's at world size 4 (two local "nodes") against the process runner's; and the
local runner's against the thread runner's at world sizes 4, 8, 16 and 64 (``overhead.py``).
``soak``: a World per runner takes thousands of calls, every tenth failing; calls lost or
misattributed, memory growth and slowdown (``soak.py``; not part of ``all``).

The submodules load when their benchmark runs: rank processes unpickle ``soak``'s functions
and need none of the others' imports (hypothesis, the strategies).
"""

from __future__ import annotations

import json
from typing import Any

from harness.errors import check_int


def run_properties(world_size: int, examples: int, runners: tuple[str, ...]) -> dict[str, Any]:
    """Each property's examples per second on each of ``runners``, side by side."""
    from harness.bench import properties

    by_runner = {r: properties.bench_properties(world_size, examples, r) for r in runners}
    ratio = len(runners) == 2
    print(f"\nproperties: world size {world_size}, examples per second")
    head = "".join(f"{runner:>13}" for runner in runners)
    print(f"{'property':<14}{head}" + (f"{runners[1] + '/' + runners[0]:>17}" if ratio else ""))
    notes = []
    for index, name in enumerate(properties.PROPERTIES):
        rows = [by_runner[runner][index] for runner in runners]
        cells = "".join(
            f"{row['examples_per_second']:>12.1f}{'*' if row['known'] else ' '}" for row in rows
        )
        versus = rows[1]["examples_per_second"] / rows[0]["examples_per_second"] if ratio else 0
        print(f"{name:<14}{cells}" + (f"{versus:>16.2f}x" if ratio else ""))
        notes += [
            f"{runner} {name}: met {row['known']} at example {row['examples_to_failure']}; "
            f"the figure counts all {row['examples']} examples run, shrinking included"
            for runner, row in zip(runners, rows, strict=True)
            if row["known"]
        ]
    totals = [
        sum(r["examples"] for r in by_runner[runner]) / sum(r["seconds"] for r in by_runner[runner])
        for runner in runners
    ]
    print(f"{'all':<14}" + "".join(f"{total:>12.1f} " for total in totals))
    for note in notes:
        print(f"  * {note}")
    return {"world_size": world_size, "runners": by_runner}


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
    rows += _local_rows(calls)
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


PROPERTY_RUNNERS = ("threads", "local")
"""The runners ``properties`` compares when none is named."""

LOCAL_WORLD_SIZES = (4, 8, 16, 64)
"""Where ``overhead`` times the local runner against the thread runner; beyond world size 4
with a fifth of the calls, at least 10 unless fewer were asked (a 64-rank placement call
takes about a tenth of a second)."""


def _local_rows(calls: int) -> list[dict[str, Any]]:
    """The local runner's ms per ``world.run`` next to the thread runner's, on the cases
    both serve (the local runner lacks some mesh constructions and source ranks)."""
    from harness.bench import overhead
    from harness.runners.local import LocalWorld

    print("\nlocal (one thread simulates every rank) against threads, cases both serve")
    print(f"{'runner':<11}{'ws':>3}{'body':>11}{'ms/call':>10}{'threads':>11}{'ratio':>10}")
    local_rows = []
    for world_size in LOCAL_WORLD_SIZES:
        count = calls if world_size <= 4 else min(calls, max(10, calls // 5))
        for body in ("trivial", "placement"):
            times = {
                runner: overhead.time_calls(runner, world_size, body, count, lacks=LocalWorld.lacks)
                for runner in ("threads", "local")
            }
            row = {
                "runner": "local",
                "world_size": world_size,
                "body": body,
                "ms_per_call": times["local"],
                "threads_ms_per_call": times["threads"],
            }
            local_rows.append(row)
            print(
                f"{'local':<11}{world_size:>3}{body:>11}{times['local']:>10.3f}"
                f"{times['threads']:>11.3f}{times['local'] / times['threads']:>9.2f}x"
            )
    return local_rows


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
        runners = (runner,) if runner else PROPERTY_RUNNERS
        report["properties"] = run_properties(world_size, examples, runners)
    if what in ("overhead", "all"):
        report["overhead"] = run_overhead([2, 4], calls, trials)
    if as_json:
        print(json.dumps(report))
    return 0
