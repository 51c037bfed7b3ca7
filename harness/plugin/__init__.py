"""The distconf pytest plugin (thin): options, markers, the ``world`` fixture, spec checks,
results recording.

Registered through the ``pytest11`` entry point. It imports no torch at import time: torch
is imported when the first World is built. Everything here is inert for tests that neither
live under the suites directory nor ask for the ``world`` fixture.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import shlex
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.errors import UnsatisfiedAssumption

from harness import catalogue, expectations, parity
from harness.plugin import collection, gpus
from harness.profiles import PROFILES, SEEDED
from harness.results import ResultsWriter, TestRecord, accelerator_versions, environment_stamp
from harness.runners import DEVICES, RUNNERS, WorldKey

DEFAULT_WORLD_SIZES = (1, 2, 3, 4)


_parsers: list[pytest.Parser] = []  # to patch xdist's "-n" when it registers after us
_worlds_key = pytest.StashKey[Any]()
_writer_key = pytest.StashKey[ResultsWriter | None]()
_phases_key = pytest.StashKey[dict[str, Any]]()
_examples_key = pytest.StashKey[int]()
_first_failure_key = pytest.StashKey[tuple[int, float]]()
_faults_key = pytest.StashKey[list[str]]()
_parity_key = pytest.StashKey[parity.ParityLog]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("distconf", "distconf conformance harness")
    group.addoption(
        "--runner", dest="distconf_runner", default="threads", help=f"rank runner, one of {RUNNERS}"
    )
    group.addoption(
        "--world-sizes",
        dest="distconf_world_sizes",
        default=",".join(map(str, DEFAULT_WORLD_SIZES)),
        help="comma-separated world sizes to run every suite test at (default: 1,2,3,4)",
    )
    group.addoption(
        "--device", dest="distconf_device", default="cpu", help=f"rank device, one of {DEVICES}"
    )
    group.addoption(
        "--rank-timeout",
        dest="distconf_rank_timeout",
        type=float,
        default=60.0,
        help="deadline in seconds of one world.run call (default: 60)",
    )
    group.addoption(
        "--strict-collectives",
        dest="distconf_strict_collectives",
        action="store_true",
        help="process runner: check every collective's fingerprint across ranks "
        "(TORCH_DISTRIBUTED_DEBUG=DETAIL); the thread runner always checks",
    )
    group.addoption("--distconf-results", default=None, help="write JSONL results to this file")
    group.addoption(
        "--distconf-profile",
        dest="distconf_profile",
        default=None,
        help=f"hypothesis profile, one of {PROFILES}; 'report' draws and records a seed "
        "when --hypothesis-seed is not given",
    )
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
    _parsers.append(parser)
    _accept_gpu_workers(parser)
    group.addoption(
        "--distconf-cheap-first",
        dest="distconf_cheap_first",
        default=None,
        help="results files or directories of an earlier run (comma-separated): within each "
        "world size, run the tests it timed fastest first (tests it did not time keep their "
        "place after them); with --exitfirst a failing run fails sooner",
    )
    parser.addini("distconf_catalogue", "path of the spec catalogue", default=None)
    parser.addini("distconf_suites", "directory holding the conformance suites", default=None)
    parser.addini(
        "distconf_expectations", "directory of known-deviation files (*.toml)", default=None
    )


def _accept_gpu_workers(parser: pytest.Parser) -> None:
    # pytest keeps each option's argparse action on its Argument; xdist's "-n" must accept
    # "gpu" before its own type conversion runs (at parse time, before any hook sees it).
    actions = [option._action for group in parser._groups for option in group.options]
    gpus.patch_numprocesses_option(actions)


def pytest_plugin_registered(plugin: object, manager: pytest.PytestPluginManager) -> None:
    """xdist may register after this plugin: patch its "-n" once it has added it."""
    for parser in _parsers:
        _accept_gpu_workers(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    _choose_profile(config)
    _resolve_gpu_workers(config)


def _choose_profile(config: pytest.Config) -> None:
    """``--distconf-profile``: hand hypothesis its profile (and for 'report' a seed) before
    hypothesis' own configure hook reads them."""
    profile = config.getoption("distconf_profile")
    if profile is None:
        return
    if profile not in PROFILES:
        raise pytest.UsageError(f"--distconf-profile={profile!r} must be one of {PROFILES}")
    config.option.hypothesis_profile = profile
    if profile in SEEDED and getattr(config.option, "hypothesis_seed", None) is None:
        config.option.hypothesis_seed = random.randrange(2**32)


def _resolve_gpu_workers(config: pytest.Config) -> None:
    """Resolve ``-n gpu`` into one worker per disjoint GPU group, before xdist reads ``-n``."""
    if getattr(config.option, "numprocesses", None) != gpus.GPU_WORKERS:
        return
    per_worker = config.getoption("distconf_gpus_per_worker") or _gpus_per_world(config)
    groups = gpus.plan_workers(gpus.visible_gpus(), per_worker)
    if not groups:
        config.option.numprocesses = 0  # in-process; GPU tests skip and say why
        return
    config.option.numprocesses = None
    config.option.tx = gpus.worker_specs(groups)
    if config.option.dist == "no":
        config.option.dist = "load"


def _gpus_per_world(config: pytest.Config) -> int:
    """GPUs one World takes: a GPU per rank on the process runner, one shared by threads."""
    if config.getoption("distconf_device") != "cuda":
        return 1
    if config.getoption("distconf_runner") != "processes":
        return 1
    return max(world_sizes(config))


def _require_gpus(config: pytest.Config, needed: int, what: str) -> None:
    held = gpus.gpus_held()
    if held >= needed:
        return
    message = f"{what} needs {needed} GPU(s); this process holds {held}"
    if config.getoption("distconf_require_gpus"):
        pytest.fail(f"{message} (--require-gpus)", pytrace=False)
    pytest.skip(message)


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
    _validate_options(config)
    _inject_faults(config)
    sources = config.getoption("distconf_cheap_first")
    if sources:
        config.pluginmanager.register(_CheapFirst(_durations(sources)), "distconf-cheap-first")


def _inject_faults(config: pytest.Config) -> None:
    from harness import faults

    ids = faults.parse(config.getoption("distconf_faults") or os.environ.get(faults.ENV_VAR))
    files = faults.parse(
        config.getoption("distconf_fault_files") or os.environ.get(faults.FILES_ENV_VAR)
    )
    if not ids:
        return
    try:
        config.add_cleanup(faults.activate(ids, files))
    except faults.FaultError as exc:
        raise pytest.UsageError(f"--distconf-faults: {exc}") from None
    config.stash[_faults_key] = ids


def pytest_sessionstart(session: pytest.Session) -> None:
    # Not at configure time: hypothesis loads --hypothesis-profile in its own configure hook.
    session.config.stash[_writer_key] = _open_writer(session.config)


def _validate_options(config: pytest.Config) -> None:
    runner, device = config.getoption("distconf_runner"), config.getoption("distconf_device")
    if runner not in RUNNERS:
        raise pytest.UsageError(f"--runner={runner!r} must be one of {RUNNERS}")
    if device not in DEVICES:
        raise pytest.UsageError(f"--device={device!r} must be one of {DEVICES}")
    world_sizes(config)
    if not config.getoption("distconf_rank_timeout") > 0:
        raise pytest.UsageError(
            f"--rank-timeout={config.getoption('distconf_rank_timeout')!r} must be > 0"
        )


def world_sizes(config: pytest.Config) -> tuple[int, ...]:
    text = str(config.getoption("distconf_world_sizes"))
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(size < 1 for size in sizes):
        raise pytest.UsageError(
            f"--world-sizes={text!r} must be a comma-separated list of positive ints"
        )
    return tuple(dict.fromkeys(sizes))


def _open_writer(config: pytest.Config) -> ResultsWriter | None:
    target = config.getoption("distconf_results")
    if not target:
        return None
    path = Path(target)
    # config.workerinput, not $PYTEST_XDIST_WORKER: a pytest started from inside an xdist
    # worker (pytester, subprocess) inherits the variable but is not that worker.
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker:
        path = path.with_name(f"{path.stem}.{worker}{path.suffix}")
    header = environment_stamp(
        runner=config.getoption("distconf_runner"),
        world_sizes=list(world_sizes(config)),
        device=config.getoption("distconf_device"),
        profile=settings.get_current_profile_name(),
        seed=_seed(config),
        derandomize=settings.default.derandomize if settings.default else None,
        max_examples=settings.default.max_examples if settings.default else None,
        faults=config.stash.get(_faults_key, []),
        **accelerator_versions(),
    )
    return ResultsWriter(path, header)


def _seed(config: pytest.Config) -> str | None:
    seed = config.getoption("hypothesis_seed", default=None)
    return None if seed is None else str(seed)


def reproduce_command(
    config: pytest.Config, nodeid: str, key: WorldKey | None, *, every_size: bool = False
) -> str:
    """A command that re-runs one test on the same World with the same hypothesis settings.

    ``every_size``: the test also draws other world sizes (the ``worlds`` fixture), so the
    command keeps every configured size; the node ID still selects the test's own World."""
    parts = ["python", "-m", "pytest", shlex.quote(nodeid), "-p", "harness.plugin"]
    if key is not None:
        sizes = world_sizes(config) if every_size else (key.world_size,)
        parts += [
            f"--runner={key.runner}",
            f"--world-sizes={','.join(map(str, sizes))}",
            f"--device={key.device}",
        ]
    if config.getoption("distconf_strict_collectives"):
        parts.append("--strict-collectives")
    parts.append(f"--hypothesis-profile={settings.get_current_profile_name()}")
    seed = _seed(config)
    if seed is not None:
        parts.append(f"--hypothesis-seed={seed}")
    return " ".join(parts)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    worlds = session.config.stash.get(_worlds_key, None)
    if worlds is not None:
        worlds.close()
    writer = session.config.stash.get(_writer_key, None)
    if writer is not None:
        writer.close(exitstatus=int(exitstatus))


# --- worlds ----------------------------------------------------------------------------


def world_key(item: pytest.Item) -> WorldKey | None:
    """The World a test runs on (its ``world`` parameter), if it asks for one."""
    key = getattr(getattr(item, "callspec", None), "params", {}).get("world")
    return key if isinstance(key, WorldKey) else None


def _sizes_for(item_marker: pytest.Mark | None, configured: tuple[int, ...]) -> tuple[int, ...]:
    if item_marker is None:
        return configured
    allowed, low, high = (
        item_marker.args,
        item_marker.kwargs.get("min"),
        item_marker.kwargs.get("max"),
    )
    return tuple(
        size
        for size in configured
        if (not allowed or size in allowed)
        and (low is None or size >= low)
        and (high is None or size <= high)
    )


def _uses_our_world(metafunc: pytest.Metafunc) -> bool:
    """The test asks for ``world`` and gets this plugin's fixture, not a project's own."""
    if "world" not in metafunc.fixturenames:
        return False
    definitions = getattr(metafunc, "_arg2fixturedefs", {}).get("world")
    return not definitions or getattr(definitions[-1].func, "__module__", None) == __name__


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if not _uses_our_world(metafunc):
        return
    config = metafunc.config
    runner, device = config.getoption("distconf_runner"), config.getoption("distconf_device")
    configured = world_sizes(config)
    sizes_marker = metafunc.definition.get_closest_marker("world_size")
    sizes = _sizes_for(sizes_marker, configured)
    skip = _runner_skip(metafunc.definition.get_closest_marker("runner"), runner)
    if not sizes:
        assert sizes_marker is not None
        skip = skip or (
            f"needs a world size allowed by {sizes_marker.args or ''}{sizes_marker.kwargs or ''}; "
            f"--world-sizes gave {','.join(map(str, configured))}"
        )
        sizes = configured[:1]
    keys = [WorldKey(runner, size, device) for size in sizes]
    marks = [pytest.mark.skip(reason=skip)] if skip else []
    params = [pytest.param(key, id=key.id, marks=marks) for key in keys]
    metafunc.parametrize("world", params, indirect=True, scope="session")


def _runner_skip(marker: pytest.Mark | None, runner: str) -> str | None:
    """Why this runner cannot serve the test (``@pytest.mark.runner("processes", reason=)``)."""
    if marker is None or runner in marker.args:
        return None
    why = marker.kwargs.get("reason", "")
    return f"needs the {' or '.join(marker.args)} runner{': ' + why if why else ''}"


@pytest.fixture(scope="session")
def world(request: pytest.FixtureRequest) -> Any:
    """The session's World for this test's runner × world size × device."""
    key: WorldKey = request.param
    config = request.config
    if key.device == "cuda":
        needed = key.world_size if key.runner == "processes" else 1
        _require_gpus(config, needed, f"a {key.runner} World of {key.world_size} on cuda")
    world = _cache(config).get(key.runner, key.world_size, key.device)
    world.start()  # a World that cannot start is this fixture's error, not a test's failure
    return world


def _cache(config: pytest.Config) -> Any:
    if _worlds_key not in config.stash:
        from harness.runners import WorldCache

        config.stash[_worlds_key] = WorldCache(
            timeout=config.getoption("distconf_rank_timeout"),
            strict_collectives=config.getoption("distconf_strict_collectives"),
        )
    return config.stash[_worlds_key]


@pytest.fixture(scope="session")
def worlds(request: pytest.FixtureRequest) -> Any:
    """Worlds of every session world size for the configured runner and device (a test's own
    ``world`` among them): ``worlds.get(m)`` for checks that move between world sizes.
    ``worlds.sizes`` lists the sizes it serves (on cuda, those this process has GPUs for)."""
    from harness.runners import Worlds

    config = request.config
    runner, device = config.getoption("distconf_runner"), config.getoption("distconf_device")
    sizes = world_sizes(config)
    if device == "cuda":
        held = gpus.gpus_held()
        sizes = tuple(s for s in sizes if (s if runner == "processes" else 1) <= held)
        if not sizes:
            _require_gpus(config, min(world_sizes(config)), f"{runner} Worlds on cuda")
    return Worlds(_cache(config), runner, device, sizes)


@pytest.hookimpl(trylast=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a test reuses a World, check it answers a barrier (it rebuilds itself if not).

    Also hands the spec ID and World to pytest's JUnit XML as test properties."""
    spec = item.get_closest_marker("spec")
    if spec is not None and spec.args:
        item.user_properties.append(("spec", str(spec.args[0])))
    marker = item.get_closest_marker("gpus")
    if marker is not None:
        _require_gpus(item.config, int(marker.args[0]), "this test")
    key = world_key(item)
    cache = item.config.stash.get(_worlds_key, None)
    if key is not None and cache is not None:
        cache.get(key.runner, key.world_size, key.device).check_health()
    if _uses_other_worlds(item) and cache is not None:
        config = item.config
        runner, device = config.getoption("distconf_runner"), config.getoption("distconf_device")
        for world in cache.existing(runner, device):
            world.check_health()


def _uses_other_worlds(item: pytest.Item) -> bool:
    return "worlds" in getattr(item, "fixturenames", ())


# --- spec markers against the catalogue --------------------------------------------------


def _configured_path(config: pytest.Config, ini: str, default: Path) -> Path:
    """An ini path relative to the rootdir, or ``default`` (distconf's own files)."""
    configured = config.getini(ini)
    return Path(config.rootpath, str(configured)).resolve() if configured else default


def _suites_dir(config: pytest.Config) -> Path:
    return _configured_path(config, "distconf_suites", catalogue.DEFAULT_SUITES)


def _catalogue_path(config: pytest.Config) -> Path:
    return _configured_path(config, "distconf_catalogue", catalogue.DEFAULT_PATH)


def _is_suite_item(item: pytest.Item, suites: Path) -> bool:
    return isinstance(item, pytest.Function) and item.path.resolve().is_relative_to(suites)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    suites = _suites_dir(config)
    modules = {
        item.path.stem.removeprefix("test_"): item.module
        for item in items
        if isinstance(item, pytest.Function) and _is_suite_item(item, suites)
    }
    if not modules:
        return
    specs = catalogue.load(_catalogue_path(config))
    tests = {suite: list(collection.module_tests(module)) for suite, module in modules.items()}
    problems = collection.problems(tests, specs, suites)
    if problems:
        raise pytest.UsageError(
            "distconf: suites and catalogue disagree:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    try:
        collection.apply_expectations(
            items,
            expectations.load(_expectations_dir(config)),
            specs,
            set(modules),
            world_of=world_key,
            torch_version=metadata.version("torch"),
        )
    except expectations.ExpectationError as exc:
        raise pytest.UsageError(f"distconf: {exc}") from None


class _CheapFirst:
    """``--distconf-cheap-first``: within each World (pytest keeps the tests of a
    session-scoped World together), the tests an earlier run timed fastest go first."""

    def __init__(self, durations: dict[str, float]) -> None:
        self.durations = durations

    @pytest.hookimpl(trylast=True)  # after pytest grouped the items by World
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        world_order = {key: i for i, key in enumerate(dict.fromkeys(map(world_key, items)))}
        position = {id(item): i for i, item in enumerate(items)}
        items.sort(
            key=lambda item: (
                world_order[world_key(item)],
                self.durations.get(item.nodeid, float("inf")),
                position[id(item)],
            )
        )


def _durations(sources: str) -> dict[str, float]:
    from harness.results import read_results

    paths: list[Path] = []
    for source in filter(None, sources.split(",")):
        path = Path(source)
        if not path.exists():
            raise pytest.UsageError(
                f"--distconf-cheap-first={source!r}: no such results file or directory"
            )
        paths += sorted(path.glob("**/results*.jsonl")) if path.is_dir() else [path]
    return {
        record["nodeid"]: float(record.get("duration") or 0.0)
        for path in paths
        for record in read_results(path).tests
    }


def _expectations_dir(config: pytest.Config) -> Path:
    """Configured, or the ``expectations/`` beside the catalogue (deviations from its specs)."""
    beside = _catalogue_path(config).parent / "expectations"
    return _configured_path(config, "distconf_expectations", beside)


# --- results -----------------------------------------------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    """Collect the test's parity metrics, and count hypothesis test cases."""
    with parity.collecting() as log, _unshrunk_if_expected_to_fail(item):
        item.stash[_parity_key] = log
        return (yield from _counting_examples(item))


@contextlib.contextmanager
def _unshrunk_if_expected_to_fail(item: pytest.Item) -> Iterator[None]:
    """A known deviation (strict xfail) needs one failing example for its verdict, and its
    expectation already names the smallest: shrinking it again cost hundreds of examples per
    test (a third of a clean CPU run's time; on processes a respawn each)."""
    expectation = item.stash.get(collection.EXPECTATION_KEY, None)
    test: Any = getattr(item, "obj", None)
    # @given keeps the test's settings on the test itself; there is no public way to
    # change them once @settings has been applied.
    current = getattr(test, "_hypothesis_internal_use_settings", None)
    if expectation is None or expectation["status"] != "xfail" or current is None:
        yield
        return
    phases = tuple(phase for phase in current.phases if phase is not Phase.shrink)
    test._hypothesis_internal_use_settings = settings(current, phases=phases)
    try:
        yield
    finally:
        test._hypothesis_internal_use_settings = current


def _counting_examples(item: pytest.Item) -> Any:
    """Count test-case executions through hypothesis' public ``inner_test`` attribute."""
    handle = getattr(getattr(item, "obj", None), "hypothesis", None)
    if handle is None or not hasattr(handle, "inner_test"):
        return (yield)
    inner = handle.inner_test
    item.stash[_examples_key] = 0
    started = time.perf_counter()

    @functools.wraps(inner)
    def counted(*args: Any, **kwargs: Any) -> Any:
        item.stash[_examples_key] += 1
        try:
            return inner(*args, **kwargs)
        except UnsatisfiedAssumption:
            raise
        except Exception:
            if _first_failure_key not in item.stash:  # before any shrinking
                elapsed = time.perf_counter() - started
                item.stash[_first_failure_key] = (item.stash[_examples_key], elapsed)
            raise

    handle.inner_test = counted
    try:
        return (yield)
    finally:
        handle.inner_test = inner


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report: pytest.TestReport = yield
    writer = item.config.stash.get(_writer_key, None)
    if writer is None:
        return report
    phases = item.stash.setdefault(_phases_key, {})
    phases[report.when] = (report, call.excinfo)
    if report.when == "teardown":
        writer.write_test(_record(item, phases))
    return report


def _record(item: pytest.Item, phases: dict[str, Any]) -> TestRecord:
    from harness.plugin.outcomes import describe_outcome

    key = world = world_key(item)
    spec_marker = item.get_closest_marker("spec")
    outcome = describe_outcome(phases)
    log = item.stash.get(_parity_key, None)
    return TestRecord(
        nodeid=item.nodeid,
        spec=str(spec_marker.args[0]) if spec_marker and spec_marker.args else None,
        runner=key.runner if key else None,
        world_size=key.world_size if key else None,
        device=key.device if key else None,
        duration=sum(report.duration for report, _ in phases.values()),
        examples=item.stash.get(_examples_key, None),
        **_first_failure(item),
        metrics=log.metrics if log else {},
        references=log.references if log else [],
        profile=settings.get_current_profile_name(),
        seed=_seed(item.config),
        reproduce=reproduce_command(
            item.config, item.nodeid, world, every_size=_uses_other_worlds(item)
        ),
        expectation=item.stash.get(collection.EXPECTATION_KEY, None),
        **outcome,
    )


def _first_failure(item: pytest.Item) -> dict[str, Any]:
    if _first_failure_key not in item.stash:
        return {}
    examples, seconds = item.stash[_first_failure_key]
    return {"examples_to_failure": examples, "seconds_to_failure": round(seconds, 3)}


def pytest_report_header(config: pytest.Config) -> str | None:
    if not _suites_dir(config).is_relative_to(config.rootpath):
        return None  # not a distconf checkout: say nothing in other projects' runs
    return (
        f"distconf: runner={config.getoption('distconf_runner')} "
        f"world sizes={','.join(map(str, world_sizes(config)))} "
        f"device={config.getoption('distconf_device')} "
        f"hypothesis profile={settings.get_current_profile_name()} ({time.strftime('%Y-%m-%d')})"
    )
