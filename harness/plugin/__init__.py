"""The distconf pytest plugin: options, markers, the ``world`` and ``worlds`` fixtures, spec
checks, ``-n gpu`` leasing and results recording.

Registered through the ``pytest11`` entry point (or ``-p harness.plugin``). Its module-level
hooks declare the options and, at configure time, register one ``DistconfSession``
(``dsession``) that owns the session's state; each concern lives in its own module:
``options``, ``gpus``, ``worlds``, ``collection``, ``recording``, ``notices``. It imports no
torch at import time (torch comes with the first World), and it is inert for tests that
neither live under the suites directory nor ask for the ``world`` fixture.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

from harness.config import RunConfig
from harness.plugin import collection, dsession, gpus, notices, options, scheduling
from harness.plugin.dsession import DistconfSession
from harness.runners import World, Worlds

# The parsers this plugin added its options to: xdist may register after it, and the hook
# that says so receives no parser.
_parsers: list[pytest.Parser] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add(parser)
    _parsers.append(parser)
    gpus.accept_gpu_workers(parser)


def pytest_plugin_registered(plugin: object, manager: pytest.PytestPluginManager) -> None:
    """xdist may register after this plugin: patch its "-n" once it has added it."""
    for parser in _parsers:
        gpus.accept_gpu_workers(parser)


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config) -> Generator[None, object, object]:
    # A wrapper, not tryfirst: xdist's tryfirst hook reads "-n" and, registered after this
    # plugin (``-p harness.plugin`` from a checkout), it would run first.
    options.choose_profile(config)
    gpus.resolve_workers(config)
    return (yield)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spec(id): the catalogue spec ID this test checks")
    config.addinivalue_line("markers", "gpus(n): the test needs n GPUs in this process")
    config.addinivalue_line(
        "markers", "runner(*names, reason=...): the runners that can serve this test, and why"
    )
    config.addinivalue_line(
        "markers",
        "world_size(*sizes, min=None, max=None): world sizes this test can run at",
    )
    run = options.run_config(config)
    collection.check_expectations(config)
    if run.runner == "torchrun":
        notices.show_on_terminal(config)
    _inject_faults(config, run)
    config.pluginmanager.register(DistconfSession(config, run), dsession.NAME)
    if run.cheap_first:
        config.pluginmanager.register(
            collection.CheapFirst(run.cheap_first), "distconf-cheap-first"
        )


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> Any:
    """``--distconf-schedule=worlds`` in place of xdist's default ``load``."""
    if config.getoption("distconf_schedule") == "worlds" and config.getvalue("dist") == "load":
        return scheduling.make_scheduler(config, log)
    return None


def _inject_faults(config: pytest.Config, run: RunConfig) -> None:
    """Apply the run's faults for the session (undone at its end)."""
    if not run.faults:
        return
    from harness import faults

    try:
        config.add_cleanup(faults.activate(run.faults, run.fault_files))
    except faults.FaultError as exc:
        raise pytest.UsageError(f"--distconf-faults: {exc}") from None


@pytest.fixture(scope="session")
def world(request: pytest.FixtureRequest) -> World:
    """The session's World for this test's runner × world size × device."""
    return dsession.of(request.config).worlds.world(request.config, request.param)


@pytest.fixture(scope="session")
def worlds(request: pytest.FixtureRequest) -> Worlds:
    """Worlds of every session world size for the configured runner and device (a test's own
    ``world`` among them): ``worlds.get(m)`` for checks that move between world sizes.
    ``worlds.sizes`` lists the sizes it serves (on an accelerator, those this process has
    devices for)."""
    return dsession.of(request.config).worlds.worlds(request.config)
