"""Benchmarks that print figures (never timed assertions): ``python -m harness bench``.

``properties`` runs real suite properties through pytest with a fixed, derandomized example
count and divides the examples hypothesis ran by the wall time the results record; so the
figure includes everything a conformance run pays per example: drawing the case, the numpy
model, the World call on every rank and the comparison. ``run-overhead`` times a trivial
``world.run`` in a loop.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from harness import catalogue

PROPERTIES = {
    "distribute": "test_placements.py::test_distribute_tensor_matches_model",
    "redistribute": "test_placements.py::test_redistribute_preserves_global_value",
}


def bench_properties(
    world_size: int, examples: int, runner: str = "threads"
) -> list[dict[str, float]]:
    """Examples per second of each property in ``PROPERTIES`` at ``world_size``."""
    import pytest
    from hypothesis import settings

    from harness.results import read_results

    settings.register_profile(
        "bench", max_examples=examples, derandomize=True, database=None, deadline=None
    )
    rows = []
    for name, node in PROPERTIES.items():
        with tempfile.TemporaryDirectory() as out:
            results = Path(out) / "results.jsonl"
            code = pytest.main(
                [
                    str(catalogue.DEFAULT_SUITES / node),
                    "-p",
                    "harness.plugin",
                    "-p",
                    "no:cacheprovider",
                    "-q",
                    "--no-header",
                    "-W",
                    "ignore::pytest.PytestAssertRewriteWarning",
                    f"--runner={runner}",
                    f"--world-sizes={world_size}",
                    "--hypothesis-profile=bench",
                    f"--distconf-results={results}",
                ]
            )
            if code != 0:
                raise RuntimeError(
                    f"benchmark property {node} did not pass (pytest exit code {code})"
                )
            (record,) = read_results(results).tests
        rows.append(
            {
                "property": name,
                "examples": record["examples"],
                "seconds": record["duration"],
                "examples_per_second": record["examples"] / record["duration"],
            }
        )
    return rows


def bench_run_overhead(world_size: int, calls: int, runner: str = "threads") -> dict[str, float]:
    """Mean seconds per trivial ``world.run`` after a warm-up call."""
    from harness import open_world

    with open_world(runner, world_size=world_size) as world:
        world.run(_trivial)
        started = time.perf_counter()
        for _ in range(calls):
            world.run(_trivial)
        elapsed = time.perf_counter() - started
    return {"calls": calls, "seconds": elapsed, "ms_per_call": 1000 * elapsed / calls}


def _trivial(ctx: object) -> None:
    return None


def main(world_size: int, examples: int, calls: int, runner: str, as_json: bool) -> int:
    properties = bench_properties(world_size, examples, runner)
    overhead = bench_run_overhead(world_size, calls, runner)
    if as_json:
        print(
            json.dumps(
                {
                    "world_size": world_size,
                    "runner": runner,
                    "properties": properties,
                    "run_overhead": overhead,
                }
            )
        )
        return 0
    print(f"\ndistconf bench: runner={runner}, world size {world_size}")
    print(f"{'property':<14}{'examples':>10}{'seconds':>10}{'examples/s':>12}")
    for row in properties:
        print(
            f"{row['property']:<14}{row['examples']:>10}{row['seconds']:>10.2f}{row['examples_per_second']:>12.1f}"
        )
    total_examples = sum(r["examples"] for r in properties)
    total_seconds = sum(r["seconds"] for r in properties)
    print(
        f"{'both':<14}{total_examples:>10}{total_seconds:>10.2f}"
        f"{total_examples / total_seconds:>12.1f}"
    )
    print(
        f"world.run overhead (trivial body): {overhead['ms_per_call']:.3f} ms/call "
        f"over {calls} calls"
    )
    return 0
