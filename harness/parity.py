"""Comparisons that say what differs: "got X, should be Y [call]", with error metrics.

Exact comparisons are for data movement (placements, chunks), where any difference is a bug.
``assert_close`` is for arithmetic done in a different order (sharded training against one
device); every caller states its tolerances and why they are not zero. A comparison kept
for the report (``record_as``) is kept whole: its errors, the tolerances it was held to and
the verdict they gave (``Comparison``), so the report shows the criterion each was held to.

``[call]`` is the reproduction of the example being checked, attached once per example
(``attach(case.call())`` right after drawing the case) rather than passed to every
comparison; the plugin clears it at the start of every example and of every test.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
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
    with np.errstate(invalid="ignore", over="ignore"):
        # The same value on both sides (NaN and inf included) is no error; any other
        # difference involving a non-finite value is an infinite one.
        same = (a == e) | (np.isnan(a) & np.isnan(e))
        diff = np.where(same, 0.0, np.abs(a - e))
        diff = np.where(np.isnan(diff), np.inf, diff)
        scale = np.abs(e)
        finite = np.isfinite(scale) & (scale > 0)
        rel = np.divide(diff, scale, out=np.where(diff > 0, np.inf, 0.0), where=finite)
        # One ulp of ``dtype`` at the magnitude of the expected value (2**exponent * eps).
        exponent = np.floor(np.log2(np.maximum(scale, np.finfo(np.float64).tiny)))
        ulp = np.power(2.0, exponent) * _EPS.get(dtype, _EPS["float32"])
        ulps = np.divide(diff, ulp, out=np.where(diff > 0, np.inf, 0.0), where=np.isfinite(ulp))
    return ErrorMetrics(float(diff.max()), float(rel.max()), float(ulps.max()))


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


@dataclass(frozen=True)
class Float32Multiple:
    """What an ``atol`` is built on: ``multiple`` times ``error``, the largest error one
    device's own float32 run makes against the exact answer; the caller may add more on top
    (a floor, an allowance carried over from another tensor)."""

    multiple: float
    error: float

    def check(self, atol: float) -> None:
        """Refuse an ``atol`` below the multiple it says it is built on."""
        require(
            math.isfinite(self.multiple) and self.multiple > 0,
            "atol_from.multiple",
            self.multiple,
            "finite and > 0",
        )
        require(
            math.isfinite(self.error) and self.error >= 0,
            "atol_from.error",
            self.error,
            "finite and >= 0",
        )
        built_on = self.multiple * self.error
        require(atol >= built_on, "atol", atol, f">= {self.multiple:g} x {self.error:g}")


@dataclass(frozen=True)
class Verdict:
    """What the criterion ``|actual - expected| <= atol + rtol * |expected|`` (elementwise)
    gave one comparison: ``outside`` of ``elements`` elements failed it (0: within), the
    worst element used ``allowance_used`` times what it allowed (0/0 is 0, x/0 is inf);
    ``float32``: what ``atol`` was built on, when it was a multiple of one device's error."""

    allowance_used: float
    outside: int
    elements: int
    float32: Float32Multiple | None = None

    @property
    def within(self) -> bool:
        return self.outside == 0

    def as_record(self) -> dict[str, float]:
        fields = {
            "allowance_used": self.allowance_used,
            "outside": self.outside,
            "elements": self.elements,
        }
        if self.float32 is not None:
            fields |= {
                "float32_multiple": self.float32.multiple,
                "float32_error": self.float32.error,
            }
        return fields

    @classmethod
    def read(cls, fields: Mapping[str, Any]) -> Verdict | None:
        """The verdict a record's comparison carries; None where it carries none (written
        before comparisons recorded their verdict) or a damaged one."""
        used = _number(fields.get("allowance_used"))
        outside, elements = _count(fields.get("outside")), _count(fields.get("elements"))
        if used is None or outside is None or elements is None:
            return None
        multiple, error = (
            _number(fields.get("float32_multiple")),
            _number(fields.get("float32_error")),
        )
        float32 = None if multiple is None or error is None else Float32Multiple(multiple, error)
        return cls(used, outside, elements, float32)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not (math.isfinite(value) and value >= 0 and value == int(value)):
        return None
    return int(value)


@dataclass(frozen=True)
class Comparison:
    """One ``assert_close``: its error metrics, the tolerances it was held to and the
    verdict they gave, whole: the figures of one comparison belong together."""

    metrics: ErrorMetrics
    rtol: float
    atol: float
    verdict: Verdict

    def as_record(self) -> dict[str, float]:
        return {
            **self.metrics.as_dict(),
            "rtol": self.rtol,
            "atol": self.atol,
            **self.verdict.as_record(),
        }

    def severity(self) -> tuple[bool, float, float, float]:
        """Orders comparisons worst last: outside first, then how much of its allowance the
        worst element used, then the raw errors."""
        m = self.metrics
        return (not self.verdict.within, self.verdict.allowance_used, m.max_rel, m.max_abs)


def _allowance_used(diff: np.ndarray, allowed: np.ndarray) -> float:
    if diff.size == 0:
        return 0.0
    ratio = np.divide(diff, allowed, out=np.where(diff > 0, np.inf, 0.0), where=allowed > 0)
    return float(ratio.max())


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
    atol_from: Float32Multiple | None = None,
) -> ErrorMetrics:
    """``|actual - expected| <= atol + rtol * |expected|`` elementwise; returns the metrics.

    ``why`` says why the tolerance is not zero; it is part of the failure message.
    ``record_as`` keeps the comparison for the report under that name (see ``record``).
    ``atol_from`` says what ``atol`` was built on, for the report; ``atol`` must be at
    least that multiple.
    """
    __tracebackhide__ = True
    for name, tolerance in (("rtol", rtol), ("atol", atol)):
        require(math.isfinite(tolerance) and tolerance >= 0, name, tolerance, "finite and >= 0")
    if atol_from is not None:
        atol_from.check(atol)
    assert_equal_values(tuple(actual.shape), tuple(expected.shape), what=f"shape of {what}")
    metrics = error_metrics(actual, expected, dtype)
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    # NaN is outside (any comparison with it is False) and an inf is held to nothing but
    # itself, except where both sides hold the same non-finite value: one device's, reproduced.
    with np.errstate(invalid="ignore"):
        diff, allowed = np.abs(a - e), atol + rtol * np.abs(e)
        same = (a == e) | (np.isnan(a) & np.isnan(e))
        bad = ~same & (~np.isfinite(a) | ~np.isfinite(e) | ~(diff <= allowed))
    if record_as is not None:
        verdict = Verdict(_allowance_used(diff, allowed), int(bad.sum()), int(a.size), atol_from)
        record(record_as, Comparison(metrics, rtol, atol, verdict))
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
    """Comparisons recorded during one test: the worst per name, kept whole."""

    comparisons: dict[str, Comparison] = field(default_factory=dict)
    references: list[str] = field(default_factory=list)
    """Which single-device implementation each comparison was made against."""
    exercised: dict[str, int] = field(default_factory=dict)
    """How many examples exercised each label a test names (``exercise``)."""

    def add(self, name: str, comparison: Comparison) -> None:
        """Keep ``comparison`` when it is the worst under ``name`` so far (``severity``): its
        errors, tolerances and verdict together, never one example's error with another's
        tolerance."""
        held = self.comparisons.get(name)
        if held is None or comparison.severity() > held.severity():
            self.comparisons[name] = comparison

    @property
    def metrics(self) -> dict[str, dict[str, float]]:
        """Per name, the worst comparison's record: what the test's results record keeps."""
        return {name: comparison.as_record() for name, comparison in self.comparisons.items()}


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


def exercise(label: str) -> None:
    """Count one example's use of ``label`` (an op and the placements it met, say) in the
    test's record, for the report's coverage of what the examples reached; a no-op outside
    ``collecting``."""
    if _active is not None:
        _active.exercised[label] = _active.exercised.get(label, 0) + 1


def record(name: str, comparison: Comparison) -> None:
    """Keep ``comparison`` for the report under ``name`` (the worst per name and test); a
    no-op outside ``collecting``."""
    if _active is not None:
        _active.add(name, comparison)
