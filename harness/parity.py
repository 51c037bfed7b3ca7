"""Comparisons that say what differs: "got X, should be Y [call]", with error metrics.

Exact comparisons are for data movement (placements, chunks), where any difference is a bug.
``assert_close`` is for arithmetic done in a different order (sharded training against one
device); every caller states its tolerances and why they are not zero.

``[call]`` is the reproduction of the example being checked, attached once per example
(``attach(case.call())`` right after drawing the case) rather than passed to every
comparison; the plugin clears it at the start of every example and of every test.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from harness.errors import require

_EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "bfloat16": 2.0**-7, "int64": 1.0}


@dataclass(frozen=True)
class ErrorMetrics:
    """How far ``actual`` is from ``expected``: absolute, relative, and in ulps."""

    max_abs: float
    max_rel: float
    max_ulp: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def error_metrics(actual: np.ndarray, expected: np.ndarray, dtype: str) -> ErrorMetrics:
    if actual.size == 0:
        return ErrorMetrics(0.0, 0.0, 0.0)
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    diff = np.abs(a - e)
    scale = np.abs(e)
    rel = np.divide(diff, scale, out=np.where(diff > 0, np.inf, 0.0), where=scale > 0)
    # One ulp of ``dtype`` at the magnitude of the expected value (2**exponent * eps).
    exponent = np.floor(np.log2(np.maximum(scale, np.finfo(np.float64).tiny)))
    ulp = np.power(2.0, exponent) * _EPS.get(dtype, _EPS["float32"])
    return ErrorMetrics(float(diff.max()), float(rel.max()), float((diff / ulp).max()))


def _first_mismatch(actual: np.ndarray, expected: np.ndarray) -> tuple[int, ...]:
    differs = ~((actual == expected) | (np.isnan(actual) & np.isnan(expected)))
    return tuple(int(i) for i in np.argwhere(differs)[0])


_attached = ""
"""The reproduction of the current example; empty: none attached."""


def attach(call: str) -> None:
    """Attach ``call``, the reproduction of the current example: every ``assert_*`` failure
    (and every ``failure``) ends with it in brackets until another is attached or the next
    example or test starts. A test attaches its case's ``call()`` right after drawing it, and
    a more specific text before comparing a part of the case run on its own."""
    global _attached
    require(isinstance(call, str), "call", call, "a str")
    _attached = call


def new_example() -> None:
    """Forget the attached reproduction: the plugin calls this as every example starts, so a
    failure before the example attaches its own names no other example's."""
    global _attached
    _attached = ""


def _tag() -> str:
    return f" [{_attached}]" if _attached else ""


def failure(message: str) -> AssertionError:
    """The error for a check no ``assert_*`` helper states: ``message`` ("got X, should be Y")
    with the attached reproduction. ``raise failure(...)``."""
    return AssertionError(f"{message}{_tag()}")


def assert_equal_values(actual: Any, expected: Any, *, what: str) -> None:
    """Plain values (shapes, placements, dtypes): got X, should be Y."""
    __tracebackhide__ = True
    if actual != expected:
        raise failure(f"{what}: got {actual!r}, should be {expected!r}")


def assert_array_equal(actual: np.ndarray, expected: np.ndarray, *, what: str) -> None:
    """Same shape and bit-for-bit the same values (NaN equals NaN)."""
    __tracebackhide__ = True
    assert_equal_values(tuple(actual.shape), tuple(expected.shape), what=f"shape of {what}")
    if actual.size == 0:
        return
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    if np.array_equal(a, e, equal_nan=True):
        return
    index = _first_mismatch(a, e)
    count = int((~((a == e) | (np.isnan(a) & np.isnan(e)))).sum())
    raise failure(
        f"{what}: got {a[index].item()!r} at index {index}, should be {e[index].item()!r} "
        f"({count} of {a.size} elements differ)"
    )


def assert_close(
    actual: np.ndarray,
    expected: np.ndarray,
    *,
    rtol: float,
    atol: float,
    dtype: str,
    what: str,
    why: str,
    record_as: str | None = None,
) -> ErrorMetrics:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise; returns the metrics.

    ``why`` says why the tolerance is not zero; it is part of the failure message.
    ``record_as`` keeps the metrics for the report under that name (see ``record``).
    """
    __tracebackhide__ = True
    for name, tolerance in (("rtol", rtol), ("atol", atol)):
        require(math.isfinite(tolerance) and tolerance >= 0, name, tolerance, "finite and >= 0")
    assert_equal_values(tuple(actual.shape), tuple(expected.shape), what=f"shape of {what}")
    metrics = error_metrics(actual, expected, dtype)
    if record_as is not None:
        record(record_as, metrics, rtol=rtol, atol=atol)
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    bad = np.abs(a - e) > atol + rtol * np.abs(e)
    if bad.any():
        index = tuple(int(i) for i in np.argwhere(bad)[0])
        raise failure(
            f"{what}: got {a[index].item()!r} at index {index}, "
            f"should be {e[index].item()!r} within "
            f"atol={atol:g} + rtol={rtol:g} ({why}); {int(bad.sum())} of {a.size} elements "
            f"outside; max abs {metrics.max_abs:.3g}, max rel {metrics.max_rel:.3g}, "
            f"max ulp {metrics.max_ulp:.3g}"
        )
    return metrics


@dataclass
class ParityLog:
    """Error metrics recorded during one test; keeps the worst value of each per name."""

    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    references: list[str] = field(default_factory=list)
    """Which single-device implementation each comparison was made against."""

    def add(self, name: str, metrics: ErrorMetrics, *, rtol: float, atol: float) -> None:
        """Keep the worst error per name, with the (largest) tolerance it was held to."""
        worst = self.metrics.setdefault(name, {})
        values = {**metrics.as_dict(), "rtol": rtol, "atol": atol}
        for key, value in values.items():
            worst[key] = max(worst.get(key, -math.inf), value)


_active: ParityLog | None = None


@contextlib.contextmanager
def collecting() -> Iterator[ParityLog]:
    """Collect what ``record`` is given while the block runs (the plugin wraps each test),
    which starts with no reproduction attached."""
    global _active, _attached
    previous, _active = _active, ParityLog()
    previous_call, _attached = _attached, ""
    try:
        yield _active
    finally:
        _active, _attached = previous, previous_call


def note_reference(description: str) -> None:
    """Say which reference the test compares against (device and implementation); kept
    with the test's record, once per distinct description. A no-op outside ``collecting``."""
    if _active is not None and description not in _active.references:
        _active.references.append(description)


def record(name: str, metrics: ErrorMetrics, *, rtol: float, atol: float) -> None:
    """Keep ``metrics`` (held to ``rtol``/``atol``) for the report under ``name``; a no-op
    outside ``collecting``."""
    if _active is not None:
        _active.add(name, metrics, rtol=rtol, atol=atol)
