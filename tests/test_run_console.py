"""What ``python -m harness run`` prints: torch's known noise kept off the console (counted,
and kept in the results and the report), every other warning and line shown, the verdict
last. A drill test raises torch's ``torch.jit`` deprecation and leaves a functional
collective unwaited in a process of its own, whose exit torch's C++ reports on stderr."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNWAITED = "unwaited collective calls. Please review your program"
JIT = "`torch.jit.script` is deprecated. Please switch to `torch.compile` or `torch.export`."

UNWAITED_AT_EXIT = """
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD)  # never waited
print("a line of the drill's own", file=sys.stderr)
"""
DRILL = f"""
import subprocess
import sys
import warnings

import torch


def _double(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


def test_noisy(tmp_path, capfd):
    torch.jit.script(_double)
    warnings.warn("a warning of the drill's own", UserWarning)
    warnings.warn_explicit({JIT!r}, DeprecationWarning, "not_torch.py", 1)
    # torch prints it at the exit of a process, where pytest captures nothing
    with capfd.disabled():
        subprocess.run(
            [sys.executable, "-c", {UNWAITED_AT_EXIT!r}, str(tmp_path / "store")], check=True
        )
"""


def test_torchs_known_noise_is_counted_off_the_console_and_the_verdict_is_last(tmp_path):
    """Row 5 of issue 38."""
    (tmp_path / "test_drill.py").write_text(DRILL)
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable, "-m", "harness", "run", "--suite", "uneven", "--world-sizes", "1",
            "--profile", "dev", "--seed", "1", "--jobs", "2", "--out", str(out),
            "--", str(tmp_path / "test_drill.py"), "-k", "noisy",
        ],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-4000:]
    assert UNWAITED not in console
    assert "torch/jit/_script.py" not in console
    # the same words from a file that is not torch's are shown
    assert f"not_torch.py:1: DeprecationWarning: {JIT}" in done.stdout
    assert "a warning of the drill's own" in done.stdout
    assert "a line of the drill's own" in done.stderr
    counted = re.search(r"torch's known noise, kept off this console: (.*)\n", done.stdout)
    assert counted is not None, done.stdout[-3000:]
    assert re.fullmatch(
        r"\d+ × torch\.jit deprecation, 1 × unwaited collective calls at exit", counted[1]
    )
    assert done.stdout.rstrip().splitlines()[-1].startswith("verdict: pass: ")

    kept: Counter[str] = Counter()
    for path in out.glob("results*.jsonl"):
        for record in map(json.loads, path.read_text().splitlines()):
            if record["kind"] == "noise":
                kept[record["what"]] += record["count"]
                if record["source"] == "stderr":  # harness run's, in the run's main file
                    assert path.name == "results.jsonl" and UNWAITED in record["example"]
    assert kept["unwaited collective calls at exit"] == 1 and kept["torch.jit deprecation"] >= 1
    page = (out / "report.html").read_text(encoding="utf-8")
    assert "1 × unwaited collective calls at exit (stderr)" in page
    assert "× torch.jit deprecation (warnings)" in page
