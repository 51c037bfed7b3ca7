"""Comparison helpers say what differs and where; metrics are measured, not guessed."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from types import TracebackType

import numpy as np
import pytest

from harness import parity
from harness.errors import InvalidArgument


def test_equal_arrays_pass_and_nan_equals_nan() -> None:
    parity.assert_array_equal(np.array([1.0, np.nan]), np.array([1.0, np.nan]), what="x")


@pytest.mark.parametrize(
    ("actual", "expected"),
    [([np.nan], [1.0]), ([1.0], [np.nan]), ([np.inf], [1.0]), ([np.inf], [-np.inf])],
    ids=["nan-got", "nan-should", "inf-got", "opposite-infs"],
)
def test_assert_close_never_lets_a_non_finite_difference_through(
    actual: list[float], expected: list[float]
) -> None:
    # ``|nan - x| > tol`` is False: a NaN result used to pass any tolerance.
    with pytest.raises(AssertionError, match="1 of 1 elements outside"):
        parity.assert_close(
            np.array(actual),
            np.array(expected),
            rtol=1e-3,
            atol=1e-3,
            dtype="float32",
            what="x",
            why="reordered sums",
        )


def test_assert_close_accepts_the_same_non_finite_values_on_both_sides() -> None:
    same = np.array([np.nan, np.inf, -np.inf, 1.0])
    parity.assert_close(same, same.copy(), rtol=0, atol=0, dtype="float32", what="x", why="exact")


def test_shape_mismatch_names_both_shapes() -> None:
    with parity.collecting():
        parity.attach("call()")
        with pytest.raises(
            AssertionError,
            match=r"^shape of local: got \(2, 5\), should be \(1, 5\) \[call\(\)\]$",
        ):
            parity.assert_array_equal(np.zeros((2, 5)), np.zeros((1, 5)), what="local")


def test_value_mismatch_names_first_index_and_count() -> None:
    actual = np.array([[1.0, 2.0], [3.0, 9.0]])
    with pytest.raises(
        AssertionError, match=r"got 9.0 at index \(1, 1\), should be 4.0 \(1 of 4 elements differ\)"
    ):
        parity.assert_array_equal(actual, np.array([[1.0, 2.0], [3.0, 4.0]]), what="x")


def test_assert_close_reports_tolerance_reason_and_metrics() -> None:
    with pytest.raises(AssertionError, match="within atol=0 \\+ rtol=1e-06 \\(reordered sums\\)"):
        parity.assert_close(
            np.array([1.0, 2.001]),
            np.array([1.0, 2.0]),
            rtol=1e-6,
            atol=0,
            dtype="float64",
            what="w",
            why="reordered sums",
        )
    metrics = parity.assert_close(
        np.array([1.0, 2.0 + 2**-51]),
        np.array([1.0, 2.0]),
        rtol=1e-12,
        atol=0,
        dtype="float64",
        what="w",
        why="reordered sums",
    )
    assert metrics.max_abs == 2**-51
    assert metrics.max_ulp == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("rtol", "atol", "message"),
    [(-1, 0, "rtol=-1 must be"), (0, math.inf, "atol=inf must be"), (math.nan, 0, "rtol=nan")],
)
def test_assert_close_rejects_bad_tolerances(rtol: float, atol: float, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        parity.assert_close(
            np.zeros(1), np.zeros(1), rtol=rtol, atol=atol, dtype="float32", what="w", why=""
        )


def test_metrics_of_exact_and_empty_arrays_are_zero() -> None:
    assert parity.error_metrics(np.ones(3), np.ones(3), "float32").max_ulp == 0
    assert parity.error_metrics(np.zeros(0), np.zeros(0), "float32").max_abs == 0


def _close(
    actual: list[float], expected: list[float], *, rtol: float, atol: float, name: str = "grad"
) -> None:
    parity.assert_close(
        np.array(actual),
        np.array(expected),
        rtol=rtol,
        atol=atol,
        dtype="float64",
        what="w",
        why="r",
        record_as=name,
    )


def test_record_keeps_the_worst_comparison_per_name_whole() -> None:
    with parity.collecting() as log:
        # 1e-3 off at |b| = 1 under rtol 1e-2: a tenth of its allowance
        _close([1.001, 4.0], [1.0, 4.0], rtol=1e-2, atol=0.0)
        # less off, but 2e-4 against an allowance of 2.5e-4: the worst, kept whole (no
        # max_abs of the first with the rtol of this one)
        _close([0.0102, 4.0], [0.01, 4.0], rtol=1e-2, atol=1.5e-4)
        _close([1.0, 1.0], [1.0, 1.0], rtol=1e-9, atol=1e-12, name="step")
    assert log.metrics == {
        "grad": {
            "max_abs": pytest.approx(2e-4),
            "max_rel": pytest.approx(0.02),
            "max_ulp": pytest.approx(2e-4 / 2**-7 / 2**-52),
            "rtol": 1e-2,
            "atol": 1.5e-4,
            "allowance_used": pytest.approx(0.8),
            "outside": 0,
            "elements": 2,
        },
        "step": {
            "max_abs": 0.0,
            "max_rel": 0.0,
            "max_ulp": 0.0,
            "rtol": 1e-9,
            "atol": 1e-12,
            "allowance_used": 0.0,
            "outside": 0,
            "elements": 2,
        },
    }


def test_a_failed_comparison_is_recorded_with_its_verdict() -> None:
    with parity.collecting() as log:
        _close([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], rtol=1e-6, atol=0.0)
        with pytest.raises(AssertionError, match="2 of 3 elements outside"):
            _close([1.5, 2.0, 0.7], [1.0, 2.0, 0.5], rtol=1e-6, atol=0.1)
        _close([1.0], [1.0], rtol=1e-6, atol=0.0)
    grad = log.metrics["grad"]
    assert (grad["outside"], grad["elements"]) == (2, 3)
    assert grad["allowance_used"] == pytest.approx(0.5 / (0.1 + 1e-6))
    assert parity.Verdict.read(grad) == parity.Verdict(grad["allowance_used"], 2, 3)


def test_an_exact_criterion_that_fails_used_an_infinite_share() -> None:
    with parity.collecting() as log, pytest.raises(AssertionError):
        _close([1.0, 2.0], [1.0, 2.5], rtol=0.0, atol=0.0)
    assert log.metrics["grad"]["allowance_used"] == math.inf


def test_a_float32_multiple_is_recorded_with_what_atol_was_built_on() -> None:
    basis = parity.Float32Multiple(multiple=32.0, error=2.0**-20)
    with parity.collecting() as log:
        parity.assert_close(
            np.array([1.0 + 2.0**-16]),
            np.array([1.0]),
            rtol=0.0,
            atol=32 * 2.0**-20 + 1e-6,
            dtype="float32",
            what="w",
            why="r",
            record_as="out",
            atol_from=basis,
        )
    recorded = log.metrics["out"]
    assert (recorded["float32_multiple"], recorded["float32_error"]) == (32.0, 2.0**-20)
    assert parity.Verdict.read(recorded) == parity.Verdict(
        recorded["allowance_used"], 0, 1, float32=basis
    )


def test_an_atol_below_the_multiple_it_names_is_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"atol=0\.001 must be >= 32 x 0\.0001"):
        parity.assert_close(
            np.ones(1),
            np.ones(1),
            rtol=0.0,
            atol=1e-3,
            dtype="float32",
            what="w",
            why="r",
            atol_from=parity.Float32Multiple(32.0, 1e-4),
        )


@pytest.mark.parametrize(
    "fields",
    [
        {"max_abs": 0.0, "max_rel": 0.0, "rtol": 0.0, "atol": 0.0},  # written before verdicts
        {"allowance_used": "0.5", "outside": 0, "elements": 2},
        {"allowance_used": 0.5, "outside": -1, "elements": 2},
        {"allowance_used": 0.5, "outside": True, "elements": 2},
        {"allowance_used": 0.5, "outside": 0.5, "elements": 2},
    ],
)
def test_a_record_without_a_readable_verdict_reads_as_none(fields: dict[str, object]) -> None:
    assert parity.Verdict.read(fields) is None


def test_nothing_is_recorded_outside_collecting() -> None:
    _close([1.0], [1.0], rtol=0.0, atol=0.0)  # no log to keep it in: no error either


@pytest.fixture(autouse=True)
def _no_call_attached() -> Iterator[None]:
    """The reproduction is module state: no test sees another's."""
    parity.new_example()
    yield
    parity.new_example()


def _raised_by(check: Callable[[], object]) -> pytest.ExceptionInfo[AssertionError]:
    with pytest.raises(AssertionError) as raised:
        check()
    return raised


def _message_of(check: Callable[[], object]) -> str:
    return str(_raised_by(check).value)


def _unequal() -> None:
    parity.assert_equal_values(1, 2, what="x")


def _unequal_arrays() -> None:
    parity.assert_array_equal(np.ones(2), np.zeros(2), what="x")


def _far() -> None:
    parity.assert_close(
        np.array([2.0]), np.array([1.0]), rtol=0, atol=0, dtype="float64", what="x", why="r"
    )


CHECKS = [_unequal, _unequal_arrays, _far]


@pytest.mark.parametrize("check", CHECKS)
def test_every_failure_ends_with_the_attached_call(check: Callable[[], None]) -> None:
    parity.attach("f(x=1)")
    message = _message_of(check)
    assert message.startswith("x: got ") and message.endswith(" [f(x=1)]"), message


@pytest.mark.parametrize("check", CHECKS)
def test_no_attached_call_leaves_no_brackets(check: Callable[[], None]) -> None:
    message = _message_of(check)
    assert "[" not in message, message


def test_a_failure_of_a_check_of_its_own_carries_the_call() -> None:
    assert str(parity.failure("rank 0: got 1, should be 2")) == "rank 0: got 1, should be 2"
    parity.attach("f(x=1)")
    assert (
        str(parity.failure("rank 0: got 1, should be 2")) == "rank 0: got 1, should be 2 [f(x=1)]"
    )


def test_the_latest_attached_call_is_the_one_named() -> None:
    parity.attach("the whole case")
    parity.attach("one part of it")
    assert _message_of(_unequal) == "x: got 1, should be 2 [one part of it]"


def test_a_new_example_clears_the_attached_call() -> None:
    parity.attach("the first example")
    parity.new_example()
    assert _message_of(_unequal) == "x: got 1, should be 2"


def test_each_test_starts_with_no_call_attached() -> None:
    parity.attach("before the test")
    with parity.collecting():
        assert _message_of(_unequal) == "x: got 1, should be 2"
        parity.attach("inside the test")
        assert _message_of(_unequal) == "x: got 1, should be 2 [inside the test]"
    assert _message_of(_unequal) == "x: got 1, should be 2 [before the test]"


def test_attach_takes_text() -> None:
    with pytest.raises(InvalidArgument, match="call=3 must be a str"):
        parity.attach(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("check", CHECKS)
def test_helpers_hide_their_frames_from_tracebacks(check: Callable[[], None]) -> None:
    tb: TracebackType | None = _raised_by(check).tb
    frames = []
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == parity.__file__:
            frames.append(tb.tb_frame)
        tb = tb.tb_next
    assert frames, "the failure is raised inside harness.parity"
    assert all(frame.f_locals.get("__tracebackhide__") is True for frame in frames)
