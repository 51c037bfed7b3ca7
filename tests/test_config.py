"""harness.config: a run's options, their defaults and validation in one place, and the
command line and the plugin spelling a refused value as their own option."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest

from harness import InvalidArgument, cli, session
from harness.config import (
    DEFAULTS,
    OPTIONS,
    RunConfig,
    as_option,
    from_options,
    parse_world_sizes,
)
from harness.plugin import options as plugin_options
from harness.runners import DEFAULT_TIMEOUT, RUNNERS, capacity
from harness.torchkit import devices


def test_the_defaults_are_a_valid_run_of_every_suite():
    assert DEFAULTS.runner == RUNNERS[0] and DEFAULTS.rank_timeout == DEFAULT_TIMEOUT
    assert DEFAULTS.world_sizes == (1, 2, 3, 4) and DEFAULTS.suites == ()
    assert all(f.kw_only for f in fields(RunConfig))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("runner", "mpi", "runner='mpi' must be one of ('threads', 'processes', 'torchrun', 'l"),
        ("world_sizes", (2, 2), "world_sizes=(2, 2) must be a non-empty tuple of distinct"),
        ("world_sizes", (), "world_sizes=() must be a non-empty tuple"),
        ("device", "cuda:0", "device='cuda:0' must be a device type: cpu, cuda, xpu"),
        ("device", "", "device='' must be a device type"),
        ("backend", "gloo/nccl", "backend='gloo/nccl' must be a backend name or None"),
        ("backend_plugins", "my.plugin", "backend_plugin='my.plugin' must be a tuple of module"),
        ("backend_plugins", ("my-plugin",), "backend_plugin='my-plugin' must be a module name"),
        ("rank_timeout", 0, "rank_timeout=0 must be a positive, finite number of seconds"),
        ("test_timeout", -1, "test_timeout=-1 must be a finite number of seconds >= 0"),
        ("profile", "fast", "profile='fast' must be one of"),
        ("seed", 1.5, "seed=1.5 must be an int or None"),
        ("suites", ("nope",), "suite='nope' must be one of"),
        ("out", "reports", "out='reports' must be a pathlib.Path"),
        ("faults", ("",), "faults=('',) must be a tuple of non-empty strings"),
        ("cheap_first", (Path("/no/such/results"),), "cheap_first='/no/such/results' must be"),
        ("workers", 0, "workers=0 must be a positive int"),
    ],
)
def test_a_bad_field_is_refused_naming_it(field, value, message):
    with pytest.raises(InvalidArgument) as info:
        RunConfig(**{field: value})
    assert str(info.value).startswith(message)


def test_no_driver_backstop_and_any_seed_are_accepted():
    assert RunConfig(test_timeout=0, seed=-3).test_timeout == 0


def test_world_sizes_parse_from_the_option_text():
    assert parse_world_sizes("1,2,2,4") == (1, 2, 4)
    with pytest.raises(InvalidArgument, match="world_sizes='1,x' must be a comma-separated"):
        parse_world_sizes("1,x")


def test_a_refused_field_is_named_as_its_option():
    with pytest.raises(InvalidArgument) as info:
        RunConfig(rank_timeout=0)
    assert str(as_option(info.value)).startswith("--rank-timeout=0 must be")
    renamed = as_option(info.value, {"rank_timeout": "--deadline"})
    assert str(renamed).startswith("--deadline=0 must be")


def test_the_command_line_refuses_before_it_deletes_anything(tmp_path, capsys):
    earlier = tmp_path / "results.jsonl"
    earlier.write_text('{"kind": "header"}\n')
    for bad in (["--world-sizes", "0"], ["--suite", "nosuch"], ["--rank-timeout", "0"]):
        code = cli.main(["run", *bad, "--out", str(tmp_path)])
        assert code == cli.USAGE_ERROR
        assert earlier.exists(), f"{bad} deleted an earlier run's records"
    err = capsys.readouterr().err
    assert "error: --world-sizes='0' must be a comma-separated list of positive ints" in err
    assert "error: --suite='nosuch' must be one of" in err
    assert "error: --rank-timeout=0.0 must be a positive, finite number of seconds" in err


def test_a_malformed_command_line_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--runner", "mpi"])
    assert info.value.code == cli.USAGE_ERROR
    assert "invalid choice: 'mpi'" in capsys.readouterr().err


@pytest.mark.parametrize("in_ci", [False, True], ids=["local", "CI=true"])
def test_random_profiles_stay_random_under_a_ci_variable(in_ci):
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if in_ci else {})
    probe = (
        "from harness.profiles import PROFILES as P, needs_seed; print([needs_seed(p) for p in P])"
    )
    shown = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert shown.stdout.strip() == "[True, False, True, True]", shown.stdout + shown.stderr


@pytest.mark.parametrize(
    ("workers", "extra", "expected"),
    [(1, [], None), (3, [], ["-n", "3"]), (3, ["-n", "1"], None), (3, ["-n2"], None)],
)
def test_a_run_spreads_over_its_workers_unless_pytest_arguments_say_otherwise(
    workers, extra, expected
):
    arguments = session.pytest_arguments(replace(DEFAULTS, workers=workers), extra=extra)
    ours = arguments[: len(arguments) - len(extra)]
    found = ours[ours.index("-n") : ours.index("-n") + 2] if "-n" in ours else None
    assert found == expected


def test_the_cli_spells_workers_as_jobs(tmp_path, capsys):
    assert cli.main(["run", "--jobs", "0", "--out", str(tmp_path)]) == cli.USAGE_ERROR
    assert "--jobs=0 must be a positive int" in capsys.readouterr().err


# --- the options both front ends take: one table -------------------------------------------


def _cli_options(command: str) -> dict[str, argparse.Action]:
    parser = cli._parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    actions = commands.choices[command]._actions
    return {name: action for action in actions for name in action.option_strings}


def _plugin_options(pytester) -> dict[str, argparse.Action]:
    config = pytester.parseconfig("-p", "harness.plugin")
    group = config._parser.getgroup("distconf")
    return {name: option._action for option in group.options for name in option.names()}


def test_an_option_both_front_ends_take_is_declared_once_from_the_table(pytester):
    plugin = _plugin_options(pytester)
    for command in ("run", "mutate"):
        shared = set(_cli_options(command)) & set(plugin)
        assert shared == {option.spelling for option in OPTIONS}, command


@pytest.mark.parametrize("option", OPTIONS, ids=lambda option: option.spelling)
def test_each_side_parses_a_table_option_to_the_fields_default(pytester, option):
    command_line = _cli_options("run")[option.spelling]
    plugin = _plugin_options(pytester)[option.spelling]
    assert command_line.dest == option.field and plugin.dest == "distconf_" + option.field
    default = getattr(DEFAULTS, option.field)
    parsed = [] if option.repeated else None if option.derived else default
    assert command_line.default == plugin.default == parsed
    assert command_line.help == plugin.help
    assert command_line.type is plugin.type and command_line.metavar == plugin.metavar
    # argparse refuses another value on the command line; the plugin leaves it to RunConfig
    assert command_line.choices == (option.choices or None) and plugin.choices is None
    if default is not None and not option.repeated:  # the help says it, as the option spells it
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
        shown = f"{default:g}" if isinstance(default, float) else shown
        assert f"default: {shown}" in command_line.help


def test_both_front_ends_make_the_same_run_of_the_same_options(pytester):
    given = [
        "--runner", "torchrun", "--nproc-per-node", "2", "--nnodes", "2", "--device", "cpu",
        "--backend-plugin", "a,b", "--backend-plugin", "c", "--rank-timeout", "5",
        "--listen", "127.0.0.1:7", "--attach-timeout", "9",
    ]  # fmt: skip
    parsed = cli._parser().parse_args(["run", *given, "--jobs", "1"])
    command_line = cli._config(parsed, workers=1)
    plugin = from_options(
        vars(pytester.parseconfig("-p", "harness.plugin", *given).option), "distconf_"
    )
    assert command_line == replace(plugin, out=command_line.out, workers=1)
    assert command_line.world_sizes == (4,) and command_line.backend_plugins == ("a", "b", "c")


@pytest.mark.parametrize(
    "run",
    [
        DEFAULTS,
        RunConfig(runner="processes", world_sizes=(2, 3), backend="gloo", rank_timeout=7.5),
        RunConfig(runner="torchrun", world_sizes=(4,), nproc_per_node=2, nnodes=2, max_restarts=1),
        RunConfig(runner="torchrun", world_sizes=(3,), listen="127.0.0.1:7", attach_timeout=9.0),
    ],
)
def test_the_pytest_a_run_starts_makes_the_same_run(pytester, run):
    """``harness run`` spells its options for pytest from the same table they are declared in:
    whatever the plugin parses back is the run it was given."""
    arguments = [a for a in session.pytest_arguments(run) if a.startswith("--") and "=" in a]
    ours = [a for a in arguments if a.split("=")[0] in {o.spelling for o in OPTIONS}]
    parsed = from_options(
        vars(pytester.parseconfig("-p", "harness.plugin", *ours).option), "distconf_"
    )
    assert parsed == replace(run, out=parsed.out)


def test_the_plugin_refuses_a_runner_in_distconf_words(pytester):
    config = pytester.parseconfig("-p", "harness.plugin", "--runner=mpi")
    with pytest.raises(pytest.UsageError, match="--runner='mpi' must be one of"):
        plugin_options.run_config(config)


# --- the machine: one pass down --------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "world_sizes", "asked"),
    [
        ({}, True, {"present": True, "resolve": False}),
        ({"runner": "processes"}, True, {"present": True, "resolve": True}),
        ({"runner": "local"}, True, {"present": False, "resolve": False}),
        ({"runner": "torchrun", "nproc_per_node": 2}, True, {"present": True, "resolve": True}),
        ({"runner": "torchrun", "nproc_per_node": 2}, False, {"present": False, "resolve": True}),
    ],
)
def test_the_machine_is_surveyed_once_for_the_whole_run(monkeypatch, fields, world_sizes, asked):
    surveys = []
    gather = devices.survey

    def survey(device, plugins, **keywords):
        surveys.append(keywords)
        return gather(device, plugins, **keywords)

    monkeypatch.setattr(devices, "survey", survey)
    RunConfig(**fields).check_machine(world_sizes=world_sizes)
    assert len(surveys) == 1 and {k: surveys[0][k] for k in asked} == asked


def test_the_ranks_torchrun_starts_here_are_held_as_rank_processes(monkeypatch):
    monkeypatch.setattr(capacity, "PROCESSES_PER_CORE", 1)
    too_many = len(os.sched_getaffinity(0)) + 1
    config = RunConfig(runner="torchrun", nproc_per_node=too_many)
    with pytest.raises(InvalidArgument) as info:
        config.check_machine()
    assert str(info.value).startswith(f"nproc_per_node={too_many} must be at most ")
    assert "on the processes runner" in str(info.value)
    assert config.check_machine(world_sizes=False) == "gloo"  # the plugin's backend lookup


def test_a_world_on_an_accelerator_is_held_to_the_devices_the_survey_counted(monkeypatch):
    two = devices.Machine(device="cuda", count=2, backend="nccl")
    monkeypatch.setattr(devices, "survey", lambda device, plugins, **asked: two)
    assert capacity.check_capacity("processes", "cuda", (1, 2)) == "nccl"
    with pytest.raises(InvalidArgument) as info:
        capacity.check_capacity("processes", "cuda", (2, 3))
    assert str(info.value) == (
        "world_sizes=3 must be at most 2 on the processes runner (one cuda device per rank "
        "process, and 2 are visible)"
    )


@pytest.mark.parametrize(
    ("arguments", "refusal"),
    [
        (["--nnodes", "0", "--nproc-per-node", "2"], "error: --nnodes=0 must be a positive int"),
        (["--nnodes", "-1", "--nproc-per-node", "2"], "error: --nnodes=-1 must be a positive int"),
        (["--nproc-per-node", "0"], "error: --nproc-per-node=0 must be a positive int"),
    ],
)
def test_a_torchrun_world_of_no_ranks_is_refused_as_the_option_given(arguments, refusal, capsys):
    """Not as the world size it would make (``--world-size=0``, an option that does not exist)."""
    assert cli.main(["run", "--runner", "torchrun", *arguments]) == cli.USAGE_ERROR
    assert capsys.readouterr().err.strip().splitlines()[-1] == refusal
