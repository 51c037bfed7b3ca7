"""GPU leasing for `pytest -n gpu`, tested with a simulated device count."""

from __future__ import annotations

import pytest

from harness.plugin import gpus
from harness.torchkit.devices import device_count

LEASE_PROBE = """
import os
import pytest

@pytest.mark.parametrize("i", range(12))
def test_records_its_lease(i, request):
    worker = getattr(request.config, "workerinput", {}).get("workerid", "main")
    out = os.path.join(os.environ["LEASE_DIR"], f"lease-{worker}-{i}")
    with open(out, "w") as handle:
        handle.write(os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"))

@pytest.mark.gpus(2)
def test_needs_two():
    pass

@pytest.mark.gpus(4)
def test_needs_four():
    pass
"""


@pytest.fixture
def probe(pytester, monkeypatch, tmp_path):
    monkeypatch.setenv("LEASE_DIR", str(tmp_path))
    pytester.makepyfile(test_probe=LEASE_PROBE)
    return tmp_path


def _leases(directory):
    """The CUDA_VISIBLE_DEVICES each worker saw, by worker."""
    by_worker: dict[str, set[str]] = {}
    for path in directory.glob("lease-*"):
        worker = path.name.split("-")[1]
        by_worker.setdefault(worker, set()).add(path.read_text())
    assert sum(len(v) for v in by_worker.values()) >= 1
    return by_worker


@pytest.mark.parametrize(
    ("env", "per_worker", "expected"),
    [
        ({"DISTCONF_SIMULATED_GPUS": "4"}, 2, {frozenset({"0,1"}), frozenset({"2,3"})}),
        (
            {"DISTCONF_SIMULATED_GPUS": "3", "CUDA_VISIBLE_DEVICES": "3,5,7"},
            1,
            {frozenset({"3"}), frozenset({"5"}), frozenset({"7"})},
        ),
    ],
)
def test_each_worker_holds_a_disjoint_group(
    pytester, monkeypatch, probe, env, per_worker, expected
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    run = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-n", "gpu", f"--gpus-per-worker={per_worker}", "-rs"
    )
    leases = _leases(probe)
    assert {frozenset(v) for v in leases.values()} == expected
    assert "main" not in leases
    run.stdout.fnmatch_lines([f"*this test needs 4 GPU(s); this process holds {per_worker}*"])


def test_without_gpus_it_runs_in_process_and_gpu_tests_skip_visibly(pytester, monkeypatch, probe):
    monkeypatch.setenv("DISTCONF_SIMULATED_GPUS", "0")
    run = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "gpu", "-rs")
    run.assert_outcomes(passed=12, skipped=2)
    run.stdout.fnmatch_lines(["*this test needs 2 GPU(s); this process holds 0*"])
    assert set(_leases(probe)) == {"main"}


def test_require_gpus_turns_those_skips_into_failures(pytester, monkeypatch, probe):
    monkeypatch.setenv("DISTCONF_SIMULATED_GPUS", "0")
    run = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "gpu", "--require-gpus")
    run.assert_outcomes(passed=12, errors=2)  # failed in setup, before the test ran
    run.stdout.fnmatch_lines(["*needs 2 GPU(s); this process holds 0 (--require-gpus)*"])


@pytest.mark.skipif(device_count("cuda") > 0, reason="needs a host without a CUDA GPU")
def test_cuda_without_a_gpu_is_refused_before_anything_runs(pytester, monkeypatch, tmp_path):
    # A run whose every test skipped for want of the device used to end "All conformant".
    monkeypatch.setenv("DISTCONF_SIMULATED_GPUS", "0")
    ran = tmp_path / "ran"
    pytester.makepyfile(test_w=f"def test_w(world):\n    open({str(ran)!r}, 'w').close()\n")
    run = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--device=cuda", "--runner=processes", "--world-sizes=2"
    )
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    run.stderr.fnmatch_lines(["*--device='cuda' must be a device this machine has*"])
    assert not ran.exists()


@pytest.mark.parametrize(
    ("ids", "per_worker", "groups"),
    [
        (["0", "1", "2", "3"], 2, [["0", "1"], ["2", "3"]]),
        (["0", "1", "2"], 2, [["0", "1"]]),
        (["4", "6"], 4, []),
        ([], 1, []),
    ],
)
def test_plan_workers_makes_disjoint_whole_groups(ids, per_worker, groups):
    assert gpus.plan_workers(ids, per_worker) == groups


def test_bad_leasing_arguments_name_the_value():
    with pytest.raises(ValueError, match="per_worker=0 must be a positive int"):
        gpus.plan_workers(["0"], 0)
    with pytest.raises(ValueError, match="DISTCONF_SIMULATED_GPUS='two' must be"):
        gpus.visible_gpus({"DISTCONF_SIMULATED_GPUS": "two"})


def test_outer_cuda_visible_devices_is_honoured():
    env = {"DISTCONF_SIMULATED_GPUS": "2", "CUDA_VISIBLE_DEVICES": "5, 7"}
    assert gpus.visible_gpus(env) == ["5", "7"]
    assert gpus.worker_specs([["5"], ["7"]]) == [
        "popen//env:CUDA_VISIBLE_DEVICES=5",
        "popen//env:CUDA_VISIBLE_DEVICES=7",
    ]


def test_gpu_workers_also_when_the_plugin_is_named_before_xdist(pytester, monkeypatch, probe):
    """A checkout that is not installed names the plugin with ``-p``: it then registers before
    xdist, whose own ``-n`` handling would otherwise see "gpu" first."""
    monkeypatch.setenv("DISTCONF_SIMULATED_GPUS", "0")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    run = pytester.runpytest_subprocess(
        "-p", "harness.plugin", "-p", "xdist.plugin", "-p", "no:cacheprovider", "-n", "gpu", "-rs"
    )
    run.assert_outcomes(passed=12, skipped=2)
