"""The distconf pytest plugin: options, markers, the ``world`` and ``worlds`` fixtures, spec
checks, ``-n gpu`` leasing and results recording.

Registered through the ``pytest11`` entry point (or ``-p harness.plugin``). Its module-level
hooks declare the options and, at configure time, register one ``DistconfSession``
(``dsession``) that owns the session's state; each concern lives in its own module:
``options``, ``gpus``, ``worlds``, ``collection``, ``recording``. It imports no torch at
import time (torch comes with the first World), and it is inert for tests that neither live
under the suites directory nor ask for the ``world`` fixture.
"""

from __future__ import annotations

import os

import pytest

from harness.plugin import collection, gpus, options
from harness.plugin.dsession import DistconfSession
from harness.plugin.dsession import of as _session_of
from harness.runners import World, Worlds

_parsers: list[pytest.Parser] = []  # to patch xdist's "-n" when it registers after us


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add(parser)
    _parsers.append(parser)
    gpus.accept_gpu_workers(parser)


def pytest_plugin_registered(plugin: object, manager: pytest.PytestPluginManager) -> None:
    """xdist may register after this plugin: patch its "-n" once it has added it."""
    for parser in _parsers:
        gpus.accept_gpu_workers(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    options.choose_profile(config)
    if getattr(config.option, "numprocesses", None) == gpus.GPU_WORKERS:
        gpus.resolve_workers(config, options.run_config(config))


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
    session = DistconfSession(config, run, _inject_faults(config))
    config.pluginmanager.register(session, "distconf-session")
    sources = config.getoption("distconf_cheap_first")
    if sources:
        config.pluginmanager.register(collection.CheapFirst(sources), "distconf-cheap-first")


def _inject_faults(config: pytest.Config) -> list[str]:
    """Apply ``--distconf-faults`` for the session (undone at its end); the IDs applied."""
    from harness import faults

    ids = faults.parse(config.getoption("distconf_faults") or os.environ.get(faults.ENV_VAR))
    files = faults.parse(
        config.getoption("distconf_fault_files") or os.environ.get(faults.FILES_ENV_VAR)
    )
    if not ids:
        return []
    try:
        config.add_cleanup(faults.activate(ids, files))
    except faults.FaultError as exc:
        raise pytest.UsageError(f"--distconf-faults: {exc}") from None
    return ids


@pytest.fixture(scope="session")
def world(request: pytest.FixtureRequest) -> World:
    """The session's World for this test's runner × world size × device."""
    return _session_of(request.config).worlds.world(request.config, request.param)


@pytest.fixture(scope="session")
def worlds(request: pytest.FixtureRequest) -> Worlds:
    """Worlds of every session world size for the configured runner and device (a test's own
    ``world`` among them): ``worlds.get(m)`` for checks that move between world sizes.
    ``worlds.sizes`` lists the sizes it serves (on cuda, those this process has GPUs for)."""
    return _session_of(request.config).worlds.worlds(request.config)
