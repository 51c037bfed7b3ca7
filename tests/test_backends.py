"""Devices by name, backends by name or plugin: refused clearly when wrong, and a vendor's
workflow end to end on CPU with the Python-registered backends of ``examples/backends``:
the suites through ``forwarding_gloo`` give gloo's outcomes, and each fault of
``faulty_gloo`` is caught."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import InvalidArgument, WorldStartError, open_world
from harness.outcome.results import read_results
from harness.torchkit.devices import device_count

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ROOT / "examples" / "backends"
CUDA_MARK = "CUDA-specific"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(BACKENDS)])}


def _harness_run(out: Path, *options: str) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "harness", "run", "--runner", "processes", "--world-sizes", "3",
        "--profile", "dev", "--seed", "1", "--jobs", "1", "--out", str(out), *options,
    ]  # fmt: skip
    return subprocess.Popen(
        command, cwd=out.parent, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


def _finish(process: subprocess.Popen[str]) -> tuple[int, str]:
    output, _ = process.communicate(timeout=900)
    return process.returncode, output


def _outcomes(out: Path) -> dict[str, str]:
    tests = [t for f in sorted(out.glob("results*.jsonl")) for t in read_results(f).tests]
    return {t["nodeid"]: t["status"] for t in tests}


def _header(out: Path) -> dict[str, object]:
    header = read_results(out / "results.jsonl").header
    assert header is not None
    return header


# --- the vendor's workflow ------------------------------------------------------------------

SUITES = ("--suite", "placements", "--suite", "uneven", "--suite", "state_dict")


def test_a_python_backend_serves_the_suites_with_gloos_outcomes(tmp_path):
    plugin = ("--backend-plugin", "forwarding_gloo", "--backend", "forwarding_gloo")
    gloo = _harness_run(tmp_path / "gloo", *SUITES)
    forwarded = _harness_run(tmp_path / "forwarded", *SUITES, *plugin)
    (gloo_code, gloo_output), (code, output) = _finish(gloo), _finish(forwarded)
    assert gloo_code == 0, gloo_output[-3000:]
    assert code == 0, output[-3000:]
    assert _header(tmp_path / "forwarded")["backend"] == "forwarding_gloo"
    assert _header(tmp_path / "gloo")["backend"] == "gloo"
    expected = _outcomes(tmp_path / "gloo")
    assert sum(status == "passed" for status in expected.values()) > 30
    assert _outcomes(tmp_path / "forwarded") == expected


@pytest.mark.parametrize(
    "backend", ["faulty_reduce_scatter", "faulty_all_reduce", "faulty_broadcast"]
)
def test_a_faulty_backend_is_caught(tmp_path, backend):
    out = tmp_path / "out"
    plugin = ("--backend-plugin", "faulty_gloo", "--backend", backend)
    code, output = _finish(_harness_run(out, "--suite", "placements", *plugin, "--", "-x"))
    assert code == 1, output[-3000:]
    assert "new failures" in output
    failed = [t for t in read_results(out / "results.jsonl").tests if t["status"] == "failed"]
    assert failed, output[-3000:]
    assert all("should be" in (t["error"] or "") for t in failed), failed[0]["error"]


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device": "tpu"}, "device='tpu' must be cpu or an accelerator type torch knows"),
        ({"device": "cuda:0"}, "device='cuda:0' must be a device type without an index"),
        ({"device": "meta"}, "device='meta' must be cpu or an accelerator type"),
        ({"runner": "threads", "backend": "gloo"}, "backend='gloo' must be unset on the thread"),
        ({"backend": "nope"}, "backend='nope' must be a backend registered with torch.distrib"),
        ({"backend": "nccl"}, "backend='nccl' must be a backend for cpu: it serves ['cuda']"),
        ({"backend_plugins": ("no_such_plugin",)}, "backend_plugin='no_such_plugin' must be a"),
    ],
)
def test_a_bad_device_backend_or_plugin_is_refused_before_any_rank_starts(kwargs, message):
    options = {"runner": "processes", "world_size": 2, **kwargs}
    with pytest.raises(InvalidArgument) as info, open_world(**options):
        pass
    assert str(info.value).startswith(message)


@pytest.mark.skipif(device_count("cuda") > 0, reason="needs a host without a CUDA GPU")
def test_an_absent_accelerator_is_refused_naming_what_torch_said():
    with pytest.raises(InvalidArgument) as info, open_world(device="cuda"):
        pass
    assert "device='cuda' must be a device this machine has: torch.cuda.is_available() is " in (
        str(info.value)
    )


def test_plugins_are_imported_before_the_device_is_checked(tmp_path):
    # A plugin may add a device type: PrivateUse1 renamed, as out-of-tree devices do. (Torch
    # keeps the name for the process's life: a process of its own.)
    (tmp_path / "names_a_device.py").write_text(
        "import torch\ntorch.utils.rename_privateuse1_backend('distconfdev')\n"
    )
    command = [
        sys.executable, "-m", "harness", "run", "--device", "distconfdev",
        "--backend-plugin", "names_a_device", "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    env = {**_env(), "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 4, done.stdout + done.stderr
    assert "--device='distconfdev' must be a device this machine has" in done.stderr
    assert "has no module torch.distconfdev" in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_plugin_that_fails_in_the_driver_shows_its_traceback(tmp_path, monkeypatch):
    (tmp_path / "broken_plugin.py").write_text("raise RuntimeError('no such library: libfoo')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with (
        pytest.raises(InvalidArgument) as info,
        open_world("processes", backend_plugins=("broken_plugin",)),
    ):
        pass
    assert "backend_plugin='broken_plugin' must be a module this Python can import" in str(
        info.value
    )
    assert "RuntimeError: no such library: libfoo" in str(info.value)


RANK_ONLY_FAILURE = """
import multiprocessing

if multiprocessing.current_process().name.startswith("distconf-rank"):
    raise ImportError("libvendor.so: cannot open shared object file (rank side)")
"""


def test_a_plugin_that_fails_in_a_rank_shows_the_ranks_traceback_once(tmp_path, monkeypatch):
    (tmp_path / "rank_plugin.py").write_text(RANK_ONLY_FAILURE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with (
        pytest.raises(WorldStartError) as info,
        open_world("processes", backend_plugins=("rank_plugin",)) as world,
    ):
        world.run(_rank)
    text = str(info.value)
    assert "importing the --backend-plugin modules in the rank: ImportError: libvendor.so" in text
    assert 'File "' in text and "rank_plugin.py" in text  # the rank's own traceback
    assert "attempts to start" not in text  # it would fail alike: not retried


def test_a_registered_backend_is_what_the_ranks_run(monkeypatch):
    monkeypatch.syspath_prepend(str(BACKENDS))
    with open_world(
        "processes", backend="forwarding_gloo", backend_plugins=("forwarding_gloo",)
    ) as world:
        assert world.run(_backend_and_sum) == [("forwarding_gloo", 1.0), ("forwarding_gloo", 1.0)]


def _rank(ctx):
    return ctx.rank


def _backend_and_sum(ctx):
    import torch
    import torch.distributed as dist

    ones = torch.full((1,), 0.5)
    dist.all_reduce(ones)
    return dist.get_backend(), float(ones)


# --- no torch.cuda where the accelerator API serves ----------------------------------------

SCANNED = ("harness", "suites", "specs", "tests", "examples", "noxfile.py")


def test_no_torch_cuda_call_outside_code_marked_cuda_specific():
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in _python_files()
        if path != Path(__file__).resolve()
        for number in _unmarked_cuda_calls(path.read_text())
    ]
    assert not offenders, "torch.cuda outside code marked CUDA-specific: " + ", ".join(offenders)


def test_the_scan_flags_an_unmarked_call_and_passes_a_marked_one():
    text = (
        "count = torch.cuda.device_count()\n"
        "# CUDA-specific: only torch.cuda tells NCCL's version\n"
        "version = torch.cuda.nccl.version()\n"
        "ok = torch.cuda.is_available()  # CUDA-specific\n"
    )
    assert _unmarked_cuda_calls(text) == [1]


def _unmarked_cuda_calls(text: str) -> list[int]:
    """Lines calling into ``torch.cuda`` with no CUDA-specific mark on them or just above."""
    lines = text.splitlines()
    return [
        number
        for number, line in enumerate(lines, start=1)
        if "torch.cuda." in line
        and CUDA_MARK not in line + (lines[number - 2] if number > 1 else "")
    ]


def _python_files() -> list[Path]:
    found = []
    for name in SCANNED:
        path = ROOT / name
        found += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return found
