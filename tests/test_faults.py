"""The fault catalogue: patches apply and revert exactly, fail loudly when their target is
gone, reach rank processes; each fault in the module of its area, saying how it was written;
fault files of one's own. ``mutate`` itself: ``test_mutate``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import catalogue, faults
from harness.errors import InvalidArgument
from harness.faults import WITH_THE_PROPERTY, Fault, FaultError, Origin, Patch, blind, held_out

MODULE = """
class Owner:
    @staticmethod
    def static(x):
        return x

    def method(self, x):
        return x


def function(x):
    return x
"""


@pytest.fixture
def victim(tmp_path, monkeypatch):
    (tmp_path / "fault_victim.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    import fault_victim

    yield fault_victim
    sys.modules.pop("fault_victim", None)


def _doubled(original):
    return lambda *args: 2 * original(*args)


def test_patches_apply_and_revert_functions_methods_and_staticmethods(victim):
    before = {name: vars(victim.Owner)[name] for name in ("static", "method")}
    fault = Fault(
        id="test.doubled",
        area="placements",
        bug_class="test",
        summary="doubles",
        patches=(
            Patch("fault_victim:function", _doubled),
            Patch("fault_victim:Owner.static", _doubled),
            Patch("fault_victim:Owner.method", _doubled),
        ),
    )
    undo = fault.apply()
    assert victim.function(3) == 6
    assert victim.Owner.static(3) == 6 and victim.Owner().static(3) == 6
    assert victim.Owner().method(3) == 6
    undo()
    assert victim.function(3) == 3
    assert {name: vars(victim.Owner)[name] for name in before} == before


def test_a_fault_applies_all_of_its_patches_or_none(victim):
    fault = Fault(
        id="test.half",
        area="placements",
        bug_class="test",
        summary="second target is gone",
        patches=(Patch("fault_victim:function", _doubled), Patch("fault_victim:gone", _doubled)),
    )
    with pytest.raises(FaultError, match="'gone' does not exist in torch"):
        fault.apply()
    assert victim.function(3) == 3


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("fault_victim:Owner.gone", "'gone' does not exist"),
        ("fault_victim:Missing.static", "'Missing' does not exist"),
        ("no_such_module_here:f", "cannot import no_such_module_here"),
        ("fault_victim.function", "must look like 'package.module:Owner.name'"),
    ],
)
def test_a_missing_target_is_a_loud_error_naming_it(victim, target, message):
    with pytest.raises(FaultError, match=message):
        Patch(target, _doubled).apply()


@pytest.mark.parametrize("fault", list(faults.FAULTS.values()), ids=lambda f: f.id)
def test_every_catalogued_fault_applies_to_this_torch_and_reverts(fault):
    targets = [patch._resolve() for patch in fault.patches]
    before = [vars(owner).get(name, owner.__dict__.get(name)) for owner, name in targets]
    undo = fault.apply()
    assert [getattr(owner, name) for owner, name in targets] != before
    undo()
    assert [vars(owner).get(name, owner.__dict__.get(name)) for owner, name in targets] == before


def test_the_catalogue_has_unique_ids_in_known_areas_and_covers_the_mission():
    areas = {spec.area for spec in catalogue.load().values()}
    assert len(faults.FAULTS) >= 15
    for fault in faults.FAULTS.values():
        assert fault.area in areas, f"{fault.id}: area={fault.area!r} should be one of {areas}"
        assert fault.summary and fault.bug_class and fault.patches


def test_each_module_holds_the_faults_of_the_area_it_is_named_for():
    """A module per catalogue area (``uneven``), or per sub-area (``state_dict_dcp``)."""
    import importlib
    import pkgutil

    named = [m.name for m in pkgutil.iter_modules(faults.__path__) if not m.name.startswith("_")]
    found = []
    for name in sorted(set(named) - {"held_out"}):
        module = importlib.import_module(f"harness.faults.{name}")
        for fault in module.FAULTS:
            assert name == fault.area or name.startswith(f"{fault.area}_"), (name, fault.id)
        found += [fault.id for fault in module.FAULTS]
    assert sorted(found) == sorted(faults.BUILTIN)  # each fault in exactly one module


def test_the_fault_catalogue_loads_without_torch():
    code = "import sys, harness.faults; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_every_fault_says_how_it_was_written_and_a_blind_one_its_upstream_report():
    for fault in faults.FAULTS.values():
        origin = fault.origin
        assert origin.written in ("with the property", "blind"), f"{fault.id}: {origin}"
        if origin.written == "blind":
            assert origin.held_out in held_out.SETS, f"{fault.id}: {origin.held_out!r}"
            assert origin.upstream and all(u.startswith("https://") for u in origin.upstream)
            if origin.held_out in held_out.NOT_YET_MEASURED:
                assert origin.survived_before is None, fault.id
            else:
                assert isinstance(origin.survived_before, bool), fault.id


def test_the_held_out_sets_hold_what_their_record_counts():
    """``harness.faults.held_out`` records 29, 18, 19, 25, 12, 13, 16 and 15 faults and how
    many survived the suites before: 11, 11, 14, 23, 10, 9, 14 and (not yet measured) none."""
    blind_faults = [f.origin for f in faults.FAULTS.values() if f.origin.written == "blind"]
    sizes = {name: sum(o.held_out == name for o in blind_faults) for name in held_out.SETS}
    survived = {
        name: sum(o.held_out == name and bool(o.survived_before) for o in blind_faults)
        for name in held_out.SETS
    }
    assert sizes == {
        held_out.FIRST: 29,
        held_out.DTENSOR_DEPTH: 18,
        held_out.TRAINING_KNOBS: 19,
        held_out.OPS: 25,
        held_out.TRAINING_SURFACE: 12,
        held_out.TRAINING_OPTIONS: 13,
        held_out.CHECKPOINTS: 16,
        held_out.COMPILE: 15,
    }
    assert survived == {
        held_out.FIRST: 11,
        held_out.DTENSOR_DEPTH: 11,
        held_out.TRAINING_KNOBS: 14,
        held_out.OPS: 23,
        held_out.TRAINING_SURFACE: 10,
        held_out.TRAINING_OPTIONS: 9,
        held_out.CHECKPOINTS: 14,
        held_out.COMPILE: 0,
    }


def test_an_origin_names_itself_as_the_table_shows_it():
    assert WITH_THE_PROPERTY.label == "written with the property"
    assert blind("DTensor depth", "https://x.org/1").label == "blind, DTensor depth set"
    assert Origin().label == "origin not stated"
    assert blind("s", "https://x.org/1", survived_before=True).record() == {
        "label": "blind, s set",
        "written": "blind",
        "held_out": "s",
        "upstream": ["https://x.org/1"],
        "survived_before": True,
    }


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Origin(written="copied"), r"written='copied' must be one of"),
        (lambda: blind("DTensor depth"), r"upstream=\(\) must be the upstream report"),
        (lambda: blind(" ", "https://x.org/1"), r"held_out=' ' must be the name of a blind"),
        (lambda: blind("s", "pytorch/pytorch#1"), r"upstream=\('pytorch/pytorch#1',\) must be"),
        (lambda: blind("s", "javascript:alert(1)"), "must be a tuple of http"),
        (lambda: Origin(held_out="s"), r"held_out='s' must be None unless written blind"),
        (
            lambda: Origin(written="with the property", survived_before=False),
            "survived_before=False must be a bool for a blind fault",
        ),
        (lambda: blind("s", "https://x.org/1", survived_before=1), "survived_before=1 must be"),
        (
            lambda: Fault(id="x", area="a", bug_class="b", summary="s", patches=(), origin="blind"),
            "origin='blind' must be a harness.faults.Origin",
        ),
    ],
)
def test_an_origin_distconf_cannot_read_is_refused_naming_it(make, message):
    with pytest.raises(InvalidArgument, match=message):
        make()


def test_unknown_fault_ids_are_named():
    with pytest.raises(FaultError, match=r"faults=\['nope'\] are not in the fault catalogue"):
        faults.select(["dtensor.partial_avg_as_sum", "nope"])


def test_activate_exports_to_rank_processes_and_undo_restores(monkeypatch):
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    from torch.distributed.tensor import Partial

    original = Partial._reduce_value
    undo = faults.activate(["dtensor.partial_avg_as_sum"])
    assert Partial._reduce_value is not original
    assert faults.parse(faults.os.environ[faults.ENV_VAR]) == ["dtensor.partial_avg_as_sum"]
    undo()
    assert Partial._reduce_value is original
    assert faults.ENV_VAR not in faults.os.environ


FAULT_FILE = """
from harness.faults import Fault, Patch


def _doubled(original):
    return lambda *args: 2 * original(*args)


FAULTS = (
    Fault(
        id="own.doubled",
        area="placements",
        bug_class="a vendor's own bug",
        summary="doubles",
        patches=(Patch("fault_victim:function", _doubled),),
    ),
)
"""


@pytest.fixture
def fault_file(tmp_path, victim):
    path = tmp_path / "own_faults.py"
    path.write_text(FAULT_FILE)
    yield path
    for fault_id in faults._loaded_files.pop(path.resolve(), ()):
        faults.FAULTS.pop(fault_id)


def test_a_fault_file_adds_its_faults_once_and_activate_exports_it(fault_file, victim, monkeypatch):
    monkeypatch.delenv(faults.FILES_ENV_VAR, raising=False)
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    assert [f.id for f in faults.load_files([fault_file])] == ["own.doubled"]
    assert [f.id for f in faults.load_files([fault_file])] == ["own.doubled"]  # no-op
    assert faults.FAULTS["own.doubled"].origin.label == "origin not stated"  # none given
    undo = faults.activate(["own.doubled"], [str(fault_file)])
    assert victim.function(3) == 6
    assert faults.exported_files() == [str(fault_file.resolve())]
    undo()
    assert victim.function(3) == 3 and faults.FILES_ENV_VAR not in faults.os.environ


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("FAULTS = 3", "must define FAULTS as a tuple of harness.faults.Fault; got int"),
        ("raise ImportError('boom')", "failed to import: ImportError"),
        ("import sys\nsys.exit(0)", r"failed to import: SystemExit\(0\)"),
        ("raise GeneratorExit", "failed to import: GeneratorExit"),
        ("class Stop(BaseException): pass\nraise Stop()", "failed to import: Stop"),
        (
            FAULT_FILE.replace("own.doubled", "dtensor.partial_avg_as_sum"),
            r"ids=\['dtensor.partial_avg_as_sum'\] are already in the catalogue",
        ),
        (
            FAULT_FILE.replace(
                "from harness.faults import Fault, Patch",
                "from harness.faults import Fault, Patch, blind",
            ).replace("patches=(", 'origin=blind("mine"),\n        patches=('),
            r"failed to import: InvalidArgument\(.upstream=\(\) must be the upstream report",
        ),
    ],
)
def test_a_bad_fault_file_is_named_with_what_is_wrong(tmp_path, victim, text, message):
    path = tmp_path / "bad_faults.py"
    path.write_text(text)
    with pytest.raises(FaultError, match=message):
        faults.load_files([path])
    with pytest.raises(FaultError, match="does not exist"):
        faults.load_files([tmp_path / "missing.py"])


def test_a_ctrl_c_while_a_fault_file_imports_stays_an_interrupt(tmp_path):
    path = tmp_path / "interrupted_faults.py"
    path.write_text("raise KeyboardInterrupt")
    with pytest.raises(KeyboardInterrupt):
        faults.load_files([path])


def test_mutate_refuses_a_fault_file_that_exits_on_import_naming_it(tmp_path):
    """``sys.exit(0)`` in a fault file is a usage error naming the file, never "every fault
    caught" (exit 0) before anything ran."""
    path = tmp_path / "exits.py"
    path.write_text("import sys\nsys.exit(0)\n")
    command = [sys.executable, "-m", "harness", "mutate", "--fault-file", str(path), "--jobs",
               "1", "--out", str(tmp_path / "out")]  # fmt: skip
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )  # fmt: skip
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"error: --fault-file: fault file {str(path)!r} failed to import: SystemExit(0)" in (
        done.stderr
    )
    assert not (tmp_path / "out").exists()


RANK_PROBE = """
import pytest

def patched_name(ctx):
    from torch.distributed.tensor import Partial
    return Partial._reduce_value.__name__

def test_every_rank_sees_the_fault(world):
    assert world.run(patched_name) == ["reduce_value"] * world.world_size
"""


@pytest.mark.parametrize("runner", ["threads", "processes"])
def test_a_fault_reaches_every_rank_and_the_header(pytester, runner):
    pytester.makepyfile(test_probe=RANK_PROBE)
    results = pytester.path / "r.jsonl"
    run = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        f"--runner={runner}",
        "--world-sizes=2",
        "--distconf-faults=dtensor.partial_avg_as_sum",
        f"--distconf-results={results}",
    )
    run.assert_outcomes(passed=1)
    header = json.loads(results.read_text().splitlines()[0])
    assert header["faults"] == ["dtensor.partial_avg_as_sum"]


OWN_PARTIAL_FAULT = """
from harness.faults import Fault, Patch


TARGET = "torch.distributed.tensor.placement_types:Partial._reduce_value"


def _renamed(original):
    def own_reduce(*args):
        return original(*args)

    return own_reduce


FAULTS = (
    Fault(
        id="own.renamed",
        area="placements",
        bug_class="test",
        summary="renames Partial._reduce_value",
        patches=(Patch(TARGET, _renamed),),
    ),
)
"""


@pytest.mark.parametrize("runner", ["threads", "processes"])
def test_a_fault_file_reaches_every_rank(pytester, runner):
    (pytester.path / "own_faults.py").write_text(OWN_PARTIAL_FAULT)
    pytester.makepyfile(test_probe=RANK_PROBE.replace('"reduce_value"', '"own_reduce"'))
    run = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        f"--runner={runner}",
        "--world-sizes=2",
        "--distconf-faults=own.renamed",
        f"--distconf-fault-files={pytester.path / 'own_faults.py'}",
    )
    run.assert_outcomes(passed=1)


def test_an_unknown_fault_option_is_a_usage_error(pytester):
    pytester.makepyfile(test_probe="def test_x():\n    pass\n")
    run = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--distconf-faults=nope")
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    assert "--distconf-faults: faults=['nope'] are not in the fault catalogue" in run.stderr.str()
