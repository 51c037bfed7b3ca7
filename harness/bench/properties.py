"""Examples per second of real suite properties.

Runs the properties through pytest with a fixed, derandomized example count and divides the
examples hypothesis ran by the wall time the results record; so the figure includes all a
conformance run pays per example: drawing the case, the numpy model, the World call on
every rank and the comparison.

A property a runner serves only in part (the local runner cannot simulate every mesh
construction drawn) stops at its first known limitation: its row says so, and its figure
covers the examples run until then and the shrinking that followed.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from harness import session
from harness.config import RunConfig
from harness.outcome import verdict
from harness.outcome.results import read_results

MEASURED = ("pass", "unverified")
"""The verdicts (``harness.outcome.verdict``) of a run that gives a figure: it ran to its end and
caught nothing; a known deviation it met, verified on this torch or not, is named."""
PROPERTIES = {
    "distribute": "test_placements.py::test_distribute_tensor_matches_model",
    "redistribute": "test_placements.py::test_redistribute_preserves_global_value",
    "torch_chunk": "test_uneven.py::test_shard_gives_torch_chunk_pieces",
}
"""The properties timed: the two placement properties, and uneven sharding on 1-D meshes,
which every runner serves whole."""


def bench_properties(
    world_size: int, examples: int, runner: str = "threads"
) -> list[dict[str, Any]]:
    """Examples per second of each property in ``PROPERTIES`` at ``world_size``; a row whose
    test ended at a known deviation or limitation names it (``known``)."""
    from hypothesis import settings

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
            files = sorted(Path(out).glob("results*.jsonl"))
            read = [(str(path), read_results(path)) for path in files]
            judged = verdict.of_results(read)
            if judged.kind not in MEASURED:
                raise RuntimeError(
                    f"benchmark property {node} gave no figure on the {runner} runner (pytest "
                    f"exit code {code}): {judged.kind}: {judged.text}"
                )
            (record,) = [record for _, results in read for record in results.tests]
        expectation = record.get("expectation") or {}
        known = expectation.get("source") if record["status"] == "xfailed" else None
        rows.append(
            {
                "property": name,
                "examples": record["examples"],
                "seconds": record["duration"],
                "examples_per_second": record["examples"] / record["duration"],
                "status": record["status"],
                "known": known,
                "examples_to_failure": record.get("examples_to_failure"),
            }
        )
    return rows
