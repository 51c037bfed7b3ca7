"""The options of a conformance run, their defaults and their validation, in one place.

``python -m harness run`` and ``mutate``, the pytest plugin's options and each of
``mutate``'s suite and fault runs describe a run with a ``RunConfig``. Its field defaults are
the only place distconf's defaults are written (the CLI's and the plugin's options take them
from here), and making one validates every field, so a bad option is refused before anything
is started, written or deleted.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from harness import catalogue
from harness.errors import (
    InvalidArgument,
    check_int,
    check_one_of,
    check_seconds,
    invalid,
    require,
)
from harness.profiles import PROFILES
from harness.runners import DEFAULT_TIMEOUT, DEVICES, RUNNERS


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One conformance run: which Worlds, which suites, how deep, where the records go."""

    runner: str = RUNNERS[0]
    world_sizes: tuple[int, ...] = (1, 2, 3, 4)
    """Every suite test runs once per size (that its ``world_size`` marker allows)."""
    device: str = "cpu"
    rank_timeout: float = DEFAULT_TIMEOUT
    """Seconds one ``world.run`` call may take on every rank."""
    test_timeout: float = 1800.0
    """Seconds one test may take in the driver: a backstop for a hang outside the ranks."""
    strict_collectives: bool = False
    """Process runner: check every collective's fingerprint across ranks."""
    profile: str = "ci"
    """A hypothesis profile: one of ``harness.profiles``, or one registered in this process."""
    seed: int | None = None
    """The hypothesis seed; a random profile without one gets one drawn and printed."""
    suites: tuple[str, ...] = ()
    """Suite names (``suites/test_<name>.py``); every suite when empty."""
    out: Path = Path("reports", "latest")
    """Where the results files, the report and (for ``mutate``) the logs go."""
    junit: Path | None = None
    faults: tuple[str, ...] = ()
    """Fault IDs injected for the whole run (``harness.faults``): a mutation run."""
    fault_files: tuple[str, ...] = ()
    """Python files adding faults to the catalogue."""
    cheap_first: Path | None = None
    """Results of an earlier run: within each World, the tests it timed fastest go first."""
    exitfirst: bool = False
    """Stop at the first failing test (a fault run needs only one)."""

    def __post_init__(self) -> None:
        check_one_of("runner", self.runner, RUNNERS)
        check_world_sizes("world_sizes", self.world_sizes)
        check_one_of("device", self.device, DEVICES)
        check_seconds("rank_timeout", self.rank_timeout)
        check_seconds("test_timeout", self.test_timeout)
        _check_profile(self.profile)
        if self.seed is not None:
            check_int("seed", self.seed, minimum=0)
        for suite in self.suites:
            check_one_of("suite", suite, available_suites())
        require(isinstance(self.out, Path), "out", self.out, "a pathlib.Path")

    @property
    def world_sizes_text(self) -> str:
        """``(1, 2, 3)`` -> ``"1,2,3"``: how the options spell it."""
        return ",".join(map(str, self.world_sizes))

    def as_record(self) -> dict[str, Any]:
        """The fields as JSON values (paths as strings, tuples as lists)."""
        return {field.name: _json_value(getattr(self, field.name)) for field in fields(self)}


def _json_value(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    return list(value) if isinstance(value, tuple) else value


def as_option(error: InvalidArgument) -> InvalidArgument:
    """A complaint about a field as the command line and pytest spell its option
    (``world_sizes='0' must be ...`` -> ``--world-sizes='0' must be ...``)."""
    return error.renamed("--" + error.name.replace("_", "-")) if error.name else error


def _check_profile(name: str) -> None:
    from hypothesis import settings
    from hypothesis.errors import InvalidArgument as UnknownProfile

    try:
        settings.get_profile(name)
    except UnknownProfile:
        raise invalid(
            "profile", name, f"one of {PROFILES} or a profile registered with hypothesis"
        ) from None


def check_world_sizes(name: str, sizes: object) -> None:
    """A non-empty tuple of distinct positive ints."""
    ok = (
        isinstance(sizes, tuple)
        and bool(sizes)
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)
        and len(set(sizes)) == len(sizes)
    )
    require(ok, name, sizes, "a non-empty tuple of distinct positive ints")


def parse_world_sizes(text: str, name: str = "world_sizes") -> tuple[int, ...]:
    """``"1,2,2,4"`` -> ``(1, 2, 4)`` (repeats dropped, order kept)."""
    try:
        sizes = tuple(dict.fromkeys(int(part) for part in str(text).split(",")))
    except ValueError:
        sizes = ()
    if not sizes or any(size < 1 for size in sizes):
        raise invalid(name, text, "a comma-separated list of positive ints")
    return sizes


def split_names(values: list[str]) -> tuple[str, ...]:
    """Repeated or comma-separated options as one tuple (``["a,b", "c"]`` -> ``a, b, c``)."""
    return tuple(part for value in values for part in value.split(",") if part)


@functools.cache
def available_suites() -> tuple[str, ...]:
    """The suite names under the suites directory (``test_<name>.py``)."""
    return tuple(
        sorted(p.stem.removeprefix("test_") for p in catalogue.DEFAULT_SUITES.glob("test_*.py"))
    )


def suite_paths(config: RunConfig) -> list[Path]:
    """The files (or the directory) pytest collects for ``config.suites``."""
    if not config.suites:
        return [catalogue.DEFAULT_SUITES]
    return [catalogue.DEFAULT_SUITES / f"test_{name}.py" for name in config.suites]


DEFAULTS = RunConfig()
"""distconf's defaults: the CLI's and the plugin's options read theirs from here."""
