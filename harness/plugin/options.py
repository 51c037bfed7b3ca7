"""The plugin's command-line options and ini keys, and the run options they make.

The options ``harness run`` takes too are declared from ``harness.config.RUN_OPTIONS`` and
``TORCHRUN_OPTIONS`` (their defaults ``DEFAULTS``'); ``run_config`` makes the ``RunConfig``
of them as the command line does (``config.from_options``) and turns a bad value into a
usage error naming the option.
"""

from __future__ import annotations

import os
import random
import re
import uuid
from pathlib import Path

import pytest

from harness import catalogue
from harness.config import (
    RUN_OPTIONS,
    TORCHRUN_OPTIONS,
    RunConfig,
    RunOption,
    as_option,
    from_options,
    split_names,
)
from harness.errors import InvalidArgument, check_one_of, require
from harness.profiles import PROFILES, needs_seed


def add(parser: pytest.Parser) -> None:
    group = parser.getgroup("distconf", "distconf conformance harness")
    for option in RUN_OPTIONS:
        _add_shared(group, option)
    group.addoption(
        "--strict-collectives",
        dest="distconf_strict_collectives",
        action="store_true",
        help="process runner: check every collective's fingerprint across ranks "
        "(TORCH_DISTRIBUTED_DEBUG=DETAIL); the thread runner always checks",
    )
    group.addoption("--distconf-results", default=None, help="write JSONL results to this file")
    group.addoption(
        "--distconf-run-id",
        dest="distconf_run_id",
        default=None,
        help="the run's identity in every results file's header (default: one is drawn); "
        "harness run gives its own, to read only its own files",
    )
    group.addoption(
        "--distconf-keep-earlier",
        dest="distconf_keep_earlier",
        action="store_true",
        help="first move an earlier run's results files and report.html beside "
        "--distconf-results to earlier/<its start>/ (harness run asks for it)",
    )
    group.addoption(
        "--distconf-profile",
        dest="distconf_profile",
        default=None,
        help=f"hypothesis profile, one of {PROFILES}; a random one draws and records a seed "
        "when --hypothesis-seed is not given",
    )
    _add_gpu_options(group)
    _add_mutation_options(group)
    for option in TORCHRUN_OPTIONS:
        _add_shared(group, option)
    parser.addini("distconf_catalogue", "path of the spec catalogue", default=None)
    parser.addini("distconf_suites", "directory holding the conformance suites", default=None)
    parser.addini(
        "distconf_expectations", "directory of known-deviation files (*.toml)", default=None
    )


DEST = "distconf_"
"""pytest's options share one namespace: the plugin's keep their values under this prefix."""


def _add_shared(group: pytest.OptionGroup, option: RunOption) -> None:
    """An option the command line takes too (``config.OPTIONS``). Its choices are left to
    ``RunConfig``: a value outside them is refused as every other bad value here, a usage
    error in distconf's words (``--runner='mpi' must be one of ...``)."""
    group.addoption(option.spelling, **option.keywords(prefix=DEST, choices=False))


def _add_gpu_options(group: pytest.OptionGroup) -> None:
    group.addoption(
        "--gpus-per-worker",
        dest="distconf_gpus_per_worker",
        type=int,
        default=None,
        help="with -n gpu: GPUs per xdist worker (default: the largest world size on the "
        "process runner with --device cuda, else 1)",
    )
    group.addoption(
        "--require-gpus",
        dest="distconf_require_gpus",
        action="store_true",
        help="fail, instead of skip, tests that need more GPUs than this process holds "
        "(a nightly GPU job must not skip everything silently)",
    )


def _add_mutation_options(group: pytest.OptionGroup) -> None:
    group.addoption(
        "--distconf-faults",
        dest="distconf_faults",
        default=None,
        help="inject these faults (IDs of harness.faults, comma-separated; default: "
        "$DISTCONF_FAULTS) for the whole session: a mutation run, not a conformance verdict",
    )
    group.addoption(
        "--distconf-fault-files",
        dest="distconf_fault_files",
        default=None,
        help="Python files defining FAULTS = (harness.faults.Fault, ...) to add to the fault "
        "catalogue (comma-separated; default: $DISTCONF_FAULT_FILES)",
    )
    group.addoption(
        "--distconf-cheap-first",
        dest="distconf_cheap_first",
        default=None,
        help="results files or directories of an earlier run (comma-separated): within each "
        "world size, run the tests it timed fastest first (tests it did not time keep their "
        "place after them); with --exitfirst a failing run fails sooner",
    )
    group.addoption(
        "--distconf-schedule",
        dest="distconf_schedule",
        choices=("worlds",),
        default=None,
        help="with xdist's default distribution: hand each World's tests (or a share of "
        "them) to one worker, largest World first (harness run asks for it)",
    )


_SPELLED = {
    "faults": "--distconf-faults",
    "fault_files": "--distconf-fault-files",
    "cheap_first": "--distconf-cheap-first",
}
"""The plugin's options whose names are not their RunConfig fields'."""


def run_config(config: pytest.Config) -> RunConfig:
    """The session's options as a validated RunConfig; a bad value is a usage error naming
    its option. Its profile and seed are hypothesis' options: the plugin reads them from
    hypothesis where it records them; the output options are the CLI's."""
    from harness import faults

    env = os.environ
    try:
        run = from_options(
            vars(config.option),
            DEST,
            strict_collectives=config.getoption("distconf_strict_collectives"),
            faults=_names(config.getoption("distconf_faults") or env.get(faults.ENV_VAR)),
            fault_files=_names(
                config.getoption("distconf_fault_files") or env.get(faults.FILES_ENV_VAR)
            ),
            cheap_first=tuple(map(Path, _names(config.getoption("distconf_cheap_first")))),
            exitfirst=bool(config.getoption("exitfirst", False)),
        )
        # The machine is checked once, where the run starts: an xdist worker leased GPUs
        # (``-n gpu``) sees only its own.
        if not hasattr(config, "workerinput"):
            run.check_machine()
            _check_run_id(config)
    except InvalidArgument as exc:
        raise pytest.UsageError(str(as_option(exc, _SPELLED))) from None
    return run


_RUN_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")


def _check_run_id(config: pytest.Config) -> None:
    """``--distconf-run-id``, or one drawn for the session; xdist's workers get it as its
    test-run ID (``--testrunuid``), which its controller hands to each of them."""
    given = config.getoption("distconf_run_id")
    if given is None:
        given = getattr(config.option, "testrunuid", None) or uuid.uuid4().hex
        config.option.distconf_run_id = given
    require(_RUN_ID.fullmatch(str(given)) is not None, "distconf_run_id", given, _RUN_ID_TEXT)
    if hasattr(config.option, "testrunuid") and config.option.testrunuid is None:
        config.option.testrunuid = given


_RUN_ID_TEXT = "1 to 64 letters, digits, '-' or '_'"


def run_id(config: pytest.Config) -> str:
    """The run's identity (``_check_run_id``): the same in the controller and every worker."""
    given = config.getoption("distconf_run_id")
    if given is not None:
        return str(given)
    return str(getattr(config, "workerinput", {})["testrunuid"])


def _names(text: str | None) -> tuple[str, ...]:
    return split_names([text or ""])


def choose_profile(config: pytest.Config) -> None:
    """``--distconf-profile``: hand hypothesis its profile (and for a random one a seed,
    ``profiles.needs_seed``) before hypothesis' own configure hook reads them."""
    profile = config.getoption("distconf_profile")
    if profile is None:
        return
    try:
        check_one_of("--distconf-profile", profile, PROFILES)
    except InvalidArgument as exc:
        raise pytest.UsageError(str(exc)) from None
    config.option.hypothesis_profile = profile
    if needs_seed(profile) and getattr(config.option, "hypothesis_seed", None) is None:
        config.option.hypothesis_seed = random.randrange(2**32)


def seed(config: pytest.Config) -> str | None:
    """The hypothesis seed of the session, if one was given or drawn."""
    value = config.getoption("hypothesis_seed", default=None)
    return None if value is None else str(value)


def _configured_path(config: pytest.Config, ini: str, default: Path) -> Path:
    """An ini path relative to the rootdir, or ``default`` (distconf's own files)."""
    configured = config.getini(ini)
    return Path(config.rootpath, str(configured)).resolve() if configured else default


def suites_dir(config: pytest.Config) -> Path:
    return _configured_path(config, "distconf_suites", catalogue.DEFAULT_SUITES)


def catalogue_path(config: pytest.Config) -> Path:
    return _configured_path(config, "distconf_catalogue", catalogue.DEFAULT_PATH)


def expectations_dir(config: pytest.Config) -> Path:
    """Configured, or the ``expectations/`` beside the catalogue (deviations from its specs)."""
    beside = catalogue_path(config).parent / "expectations"
    return _configured_path(config, "distconf_expectations", beside)
