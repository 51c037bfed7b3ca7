"""Examples per second of real suite properties.

Runs the properties through pytest with a fixed, derandomized example count and divides the
examples hypothesis ran by the wall time the results record; so the figure includes all a
conformance run pays per example: drawing the case, the numpy model, the World call on
every rank and the comparison.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from harness import session
from harness.config import RunConfig

PROPERTIES = {
    "distribute": "test_placements.py::test_distribute_tensor_matches_model",
    "redistribute": "test_placements.py::test_redistribute_preserves_global_value",
}


def bench_properties(
    world_size: int, examples: int, runner: str = "threads"
) -> list[dict[str, float]]:
    """Examples per second of each property in ``PROPERTIES`` at ``world_size``."""
    from hypothesis import settings

    from harness.results import read_results

    settings.register_profile(
        "bench", max_examples=examples, derandomize=True, database=None, deadline=None
    )
    rows = []
    for name, node in PROPERTIES.items():
        with tempfile.TemporaryDirectory() as out:
            run = RunConfig(
                runner=runner, world_sizes=(world_size,), profile="bench", out=Path(out)
            )
            code = session.run_pytest(run, tests=[node], extra=["--no-header"])
            if code != 0:
                raise RuntimeError(
                    f"benchmark property {node} did not pass (pytest exit code {code})"
                )
            (record,) = read_results(Path(out) / session.RESULTS).tests
        rows.append(
            {
                "property": name,
                "examples": record["examples"],
                "seconds": record["duration"],
                "examples_per_second": record["examples"] / record["duration"],
            }
        )
    return rows
