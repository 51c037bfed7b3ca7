"""What the plugin checks and marks at collection: spec markers against the catalogue, known
deviations (``specs/expectations``) applied to the tests they match, and, asked to, the
order of the tests within each World (the fastest of an earlier run first)."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from harness import catalogue
from harness.outcome import expectations
from harness.outcome.results import read_results
from harness.plugin import options, state
from harness.plugin.worlds import world_key
from harness.runners import WorldKey

Tests = dict[str, list[tuple[str, list[str]]]]
"""Per suite name: every test it defines, with the spec IDs it carries."""


def _marks(obj: Any) -> list[pytest.Mark]:
    found = getattr(obj, "pytestmark", [])
    marks: list[Any] = found if isinstance(found, list) else [found]
    return [m.mark if isinstance(m, pytest.MarkDecorator) else m for m in marks]


def _spec_ids(marks: list[pytest.Mark]) -> list[str]:
    return [str(a) for m in marks if m.name == "spec" for a in m.args]


def module_tests(module: Any) -> Iterator[tuple[str, list[str]]]:
    """Every test a suite module defines (functions and ``Test*`` classes' methods) with the
    spec IDs it carries, module and class marks included, whatever was selected to run."""
    module_marks = _marks(module)
    for name, obj in vars(module).items():
        where = f"{module.__name__}.{name}"
        if inspect.isclass(obj) and name.startswith("Test"):
            class_marks = module_marks + _marks(obj)
            for attr, method in vars(obj).items():
                if attr.startswith("test") and callable(method):
                    yield f"{where}.{attr}", _spec_ids(class_marks + _marks(method))
        elif name.startswith("test") and inspect.isfunction(obj):
            yield where, _spec_ids(module_marks + _marks(obj))


def problems(tests: Tests, specs: dict[str, catalogue.Spec], suites: Path) -> list[str]:
    """Tests without exactly one known spec ID, and active specs no test covers."""
    return _marker_problems(tests, specs) + _coverage_problems(tests, specs, suites)


def _marker_problems(tests: Tests, specs: dict[str, catalogue.Spec]) -> list[str]:
    found: list[str] = []
    for where, ids in (test for module_tests in tests.values() for test in module_tests):
        if len(ids) != 1:
            found.append(f"{where} must carry exactly one spec marker, has {ids!r}")
        found += [f"{where} names unknown spec ID {i!r}" for i in ids if i not in specs]
    return found


def _coverage_problems(tests: Tests, specs: dict[str, catalogue.Spec], suites: Path) -> list[str]:
    covered = {suite: {i for _, ids in listed for i in ids} for suite, listed in tests.items()}
    found = []
    for spec in specs.values():
        if not (suites / f"test_{spec.suite}.py").exists():
            found.append(
                f"spec {spec.id!r} names suite {spec.suite!r}, "
                f"but test_{spec.suite}.py does not exist"
            )
        elif spec.status == "active" and spec.id not in covered.get(spec.suite, {spec.id}):
            found.append(
                f"spec {spec.id!r} is active but no test in test_{spec.suite}.py covers it"
            )
    return found


def apply_expectations(
    items: list[pytest.Item],
    entries: list[expectations.Expectation],
    specs: dict[str, catalogue.Spec],
    *,
    world_of: Callable[[pytest.Item], WorldKey | None],
    torch_version: str,
    backend: str,
) -> None:
    """Mark the tests torch is known to fail; warn about entries that matched none of their
    spec's tests, where that spec has tests among ``items`` (a run that selected other tests
    is not told about entries it could not have met). Raises ``ExpectationError`` for an entry
    naming an unknown spec."""
    unknown = [f"{e.source}: unknown spec ID {e.spec!r}" for e in entries if e.spec not in specs]
    if unknown:
        raise expectations.ExpectationError("; ".join(unknown))
    used = set()
    collected = {str(m.args[0]) for i in items if (m := i.get_closest_marker("spec")) and m.args}
    for item in items:
        entry = _expectation_for(item, entries, world_of(item), torch_version, backend)
        if entry is not None:
            item.add_marker(expectations.marker_for(entry, torch_version))
            state.of(item).expectation = entry.as_record(torch_version)
            state.of(item).expectation_entry = entry
            used.add(entry.source)
    for entry in entries:
        if entry.source not in used and entry.spec in collected:
            warnings.warn(
                expectations.ExpectationWarning(
                    f"expectation {entry.source} (spec {entry.spec!r}) matched no test"
                ),
                stacklevel=1,
            )


def _expectation_for(
    item: pytest.Item,
    entries: list[expectations.Expectation],
    key: WorldKey | None,
    torch_version: str,
    backend: str,
) -> expectations.Expectation | None:
    marker = item.get_closest_marker("spec")
    if key is None or marker is None or not marker.args:
        return None
    return expectations.find(
        entries,
        spec=str(marker.args[0]),
        runner=key.runner,
        device=key.device,
        backend=backend,
        world_size=key.world_size,
        torch=torch_version,
        params=_own_params(item),
    )


def _own_params(item: pytest.Item) -> tuple[str, ...]:
    """The values of the test's own string parameters (its World is a parameter too)."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return ()
    return tuple(v for v in callspec.params.values() if isinstance(v, str))


def _is_suite_item(item: pytest.Item, suites: Path) -> bool:
    return isinstance(item, pytest.Function) and item.path.resolve().is_relative_to(suites)


def check_expectations(config: pytest.Config) -> None:
    """A known-deviation file that does not load is a usage error at configure time, before
    the session starts: no results file is opened and no World is started. A directory that
    is not there is left to ``check_and_mark``: only a run of the suites needs one."""
    directory = options.expectations_dir(config)
    if not directory.is_dir():
        return
    try:
        expectations.load(directory)
    except expectations.ExpectationError as exc:
        raise pytest.UsageError(f"distconf: {exc}") from None


def check_and_mark(config: pytest.Config, items: list[pytest.Item], *, backend: str) -> None:
    """For the suites among ``items``: every test carries one known spec ID and every active
    spec is covered (else a usage error), and known deviations mark their tests (``backend``:
    the process group's, which an expectation may name)."""
    suites = options.suites_dir(config)
    modules = {
        item.path.stem.removeprefix("test_"): item.module
        for item in items
        if isinstance(item, pytest.Function) and _is_suite_item(item, suites)
    }
    elsewhere = [
        item
        for item in items
        if item.get_closest_marker("spec") is not None
        and not _is_suite_item(item, suites)
        and _uses_worlds(item)
    ]
    if not modules and not elsewhere:
        return
    specs = catalogue.load(options.catalogue_path(config))
    _check_spec_ids(elsewhere, specs)
    if not modules:
        return
    tests = {suite: list(module_tests(module)) for suite, module in modules.items()}
    found = problems(tests, specs, suites)
    if found:
        raise pytest.UsageError(
            "distconf: suites and catalogue disagree:\n" + "\n".join(f"  - {p}" for p in found)
        )
    try:
        apply_expectations(
            items,
            expectations.load(options.expectations_dir(config)),
            specs,
            world_of=world_key,
            torch_version=metadata.version("torch"),
            backend=backend,
        )
    except expectations.ExpectationError as exc:
        raise pytest.UsageError(f"distconf: {exc}") from None


def _uses_worlds(item: pytest.Item) -> bool:
    """A distconf test outside the suites: it asks for a World (another project's ``spec``
    marker is none of distconf's business)."""
    return bool({"world", "worlds"} & set(getattr(item, "fixturenames", ())))


def _check_spec_ids(items: list[pytest.Item], specs: dict[str, catalogue.Spec]) -> None:
    """A distconf test outside the suites that names a spec must name one the catalogue has:
    a mistyped ID would otherwise count as a check of nothing (the suites' own tests get the
    fuller ``problems`` check)."""
    unknown = []
    for item in items:
        marker = item.get_closest_marker("spec")
        ids = [str(a) for a in marker.args] if marker is not None else []
        test = item.nodeid.split("[")[0]
        unknown += [f"{test} names unknown spec ID {i!r}" for i in ids if i not in specs]
    if unknown:
        raise pytest.UsageError(
            "distconf: tests name specs the catalogue does not have "
            f"({options.catalogue_path(items[0].config)}):\n"
            + "\n".join(f"  - {u}" for u in dict.fromkeys(unknown))
        )


class CheapFirst:
    """``--distconf-cheap-first``: within each World (pytest keeps the tests of a
    session-scoped World together), the tests an earlier run timed fastest go first."""

    def __init__(self, sources: tuple[Path, ...]) -> None:
        self.durations = _durations(sources)

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


def _durations(sources: tuple[Path, ...]) -> dict[str, float]:
    paths: list[Path] = []
    for path in sources:
        paths += sorted(path.glob("**/results*.jsonl")) if path.is_dir() else [path]
    return {
        record["nodeid"]: float(record.get("duration") or 0.0)
        for path in paths
        for record in read_results(path).tests
    }
