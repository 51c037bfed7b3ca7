"""The whole chain: CLI run, results, summary; and a broken reference model caught and shrunk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _python(*args, cwd=ROOT, env=None, timeout=600):
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )


def test_list_prints_the_catalogue():
    done = _python("-m", "harness", "list")
    assert done.returncode == 0, done.stderr
    assert "placements.distribute.roundtrip" in done.stdout
    assert "from: test/distributed/tensor/test_redistribute.py" in done.stdout


def test_run_writes_one_record_per_spec_and_world_size(tmp_path):
    done = _python(
        "-m",
        "harness",
        "run",
        "--suite",
        "placements",
        "--world-sizes",
        "1,3",
        "--profile",
        "dev",
        "--out",
        str(tmp_path),
        "--junit",
        str(tmp_path / "junit.xml"),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    tests = [r for r in records if r["kind"] == "test"]
    specs = {
        "placements.distribute.roundtrip",
        "placements.distribute.partial_sum_keeps_dtype",
        "placements.redistribute.roundtrip",
        "placements.redistribute.partial_target_rejected",
        "placements.redistribute.partial_extremum_to_shard",
    }
    assert {(r["spec"], r["world_size"]) for r in tests} == {(s, w) for s in specs for w in (1, 3)}
    assert records[0]["profile"] == "dev" and records[-1]["kind"] == "end"
    assert "0 unexpected outcome(s)" in done.stdout
    report = (tmp_path / "report.html").read_text()
    assert "All conformant" in report
    assert "placements.redistribute.partial_target_rejected" in report
    junit = (tmp_path / "junit.xml").read_text()
    assert '<property name="spec" value="placements.distribute.roundtrip"' in junit
    assert "placements.redistribute.roundtrip" in done.stdout


def test_run_rejects_an_unknown_suite():
    done = _python("-m", "harness", "run", "--suite", "nope")
    assert done.returncode != 0
    assert "--suite='nope' is not a suite; choose from [" in done.stderr
    assert all(f"'{suite}'" in done.stderr for suite in ("hsdp", "placements", "tp"))


BROKEN_CHUNKING = """
import specs.chunking as chunking

def off_by_one(n, k):
    chunking._check_sizes(n, k)
    return n // k + 1  # right whenever k does not divide n, one too many when it does

chunking.chunk_size = off_by_one
"""


def test_broken_chunk_model_fails_with_a_shrunk_readable_counterexample(tmp_path):
    (tmp_path / "broken_chunking.py").write_text(textwrap.dedent(BROKEN_CHUNKING))
    done = _python(
        "-m",
        "pytest",
        "suites/test_placements.py::test_distribute_tensor_matches_model",
        "-p",
        "broken_chunking",
        "-p",
        "no:cacheprovider",
        "--world-sizes=2",
        "--hypothesis-profile=ci",
        env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    output = done.stdout
    assert done.returncode == 1, output[-3000:]
    assert "Draw 1 (case): DistributeCase(mesh_shape=(2,)" in output
    assert "placements=(Shard(dim=0),)" in output or "placements=(Shard(dim=-1),)" in output
    assert "to_local() on rank 0 (mesh coord (0,))" in output
    assert "shape=(2,)" in output  # shrunk to the smallest shape the mesh axis divides
