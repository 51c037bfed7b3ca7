"""README's "Using it" examples run as written, each with a tiny selection where it would be
long: the smallest of its world sizes (1 where it names none), the ``dev`` profile, one
process, a test or two of each suite it names, a few benchmark calls. A device this machine
lacks is refused before anything runs, as README says."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ONE_TEST_OF = {
    "placements": "test_dtensor_factories_make_what_torch_factories_make",
    "uneven": "test_shard_gives_torch_chunk_pieces",
    "fsdp_init": "test_managed_modules_match_model",
    "state_dict": "test_state_dict_is_the_same_before_and_after_a_forward",
    "state_dict_steps": "test_resuming_from_a_state_dict_taken_inside_a_step",
    "checkpoint_loads": "test_a_checkpoint_of_n_ranks_reads_without_a_process_group",
    "checkpoints": "test_scheduler_and_stateful_resume_exactly",
    "optim_parity": "test_fused_sgd_steps_sharded_parameters",
    "tp": "test_tp_mlp_inference_matches_one_device",
    "hsdp": "test_fully_shard_hybrid_trains_like_full_shard",
    "ops": "test_op_on_dtensors_matches_one_device and sigmoid",
    "ddp": "test_join_options_follow_the_documented_arithmetic",
    "schedules": "test_lr_schedules_match_the_spec_model",
    "compile": "test_compiled_programs_match_eager_aot_eager",
}
"""A quick test of each suite: an example's run selects these of the suites it names."""
TINY_BENCH = {
    "all": ["--examples", "1", "--calls", "2", "--trials", "1", "--world-size", "2"],
    "soak": ["--calls", "20", "--world-size", "2"],
}


def examples() -> list[str]:
    """The commands of the first block of README's "Using it", comments dropped."""
    section = (ROOT / "README.md").read_text(encoding="utf-8").split("\n## Using it\n", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [shlex.join(shlex.split(line, comments=True)) for line in block.splitlines()]


def _option(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


def _suites(words: list[str]) -> list[str]:
    named = [words[i + 1] for i, word in enumerate(words) if word == "--suite"]
    return [suite for value in named for suite in value.split(",")] or ["placements"]


def _smallest_world(words: list[str]) -> list[str]:
    sizes = _option(words, "--world-sizes")
    smallest = min(map(int, sizes.split(","))) if sizes else 1
    words = _without(words, "--world-sizes")
    return [*words, "--world-sizes", str(smallest)]


def _without(words: list[str], name: str) -> list[str]:
    if name not in words:
        return words
    at = words.index(name)
    return words[:at] + words[at + 2 :]


def tiny(example: str) -> list[str]:
    """The example's command, its selection made tiny."""
    words = shlex.split(example)
    selected = " or ".join(ONE_TEST_OF[suite] for suite in _suites(words))
    if words[:3] == ["python", "-m", "harness"]:
        command = words[3]
        if command == "bench":
            what = words[4] if len(words) > 4 else "all"
            return [sys.executable, *words[1:], *TINY_BENCH[what]]
        if command != "run":
            return [sys.executable, *words[1:]]
        words = _without(_smallest_world(words), "--profile")
        return [sys.executable, *words[1:], "--profile", "dev", "--jobs", "1", "--", "-k", selected]
    assert words[0] == "pytest", example
    words = _without(_smallest_world(words), "--hypothesis-profile")
    suites = [str(ROOT / "suites") if word == "suites" else word for word in words[1:]]
    return [
        sys.executable, "-m", "pytest", *suites, "-p", "no:cacheprovider",
        "--hypothesis-profile", "dev", "-k", selected,
    ]  # fmt: skip


def _lacks(device: str) -> bool:
    import torch

    return not hasattr(torch, device) or not getattr(torch, device).is_available()


@pytest.mark.parametrize("example", examples())
def test_each_example_of_using_it_runs_as_written(example, tmp_path):
    command = tiny(example)
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    output = done.stdout + done.stderr
    device = _option(shlex.split(example), "--device")
    if device is not None and _lacks(device):
        assert done.returncode == 4, output[-3000:]
        assert f"--device={device!r} must be" in output
        return
    assert done.returncode == 0, f"{shlex.join(command)}\n{output[-3000:]}"
    if "harness run" in example:
        assert done.stdout.rstrip().splitlines()[-1].startswith("verdict: pass: ")


def test_the_examples_are_those_of_the_readme():
    """A guard on the parsing above: README's block has its runs, list, bench and pytest."""
    found = examples()
    assert found[0] == "python -m harness list"
    assert sum(e.startswith("python -m harness run ") for e in found) >= 8
    assert any(e.startswith("pytest suites ") for e in found)
    assert all(e.split()[0] in ("python", "pytest") for e in found)
