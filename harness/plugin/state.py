"""What the plugin keeps per test: one record of state on the item, under one stash key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from harness.outcome.expectations import Expectation
from harness.parity import ParityLog


@dataclass
class TestState:
    """Everything the plugin learns about one test between collection and its record."""

    __test__ = False  # not a pytest test class, whatever its name

    expectation: dict[str, Any] | None = None
    """The known deviation (``specs/expectations``) that matched it at collection."""
    expectation_entry: Expectation | None = None
    """The same, as loaded: its fingerprint is checked against the test's failure."""
    different_failure: str | None = None
    """Why a failure is not the known deviation (``deviations.check_known``)."""
    phases: dict[str, Any] = field(default_factory=dict)
    """``when`` -> (report, excinfo) of its setup, call and teardown."""
    examples: int | None = None
    """Hypothesis examples it ran (None: not a hypothesis test)."""
    first_failure: tuple[int, float] | None = None
    """Examples and seconds until its first failing example, before any shrinking."""
    parity: ParityLog | None = None
    """Its error metrics and references."""


_KEY = pytest.StashKey[TestState]()


def of(item: pytest.Item) -> TestState:
    """The item's state, made on first use."""
    if _KEY not in item.stash:
        item.stash[_KEY] = TestState()
    return item.stash[_KEY]
