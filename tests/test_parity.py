"""Comparison helpers say what differs and where; metrics are measured, not guessed."""

from __future__ import annotations

import numpy as np
import pytest

from harness import parity


def test_equal_arrays_pass_and_nan_equals_nan():
    parity.assert_array_equal(np.array([1.0, np.nan]), np.array([1.0, np.nan]), what="x")


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(
        AssertionError, match=r"shape of local: got \(2, 5\), should be \(1, 5\) \[call\(\)\]"
    ):
        parity.assert_array_equal(np.zeros((2, 5)), np.zeros((1, 5)), what="local", call="call()")


def test_value_mismatch_names_first_index_and_count():
    actual = np.array([[1.0, 2.0], [3.0, 9.0]])
    with pytest.raises(
        AssertionError, match=r"got 9.0 at index \(1, 1\), should be 4.0 \(1 of 4 elements differ\)"
    ):
        parity.assert_array_equal(actual, np.array([[1.0, 2.0], [3.0, 4.0]]), what="x")


def test_assert_close_reports_tolerance_reason_and_metrics():
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


def test_assert_close_rejects_bad_tolerances():
    with pytest.raises(ValueError, match="rtol=-1"):
        parity.assert_close(
            np.zeros(1), np.zeros(1), rtol=-1, atol=0, dtype="float32", what="w", why=""
        )


def test_metrics_of_exact_and_empty_arrays_are_zero():
    assert parity.error_metrics(np.ones(3), np.ones(3), "float32").max_ulp == 0
    assert parity.error_metrics(np.zeros(0), np.zeros(0), "float32").max_abs == 0


def test_record_keeps_the_worst_value_per_name():
    with parity.collecting() as log:
        parity.record("grad", parity.ErrorMetrics(1.0, 0.5, 2.0), rtol=1e-6, atol=0.0)
        parity.record("grad", parity.ErrorMetrics(0.5, 0.7, 1.0), rtol=1e-5, atol=0.0)
        parity.assert_close(
            np.ones(2),
            np.ones(2),
            rtol=1e-9,
            atol=1e-12,
            dtype="float64",
            what="w",
            why="r",
            record_as="step",
        )
    assert log.metrics == {
        "grad": {"max_abs": 1.0, "max_rel": 0.7, "max_ulp": 2.0, "rtol": 1e-5, "atol": 0.0},
        "step": {"max_abs": 0.0, "max_rel": 0.0, "max_ulp": 0.0, "rtol": 1e-9, "atol": 1e-12},
    }
    parity.record("ignored outside collecting", parity.ErrorMetrics(0, 0, 0), rtol=0, atol=0)
