"""Which DTensor ops a run reaches: the recorder (``harness.torchkit.reach``) in a process of
its own, the reach files ``harness run`` leaves and moves aside with an earlier run's records,
and ``python -m harness reach``'s figures and refusals on hand-written reach folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from harness.outcome import outputs
from harness.report import reach as reach_report
from harness.torchkit import reach

ROOT = Path(__file__).resolve().parent.parent

RECORDING = """
import json, sys
from harness import open_world
from harness.torchkit import reach
from torch.distributed.tensor._dispatch import OpDispatcher

def add_and_sum(ctx):
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor
    x = distribute_tensor(torch.ones(4, 4), ctx.mesh((ctx.world_size,)), [Shard(0)])
    return float((x + x).sum().full_tensor())

def mm(ctx):
    import torch
    from torch.distributed.tensor import Replicate, distribute_tensor
    x = distribute_tensor(torch.ones(2, 2), ctx.mesh((ctx.world_size,)), [Replicate()])
    return float(torch.mm(x, x).full_tensor().sum())

reach.install(sys.argv[1])
wrapped = OpDispatcher._propagate_op_sharding_dispatch_slow_path
reach.install(sys.argv[1])
steps = {"wrapped once": OpDispatcher._propagate_op_sharding_dispatch_slow_path is wrapped}
steps["nothing yet"] = reach.flush()
with open_world("threads", world_size=2) as world:
    world.run(add_and_sum)
    steps["first"] = reach.flush()
    steps["same again"] = (world.run(add_and_sum), reach.flush())[1]
with open_world("local", world_size=4) as world:
    world.run(mm)
    steps["mm on local"] = reach.flush()
steps["dispatched"] = sorted(reach.dispatched())
print(json.dumps(steps))
"""


def test_the_recorder_records_what_dtensor_dispatches_and_writes_only_when_it_grew(tmp_path):
    """In a process of its own: the wrap is process-wide and stays for the process."""
    folder = tmp_path / "reach"
    done = subprocess.run(
        [sys.executable, "-c", RECORDING, str(folder)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    steps = json.loads(done.stdout.strip().splitlines()[-1])
    assert steps["wrapped once"] and not steps["nothing yet"]
    assert (steps["first"], steps["same again"], steps["mm on local"]) == (True, False, True)
    assert {"aten.add.Tensor", "aten.sum.default", "aten.mm.default"} <= set(steps["dispatched"])
    (written,) = folder.glob(reach.FILE_GLOB)
    document = json.loads(written.read_text())
    assert document["dispatched"] == steps["dispatched"]
    assert written.name == f"reach-{document['pid']}.json" and document["torch"].startswith("2.")
    assert [p.name for p in folder.iterdir()] == [written.name], "a temp file was left"


def test_packet_is_the_op_of_an_overload():
    assert reach.packet("aten.add.Tensor") == "aten.add"
    assert reach.packet("aten._foreach_add_.List") == "aten._foreach_add_"


def test_the_registered_overloads_are_those_of_the_sharding_propagator():
    from torch.distributed.tensor import DTensor

    registered = reach.registered()
    propagator = DTensor._op_dispatcher.sharding_propagator
    assert "aten.add.Tensor" in registered and "aten.mm.default" in registered
    assert len(registered) >= len(propagator.op_strategy_funcs)


def _write_reach(folder: Path, pid: int, names: list[str], torch: str = "2.13.0") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    record = {"torch": torch, "pid": pid, "dispatched": names}
    (folder / f"reach-{pid}.json").write_text(json.dumps(record))


REGISTERED = frozenset(
    {"aten.add.Tensor", "aten.add.Scalar", "aten.mm.default", "aten.sum.default", "aten.t.default"}
)


def test_the_figures_union_the_folders_and_count_unruled_ops_apart(tmp_path):
    _write_reach(tmp_path / "threads" / outputs.REACH, 11, ["aten.add.Tensor", "aten.mm.default"])
    _write_reach(tmp_path / "threads" / outputs.REACH, 12, ["aten.mm.default", "custom.op.default"])
    _write_reach(tmp_path / "local", 13, ["aten.add.Scalar"])
    dispatched = reach_report.read([tmp_path / "threads", tmp_path / "local"])
    figures = reach_report.measure(dispatched, REGISTERED, "2.13.0")
    assert (figures.files, figures.dispatched_overloads, figures.reached_overloads) == (3, 4, 3)
    assert (figures.registered_packets, figures.reached_packets) == (4, 2)
    assert figures.without_rule == ("custom.op.default",)
    assert figures.missing_packets == ("aten.sum", "aten.t")
    assert (figures.overload_share, figures.packet_share) == (60.0, 50.0)
    assert figures.summary() == "DTensor ops reached: 3 of 5 overloads (60.0 %)"
    text = reach_report.describe(figures, missing=True)
    assert "reached: 3 of 5 overloads (60.0 %), 2 of 4 ops (50.0 %)" in text
    assert "registered ops never reached: 2\n  aten.sum\n  aten.t" in text
    assert "warning" not in text


def test_the_command_prints_and_writes_the_figures_of_this_torch(tmp_path, capsys):
    _write_reach(tmp_path / "run" / outputs.REACH, 1, ["aten.add.Tensor", "no_rule.op.default"])
    figures_file = tmp_path / "figures.json"
    code = cli.main(["reach", str(tmp_path / "run"), "--missing", "--json", str(figures_file)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    written = json.loads(figures_file.read_text())
    registered = reach.registered()
    assert written["registered_overloads"] == len(registered)
    assert (written["reached_overloads"], written["without_rule"]) == (1, ["no_rule.op.default"])
    assert f"reached: 1 of {len(registered)} overloads" in printed
    assert "aten.mm\n" in printed, "--missing lists the ops never reached"
    assert "warning: the files were recorded on another torch" in printed


def _make_bad(directory: Path, kind: str) -> None:
    if kind == "empty":
        directory.mkdir()
    elif kind == "not json":
        (directory / outputs.REACH).mkdir(parents=True)
        (directory / outputs.REACH / "reach-1.json").write_text("{")
    elif kind == "not a list":
        _write_reach(directory, 1, "aten.add.Tensor")


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", "must be a run's output directory or its reach folder (not found)"),
        ("empty", "with reach-*.json files (it has none"),
        ("not json", "must be a reach file of a run"),
        ("not a list", "with a list of overload names under 'dispatched'"),
    ],
)
def test_the_command_refuses_bad_input_with_a_usage_error(tmp_path, capsys, kind, message):
    directory = tmp_path / "run"
    _make_bad(directory, kind)
    assert cli.main(["reach", str(directory)]) == cli.USAGE_ERROR
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error
    if kind == "missing":
        assert f"error: DIR='{directory}' must be" in error


def test_a_json_output_that_cannot_be_written_is_refused_before_anything_is_read(tmp_path, capsys):
    _write_reach(tmp_path / "run", 1, ["aten.add.Tensor"])
    assert cli.main(["reach", str(tmp_path / "run"), "--json", str(tmp_path)]) == 4
    assert f"--json='{tmp_path}' must be a file, and it is a directory" in capsys.readouterr().err


def test_the_report_says_what_the_run_reached_where_it_left_reach_files(tmp_path):
    assert reach_report.summary_of([tmp_path]) is None
    _write_reach(tmp_path / outputs.REACH, 1, ["aten.add.Tensor"])
    line = reach_report.summary_of([tmp_path / "results.jsonl"])
    assert line == f"DTensor ops reached: 1 of {len(reach.registered())} overloads (0.1 %)"


def test_an_earlier_runs_reach_folder_moves_aside_with_its_records(tmp_path):
    (tmp_path / "results.jsonl").write_text(json.dumps({"kind": "header", "started": "T1"}) + "\n")
    _write_reach(tmp_path / outputs.REACH, 1, ["aten.add.Tensor"])
    target = outputs.keep_earlier(tmp_path)
    assert target == tmp_path / "earlier" / "T1"
    assert sorted(p.name for p in target.iterdir()) == ["reach", "results.jsonl"]
    assert not (tmp_path / outputs.REACH).exists()
    _write_reach(tmp_path / outputs.REACH, 2, ["aten.mm.default"])  # a run of no results file
    assert outputs.keep_earlier(tmp_path) == tmp_path / "earlier" / "unknown"


DRILL = """
def _add(ctx):
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor
    x = distribute_tensor(torch.ones(2, 2), ctx.mesh((ctx.world_size,)), [Shard(0)])
    return float((x * x).sum().full_tensor())


def test_reaches_mul(world):
    assert world.run(_add) == [4.0] * world.world_size
"""


@pytest.mark.parametrize("runner", ["threads", "processes"])
def test_a_run_leaves_the_ops_it_reached_in_its_out(tmp_path, runner):
    """Thread ranks record in the pytest process, rank processes in their own files."""
    (tmp_path / "test_drill.py").write_text(DRILL)
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "harness", "run", "--runner", runner, "--suite", "uneven",
        "--world-sizes", "1", "--profile", "dev", "--seed", "1", "--jobs", "1",
        "--out", str(out), "--reach", "--", str(tmp_path / "test_drill.py"), "-k", "reaches_mul",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    dispatched = reach_report.read([out]).overloads
    assert {"aten.mul.Tensor", "aten.sum.default"} <= dispatched
    assert "DTensor ops reached: " in (out / outputs.REPORT).read_text()


def test_a_run_records_nothing_unless_asked(tmp_path):
    (tmp_path / "test_drill.py").write_text(DRILL)
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "harness", "run", "--suite", "uneven", "--world-sizes", "1",
        "--profile", "dev", "--seed", "1", "--jobs", "1", "--out", str(out), "--",
        str(tmp_path / "test_drill.py"), "-k", "reaches_mul",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={k: v for k, v in os.environ.items() if k != "DISTCONF_REACH_DIR"}
        | {"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert not (out / outputs.REACH).exists()
