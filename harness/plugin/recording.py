"""Recording: one results record per test (JSONL, flushed), with its outcome, the examples
hypothesis ran, the time to its first failing example, its parity metrics and the command
that reproduces it."""

from __future__ import annotations

import contextlib
import functools
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.errors import UnsatisfiedAssumption

from harness import parity, profiles
from harness.config import RunConfig
from harness.errors import InvalidArgument
from harness.outcome import outputs
from harness.outcome.results import (
    ResultsWriter,
    TestRecord,
    accelerator_versions,
    environment_stamp,
)
from harness.plugin import options, state
from harness.plugin.outcomes import describe_outcome
from harness.plugin.worlds import uses_other_worlds, world_key
from harness.runners import WorldKey


def open_writer(config: pytest.Config, run: RunConfig, backend: str) -> ResultsWriter | None:
    """The session's results file (``--distconf-results``; one per xdist worker), headed by
    the environment stamp (``backend``: the one the Worlds use) and the run's identity; None
    when no results were asked for. With ``--distconf-keep-earlier`` the controller first
    moves an earlier run's records aside: after pytest's configuration was checked (the
    expectations directory too, which collection reads later) and before xdist starts its
    workers (its ``pytest_sessionstart`` is trylast)."""
    target = config.getoption("distconf_results")
    if not target:
        return None
    path = Path(target)
    # config.workerinput, not $PYTEST_XDIST_WORKER: a pytest started from inside an xdist
    # worker (pytester, subprocess) inherits the variable but is not that worker.
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker:
        path = path.with_name(f"{path.stem}.{worker}{path.suffix}")
    elif config.getoption("distconf_keep_earlier"):
        _check_expectations_dir(config)
        outputs.keep_earlier(path.parent)
    header = environment_stamp(
        run_id=options.run_id(config),
        worker=worker,
        runner=run.runner,
        world_sizes=list(run.world_sizes),
        device=run.device,
        backend=backend,
        backend_plugins=list(run.backend_plugins),
        profile=settings.get_current_profile_name(),
        seed=options.seed(config),
        derandomize=settings.default.derandomize if settings.default else None,
        max_examples=settings.default.max_examples if settings.default else None,
        faults=list(run.faults),
        **accelerator_versions(),
    )
    try:
        return ResultsWriter(path, header)
    except InvalidArgument as exc:
        raise pytest.UsageError(str(exc.renamed("--distconf-results"))) from None


def end_fields(config: pytest.Config) -> dict[str, int]:
    """What the end record of the session's file says of xdist: in the controller's (the
    run's main file, which holds none of the tests), how many workers ran them, each
    recording its own in a file beside it."""
    if not config.pluginmanager.has_plugin("dsession"):
        return {}
    return {"workers": len(config.getoption("tx") or [])}


def _check_expectations_dir(config: pytest.Config) -> None:
    """A run of the suites needs its known deviations, which collection reads: a directory
    that is not there is refused before the earlier run is moved aside, not after."""
    directory = options.expectations_dir(config)
    if not directory.is_dir():
        raise pytest.UsageError(
            f"distconf_expectations={str(directory)!r} must be a directory of *.toml "
            "known-deviation files (it does not exist; an empty directory means no known "
            "deviations)"
        )


def reproduce_command(
    config: pytest.Config, run: RunConfig, nodeid: str, key: WorldKey | None, *, every_size: bool
) -> str:
    """A command that re-runs one test on the same World with the same hypothesis settings.

    ``every_size``: the test also draws other world sizes (the ``worlds`` fixture), so the
    command keeps every configured size; the node ID still selects the test's own World."""
    parts = ["python", "-m", "pytest", shlex.quote(nodeid), "-p", "harness.plugin"]
    if key is not None:
        sizes = run.world_sizes if every_size else (key.world_size,)
        parts += [
            f"--runner={key.runner}",
            f"--world-sizes={','.join(map(str, sizes))}",
            f"--device={key.device}",
        ]
    if run.strict_collectives:
        parts.append("--strict-collectives")
    if run.backend is not None:
        parts.append(f"--backend={run.backend}")
    parts += [f"--backend-plugin={module}" for module in run.backend_plugins]
    parts.append(f"--hypothesis-profile={settings.get_current_profile_name()}")
    seed = options.seed(config)
    if seed is not None:
        parts.append(f"--hypothesis-seed={seed}")
    return " ".join(parts)


def observing(item: pytest.Item, run_sizes: tuple[int, ...]) -> Any:
    """Wraps a test's call (a hook wrapper's body): its parity metrics, its examples, its
    first failure; a known deviation runs unshrunk. ``run_sizes``: the session's world
    sizes."""
    test = state.of(item)
    with parity.collecting() as log, _item_settings(item, test, run_sizes):
        test.parity = log
        return (yield from _counting_examples(item, test))


@contextlib.contextmanager
def _item_settings(
    item: pytest.Item, test: state.TestState, run_sizes: tuple[int, ...]
) -> Iterator[None]:
    """The test's settings for this item: a property's share of its examples at the item's
    world size (``profiles.examples_at``: settings of ``costly`` or ``property_settings``); a
    known deviation (strict xfail, or flaky: met by some examples) unshrunk, since it needs
    one failing example for its verdict and its expectation already names the smallest:
    shrinking it again cost hundreds of examples per test (a third of a clean CPU run's time;
    on processes a reset of the ranks each; on the local runner at world size 64, minutes)."""
    function: Any = getattr(item, "obj", None)
    # @given keeps the test's settings on the test itself; there is no public way to
    # change them once @settings has been applied.
    current = getattr(function, "_hypothesis_internal_use_settings", None)
    if current is None:
        yield
        return
    changes: dict[str, Any] = {}
    key = world_key(item)
    whole_at = profiles.whole_at(current)
    if key is not None and whole_at is not None:
        changes["max_examples"] = profiles.examples_at(
            key.world_size, current.max_examples, whole_at, run_sizes
        )
    if test.expectation is not None and test.expectation["status"] in ("xfail", "flaky"):
        changes["phases"] = tuple(phase for phase in current.phases if phase is not Phase.shrink)
    if not changes:
        yield
        return
    function._hypothesis_internal_use_settings = settings(current, **changes)
    try:
        yield
    finally:
        function._hypothesis_internal_use_settings = current


def _counting_examples(item: pytest.Item, test: state.TestState) -> Any:
    """Count test-case executions through hypothesis' public ``inner_test`` attribute; each
    starts with no reproduction attached (``parity.attach``)."""
    handle = getattr(getattr(item, "obj", None), "hypothesis", None)
    if handle is None or not hasattr(handle, "inner_test"):
        return (yield)
    inner = handle.inner_test
    test.examples = 0
    started = time.perf_counter()

    @functools.wraps(inner)
    def counted(*args: Any, **kwargs: Any) -> Any:
        assert test.examples is not None
        test.examples += 1
        parity.new_example()
        try:
            return inner(*args, **kwargs)
        except UnsatisfiedAssumption:
            raise
        except Exception:
            if test.first_failure is None:  # before any shrinking
                test.first_failure = (test.examples, time.perf_counter() - started)
            raise

    handle.inner_test = counted
    try:
        return (yield)
    finally:
        handle.inner_test = inner


def record(item: pytest.Item, run: RunConfig) -> TestRecord:
    """The results record of a finished test (its three phases seen)."""
    test = state.of(item)
    key = world_key(item)
    spec_marker = item.get_closest_marker("spec")
    log = test.parity
    return TestRecord(
        nodeid=item.nodeid,
        spec=str(spec_marker.args[0]) if spec_marker and spec_marker.args else None,
        runner=key.runner if key else None,
        world_size=key.world_size if key else None,
        device=key.device if key else None,
        duration=sum(report.duration for report, _ in test.phases.values()),
        examples=test.examples,
        **_first_failure(test),
        metrics=log.metrics if log else {},
        references=log.references if log else [],
        exercised=dict(log.exercised) if log else {},
        profile=settings.get_current_profile_name(),
        seed=options.seed(item.config),
        reproduce=reproduce_command(
            item.config, run, item.nodeid, key, every_size=uses_other_worlds(item)
        ),
        expectation=_expectation(test),
        **describe_outcome(test.phases),
    )


def _expectation(test: state.TestState) -> dict[str, Any] | None:
    """The test's known deviation, with why its failure was not that deviation, if so."""
    if test.expectation is None or test.different_failure is None:
        return test.expectation
    return {**test.expectation, "mismatch": test.different_failure}


def _first_failure(test: state.TestState) -> dict[str, Any]:
    if test.first_failure is None:
        return {}
    examples, seconds = test.first_failure
    return {"examples_to_failure": examples, "seconds_to_failure": round(seconds, 3)}
