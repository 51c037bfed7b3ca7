"""The plugin's session object: the one place its state lives, registered at configure time
(as pytest-xdist registers its ``DSession``). Its hooks hand each concern to its module:
``worlds`` (the Worlds tests run on), ``collection`` (spec checks, expectations, order),
``recording`` (one results record per test). Where ``$DISTCONF_REACH_DIR`` is set (``harness
run`` sets it), each pytest process records the DTensor ops its tests reach
(``torchkit.reach``), written after each test; where ``$DISTCONF_SURFACE_DIR`` is, the options
each test passes to torch's public API (``torchkit.surface``), written after each test."""

from __future__ import annotations

import functools
import signal
import time
from typing import Any

import pytest
from hypothesis import settings

from harness import forked
from harness.config import RunConfig
from harness.outcome import fatal
from harness.outcome.results import ResultsWriter
from harness.plugin import collection, deviations, gpus, options, recording, scheduling, state
from harness.plugin.garbage import CollectorTuning
from harness.plugin.torch_noise import WarningCounter
from harness.plugin.worlds import SessionWorlds, world_key
from harness.torchkit import reach, surface

NAME = "distconf-session"


class DistconfSession:
    """What one pytest session of distconf holds: its run options (injected faults among
    them), its Worlds and its results file."""

    def __init__(self, config: pytest.Config, run: RunConfig) -> None:
        self.config = config
        self.run = run
        self.worlds = SessionWorlds(run)
        self.writer: ResultsWriter | None = None
        self.fatal_log: fatal.FatalLog | None = None
        self.interrupted: str | None = None
        self.noise = WarningCounter()
        self._sigterm: forked.SignalHandler = None
        self.collector = CollectorTuning()

    def pytest_configure(self, config: pytest.Config) -> None:
        """SIGTERM interrupts the session as Ctrl-C does, in every pytest process of a run
        (xdist's workers start as new programs: ``harness run``'s handler is not theirs)."""
        self._sigterm = forked.interrupt_on_sigterm()
        reach.install_from_environment()
        surface.install_from_environment()

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.collector.stop()
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """A session that runs suite tests (on Worlds) spaces the collector out
        (``garbage``); any other pytest session is left as it is."""
        if any(world_key(item) is not None for item in session.items):
            self.collector.start()

    @property
    def _runs_tests(self) -> bool:
        """This process runs the tests: it is no xdist controller, which hands them to its
        workers (each keeping its own starts and fatal file)."""
        return not self.config.pluginmanager.has_plugin("dsession")

    @functools.cached_property
    def backend(self) -> str:
        """The process-group backend the session's Worlds use (the plugins imported first: an
        xdist worker has not checked the machine, and a plugin may register the backend)."""
        return self.run.check_machine(world_sizes=False)

    # Not at configure time: hypothesis loads --hypothesis-profile in its own configure hook.
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.writer = recording.open_writer(self.config, self.run, self.backend)
        if self.writer is not None and self._runs_tests:
            self.fatal_log = fatal.FatalLog(self.writer.path)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.worlds.close()
        reach.flush()
        surface.flush()
        if self.writer is not None:
            ending = self.worlds.end_fields() | recording.end_fields(self.config)
            self.writer.write_noise(self.noise.records())
            self.writer.close(exitstatus=int(exitstatus), interrupted=self.interrupted, **ending)
        if self.fatal_log is not None:
            self.fatal_log.close()

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        """Ctrl-C, SIGINT, SIGTERM, or pytest stopping the session (a collection error): the
        end record says so, whatever pytest's exit code."""
        self.interrupted = str(excinfo.value) or excinfo.typename

    # Inside pytest's own recording of warnings (tryfirst wrappers), which shows what is not
    # torch's known noise (``torch_noise``).
    @pytest.hookimpl(wrapper=True)
    def pytest_collection(self, session: pytest.Session) -> Any:
        with self.noise.sifting():
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Any:
        with self.noise.sifting():
            return (yield)

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        surface.begin(nodeid)
        # An xdist controller replays its workers' starts; their outcomes are in the
        # workers' files, so only a process that runs tests writes its starts.
        if self.writer is not None and self._runs_tests:
            self.writer.write_start(nodeid)

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        reach.flush()  # writes only when the test reached an op no earlier test did
        surface.end()

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        self.worlds.parametrize(metafunc)

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        collection.check_and_mark(config, items, backend=self.backend)
        # Only where xdist hands out the tests (its workers collect them): a run of one
        # process keeps the order of --world-sizes, which mutate's fault runs choose.
        if config.getoption("distconf_schedule") == "worlds" and hasattr(config, "workerinput"):
            scheduling.largest_worlds_first(items)

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Hands the spec ID to pytest's JUnit XML, checks GPUs, and checks that the Worlds
        the test reuses still answer (a World that does not rebuilds itself)."""
        spec = item.get_closest_marker("spec")
        if spec is not None and spec.args:
            item.user_properties.append(("spec", str(spec.args[0])))
        marker = item.get_closest_marker("gpus")
        if marker is not None:
            gpus.require_gpus(item.config, int(marker.args[0]), "this test")
        self.worlds.check_before(item)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Any:
        return (yield from recording.observing(item, self.run.session_world_sizes))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report: pytest.TestReport = yield
        deviations.check_known(item, report, call.excinfo)
        if self.writer is None:
            return report
        test = state.of(item)
        test.phases[report.when] = (report, call.excinfo)
        if report.when == "teardown":
            self.writer.write_test(recording.record(item, self.run))
        return report

    def pytest_report_header(self, config: pytest.Config) -> str | None:
        if not options.suites_dir(config).is_relative_to(config.rootpath):
            return None  # not a distconf checkout: say nothing in other projects' runs
        profile = settings.get_current_profile_name()
        return (
            f"distconf: runner={self.run.runner} world sizes={self.run.world_sizes_text} "
            f"device={self.run.device} backend={self.backend} "
            f"hypothesis profile={profile} ({time.strftime('%Y-%m-%d')})"
        )


def of(config: pytest.Config) -> DistconfSession:
    session = config.pluginmanager.get_plugin(NAME)
    assert isinstance(session, DistconfSession), "the distconf plugin was not configured"
    return session
