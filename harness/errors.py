"""distconf's errors, and the one way to say that a value is not what was expected.

Every error distconf raises on purpose is a ``DistconfError``. A value a user or a caller
gave that distconf does not accept (an option, a case field, a strategy's argument) is an
``InvalidArgument``, raised through the helpers below so that every message reads
``name=value!r must be <what was expected>``. ``assert`` is kept for internal invariants.

This module imports nothing of distconf's: any module, ``specs`` included, may use it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from typing import NoReturn


class DistconfError(Exception):
    """The base of every error distconf raises on purpose."""


class InvalidArgument(DistconfError, ValueError):
    """A value distconf was given is not one it accepts; the message names the value and
    what was expected. Raised through ``invalid``, it also keeps them apart (``name``,
    ``value``, ``expected``), so a front end can name its own spelling of the argument
    (``--world-sizes`` for ``world_sizes``)."""

    name: str | None = None
    value: object = None
    expected: str | None = None

    def renamed(self, name: str) -> InvalidArgument:
        """The same complaint about the argument as the caller spells it."""
        if self.name is None or self.expected is None:
            return self
        return invalid(name, self.value, self.expected)


class WorldStartError(DistconfError, RuntimeError):
    """The ranks could not start or rendezvous: an infrastructure error, not a test result."""


class RunnerUnsupported(DistconfError, RuntimeError):
    """A rank asked its runner for an operation the runner cannot serve (``World.lacks``)."""


class CollectiveMismatch(DistconfError, RuntimeError):
    """Ranks of one process group issued different collectives at the same step."""


class FaultError(DistconfError):
    """A fault cannot be applied: unknown ID, or its patch target is gone from this torch."""


class CatalogueError(DistconfError, ValueError):
    """The spec catalogue cannot be read or is malformed."""


class ExpectationError(DistconfError, ValueError):
    """A known-deviation file cannot be read or names what does not exist."""


class ReportError(DistconfError, ValueError):
    """Results cannot be turned into a report (missing, unreadable, or of no run)."""


class ScreenshotError(DistconfError, RuntimeError):
    """No headless browser could render the report to an image."""


def invalid(name: str, value: object, expected: str) -> InvalidArgument:
    """The error for ``name=value`` not being ``expected`` (a phrase: "a positive int")."""
    error = InvalidArgument(f"{name}={value!r} must be {expected}")
    error.name, error.value, error.expected = name, value, expected
    return error


def require(condition: bool, name: str, value: object, expected: str) -> None:
    """Raise ``invalid(name, value, expected)`` unless ``condition`` holds."""
    if not condition:
        raise invalid(name, value, expected)


def fail(name: str, value: object, expected: str) -> NoReturn:
    """Raise ``invalid(name, value, expected)``: for a branch that knows the value is wrong."""
    raise invalid(name, value, expected)


@contextmanager
def raised_as(error: type[DistconfError], where: str) -> Iterator[None]:
    """Within the block, an ``InvalidArgument`` is raised as ``error`` with ``where`` (a file
    and entry) before its message: checks of a file's values through the helpers below,
    reported as the file's own error (``CatalogueError``, ``ExpectationError``)."""
    try:
        yield
    except InvalidArgument as exc:
        raise error(f"{where}: {exc}") from None


def check_one_of(name: str, value: object, allowed: Collection[object]) -> None:
    """``value`` is one of ``allowed``."""
    require(value in allowed, name, value, f"one of {tuple(allowed)!r}")


def check_subset(
    name: str, values: Iterable[object], allowed: Collection[object], *, non_empty: bool = False
) -> None:
    """Every one of ``values`` is one of ``allowed`` (and, if ``non_empty``, there is one)."""
    values = tuple(values)
    ok = all(v in allowed for v in values) and (bool(values) or not non_empty)
    subset = "a non-empty subset" if non_empty else "a subset"
    require(ok, name, values, f"{subset} of {tuple(allowed)!r}")


def check_int(name: str, value: object, minimum: int = 1) -> int:
    """``value`` is an int (not a bool) of at least ``minimum``; returns it."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    require(is_int and value >= minimum, name, value, expected)  # type: ignore[operator]
    return value  # type: ignore[return-value]


def check_seconds(name: str, value: object) -> float:
    """``value`` is a positive, finite number of seconds; returns it as a float."""
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    ok = is_number and 0 < value < math.inf  # type: ignore[operator]
    require(ok, name, value, "a positive, finite number of seconds")
    return float(value)  # type: ignore[arg-type]
