"""The measured public API surface: the inventory of the running torch, the recorder
(``harness.torchkit.surface``) in a process of its own, ``python -m harness surface``'s
statuses, drops and refusals on hand-written surface folders, and one small run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from harness.errors import CatalogueError
from harness.outcome import outputs
from harness.report import surface as surface_report
from harness.report import surface_refused
from harness.torchkit import surface
from harness.torchkit.surface.values import summary

ROOT = Path(__file__).resolve().parent.parent


def _options() -> set[str]:
    return {api.option_id(o.name) for api in surface.inventory() for o in api.options}


def test_the_inventory_has_options_in_every_area():
    areas = {api.area for api in surface.inventory() if api.options}
    assert areas == set(surface.AREAS)
    expected = {
        "torch.distributed.tensor.distribute_tensor(placements)",
        "torch.distributed.tensor.DTensor.redistribute(async_op)",
        "torch.distributed.tensor.parallel.ColwiseParallel(input_layouts)",
        "torch.distributed.fsdp.fully_shard(reshard_after_forward)",
        "torch.distributed.fsdp.FSDPModule.set_reshard_after_backward(reshard_after_backward)",
        "torch.distributed.fsdp.FullyShardedDataParallel(sharding_strategy)",
        "torch.nn.parallel.DistributedDataParallel(bucket_cap_mb)",
        "torch.distributed.checkpoint.state_dict.StateDictOptions(full_state_dict)",
        "torch.optim.SGD(lr)",
        "torch.nn.utils.clip_grad_norm_(norm_type)",
        "torch.utils.checkpoint.checkpoint(use_reentrant)",
        "torch.compile(fullgraph)",
    }
    options = _options()
    assert expected <= options
    data = {"torch.distributed.fsdp.fully_shard(module)", "torch.optim.SGD(params)"}
    assert not data & options, "the data a call works on is no option"
    assert not any("(_" in name for name in options), "private parameters are no options"


def test_values_read_as_short_stable_texts():
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import Shard

    assert [summary(v) for v in (True, 3, 0.1, "max", None)] == [
        "True",
        "3",
        "0.1",
        "'max'",
        "None",
    ]
    assert summary(torch.bfloat16) == "torch.bfloat16"
    assert summary([Shard(0), Shard(1)]) == "[Shard(dim=0), Shard(dim=1)]"
    assert summary(MixedPrecisionPolicy(param_dtype=torch.float16)) == (
        "MixedPrecisionPolicy(param_dtype=torch.float16)"
    )
    assert summary(object()) == "object"
    assert len(summary("x" * 500)) == 60


RECORDING = """
import json, os, sys
import torch
from harness.torchkit import surface

surface.install(sys.argv[1])
surface.install(sys.argv[1])
import torch.distributed.fsdp as fsdp
from torch.distributed.fsdp._fully_shard import _fully_shard
steps = {"re-exports wrapped": fsdp.fully_shard is _fully_shard.fully_shard,
         "keeps its attributes": hasattr(fsdp.fully_shard, "state")}
params = [torch.nn.Parameter(torch.ones(2))]
steps["nothing yet"] = surface.end()
surface.begin("test_a")
torch.optim.SGD(params, 0.5, weight_decay=0.1)
torch.optim.SGD(params)
torch.optim.AdamW(params, lr=0.25)  # its own Adam.__init__ call is torch's
inside_torch = os.path.join(os.path.dirname(torch.__file__), "inside.py")
exec(compile("torch.optim.SGD(params, lr=9.0)", inside_torch, "exec"))
steps["first"] = surface.end()
steps["after"] = surface.end()
print(json.dumps(steps))
"""


def test_the_recorder_counts_what_our_code_passes_and_not_torchs_own_calls(tmp_path):
    """In a process of its own: the wraps are process-wide and stay for the process."""
    folder = tmp_path / "surface"
    done = subprocess.run(
        [sys.executable, "-c", RECORDING, str(folder)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    steps = json.loads(done.stdout.strip().splitlines()[-1])
    assert steps == {
        "re-exports wrapped": True, "keeps its attributes": True, "nothing yet": False,
        "first": True, "after": False,
    }  # fmt: skip
    (written,) = folder.glob(surface.FILE_GLOB)
    header, record = (json.loads(line) for line in written.read_text().splitlines())
    assert header["kind"] == "header" and written.name == f"surface-{header['pid']}.jsonl"
    assert record["test"] == "test_a"
    assert record["calls"] == {
        "torch.optim.SGD": {"calls": 2, "options": {"lr": {"0.5": 1}, "weight_decay": {"0.1": 1}}},
        "torch.optim.AdamW": {"calls": 1, "options": {"lr": {"0.25": 1}}},
    }


def _write_surface(folder: Path, pid: int, *tests: dict[str, dict[str, dict[str, int]]]) -> None:
    """A surface file of ``tests``: per test, callable -> option -> value -> calls; each
    callable called as often as its most passed option (plus one where ``calls`` says)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [{"kind": "header", "torch": "2.13.0+cpu", "pid": pid}]
    for index, calls in enumerate(tests):
        recorded = {}
        for api, options in calls.items():
            extra = options.pop("calls", {}).get("extra", 0)
            most = max((sum(v.values()) for v in options.values()), default=0)
            recorded[api] = {"calls": most + extra, "options": options}
        lines.append({"test": f"test_{index}", "calls": recorded})
    (folder / f"surface-{pid}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


APIS = (
    surface.Api("optim", "m", "f", (surface.Option("a", "1"), surface.Option("b", "None"))),
    surface.Api("optim", "m", "g", (surface.Option("c", "False"), surface.Option("d", None))),
    surface.Api("tp", "m", "h", (surface.Option("e", "0"),)),
)


def test_statuses_drawn_fixed_absent_refused_and_the_shares(tmp_path):
    _write_surface(
        tmp_path / "run" / outputs.SURFACE, 1,
        {"m.f": {"a": {"1": 1, "2": 1}, "b": {"x": 2}}},  # a: two values; b: one, every call
        {"m.g": {"c": {"True": 1}, "calls": {"extra": 1}}},  # c: True once, its default once
    )  # fmt: skip
    refused = {"m.g(d)": surface_refused.Refusal("m.g(d)", "no spec needs it", None)}
    recorded = surface_report.read([tmp_path / "run"])
    figures = surface_report.measure(recorded, APIS, refused, "2.13.0+cpu")
    statuses = {row.option: row.status for row in figures.rows}
    assert statuses == {
        "m.f(a)": "drawn", "m.f(b)": "fixed", "m.g(c)": "drawn", "m.g(d)": "refused",
        "m.h(e)": "absent",
    }  # fmt: skip
    assert figures.counts("optim") == {
        "drawn": 2, "fixed": 1, "absent": 0, "refused": 1, "options": 4
    }  # fmt: skip
    assert figures.share("optim") == pytest.approx(200 / 3)
    assert figures.share() == 50.0
    assert (recorded.tests, figures.callables["optim"]) == (2, (2, 2))
    text = surface_report.describe(figures)
    assert "  g(c)  drawn    True ×1, default False ×1" in text
    assert "  g(d)  refused  no spec needs it" in text
    assert "warning" not in text


def test_never_passed_is_fixed_at_its_default_and_many_values_are_drawn(tmp_path):
    capped = {f"v{i}": 1 for i in range(15)} | {surface.OTHER: 4}
    _write_surface(tmp_path, 1, {"m.f": {"a": capped}, "m.h": {"calls": {"extra": 3}}})
    figures = surface_report.measure(surface_report.read([tmp_path]), APIS, {}, "2.13.0+cpu")
    statuses = {row.option: row.status for row in figures.rows}
    assert (statuses["m.f(a)"], statuses["m.f(b)"], statuses["m.h(e)"]) == (
        "drawn", "fixed", "fixed"
    )  # fmt: skip


def _surface_run(directory: Path, lr_values: dict[str, int]) -> Path:
    _write_surface(directory / outputs.SURFACE, 7, {"torch.optim.SGD": {"lr": lr_values}})
    return directory


def test_an_option_the_suites_stop_drawing_is_a_drop(tmp_path, capsys):
    before = _surface_run(tmp_path / "before", {"0.1": 2, "0.5": 1})
    baseline = tmp_path / "before.json"
    assert cli.main(["surface", str(before), "--area", "optim", "--json", str(baseline)]) == 0
    assert json.loads(baseline.read_text())["options"]["torch.optim.SGD(lr)"]["status"] == "drawn"
    assert cli.main(["surface", str(before), "--baseline", str(baseline)]) == 0
    assert "dropped from drawn since" in capsys.readouterr().out
    after = _surface_run(tmp_path / "after", {"0.1": 3})
    assert cli.main(["surface", str(after), "--baseline", str(baseline)]) == 1
    printed = capsys.readouterr().out
    assert "dropped from drawn since" in printed and ": 1\n" in printed
    assert "  torch.optim.SGD(lr): drawn -> fixed" in printed


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ([], "with surface-*.jsonl files (it has none: a run records them with"),
        (["--area", "fsdp3"], "--area='fsdp3' must be one of ("),
        (["--baseline", "nothing.json"], "must be the --json output of an earlier harness"),
    ],
)
def test_the_command_refuses_bad_input_with_a_usage_error(tmp_path, capsys, arguments, message):
    empty = tmp_path / "run"
    empty.mkdir()
    assert cli.main(["surface", str(empty), *arguments]) == cli.USAGE_ERROR
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error
    if not arguments:
        assert f"error: DIR='{empty}' must be a run's output directory" in error


def test_a_surface_file_that_is_not_one_is_refused(tmp_path, capsys):
    (tmp_path / "surface-1.jsonl").write_text('{"test": "t", "calls": []}\n')
    assert cli.main(["surface", str(tmp_path)]) == cli.USAGE_ERROR
    assert "must be a surface file of a run: a header, then records of" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('option = "SGD lr"\nreason = "r"', "option='SGD lr' must be an option as harness"),
        ('option = "torch.optim.SGD(lr)"', "reason=None must be a text"),
        ('option = "torch.optim.SGD(lr)"\nreason = "r"\nwhy = 1', "has unknown fields ['why']"),
        ('option = "torch.optim.SGD(lr)"\nreason = "r"\nspec = "no.such"', "spec='no.such'"),
    ],
)
def test_the_refused_file_is_checked(tmp_path, entry, message):
    path = tmp_path / "refused.toml"
    path.write_text(f"[[refused]]\n{entry}\n")
    with pytest.raises(CatalogueError, match=r"refused.toml: \[\[refused\]\] #1"):
        surface_refused.load(path)
    with pytest.raises(CatalogueError) as raised:
        surface_refused.load(path)
    assert message in str(raised.value)


def test_the_packaged_refused_file_loads_and_a_good_entry_reads():
    assert isinstance(surface_refused.load(), dict)
    assert surface_refused.DEFAULT_PATH.name == "surface_refused.toml"


def test_a_good_refusal_reads(tmp_path):
    path = tmp_path / "refused.toml"
    entry = 'option = "torch.optim.SGD(differentiable)"\nreason = "autograd through a step"'
    path.write_text(f'[[refused]]\n{entry}\nspec = "optim.flags.parity"\n')
    (refusal,) = surface_refused.load(path).values()
    assert (refusal.option, refusal.spec) == (
        "torch.optim.SGD(differentiable)",
        "optim.flags.parity",
    )


def test_an_earlier_runs_surface_folder_moves_aside_with_its_records(tmp_path):
    (tmp_path / "results.jsonl").write_text(json.dumps({"kind": "header", "started": "T1"}) + "\n")
    _write_surface(tmp_path / outputs.SURFACE, 1, {"m.f": {"a": {"1": 1}}})
    target = outputs.keep_earlier(tmp_path)
    assert target is not None and (target / outputs.SURFACE).is_dir()
    assert not (tmp_path / outputs.SURFACE).exists()


@pytest.mark.parametrize("runner", ["threads", "processes"])
def test_a_run_records_the_options_its_tests_pass(tmp_path, short_tmp, runner):
    """One fast property of optim_parity: its FSDP meshes are drawn (seed 1), on rank threads
    in pytest's process, and in rank processes, where the driver makes no such call."""
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "harness", "run", "--surface", "--suite", "optim_parity",
        "--runner", runner, "--profile", "dev", "--seed", "1", "--world-sizes", "2",
        "--jobs", "1", "--out", str(out), "--", "-k", "test_optimizer_flags_train_like_one_device",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(short_tmp)},
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    figures = surface_report.of_this_torch([out])
    statuses = {row.option: row.status for row in figures.rows}
    assert statuses["torch.distributed.fsdp.fully_shard(mesh)"] == "drawn"
    assert statuses["torch.distributed.fsdp.fully_shard(ignored_params)"] == "fixed"
    assert figures.recorded.tests == 1  # the reference on one device: the driver calls too
    assert "Public API options drawn: " in (out / outputs.REPORT).read_text()
