"""A known deviation must be the failure that happened: a test its expectation marks xfail
(or flaky) that fails in another way is a failure, "a different failure in a spec with a
known deviation", not an expected one (pytest's ``xfail(raises=...)`` tells failures apart
by class only, which let a second bug in the same spec pass as the known one)."""

from __future__ import annotations

import pytest

from harness.outcome import expectations
from harness.plugin import state

DIFFERENT = "a different failure in a spec with a known deviation"


def check_known(
    item: pytest.Item,
    report: pytest.TestReport,
    excinfo: pytest.ExceptionInfo[BaseException] | None,
) -> None:
    """Turn ``report`` into a failure when it is an expected failure whose exception the
    test's expectation does not recognise (its fingerprint is not in the failure's text)."""
    entry = state.of(item).expectation_entry
    if entry is None or excinfo is None or not hasattr(report, "wasxfail"):
        return
    text = expectations.failure_text(excinfo.value)
    if entry.recognises(text):
        return
    del report.wasxfail
    report.outcome = "failed"
    pattern = entry.fingerprint.pattern if entry.fingerprint else None
    why = (
        f"{DIFFERENT}: {entry.source} ({entry.spec}) expects a failure matching {pattern!r}; "
        "this one is not it"
    )
    state.of(item).different_failure = why
    report.sections.append(("distconf: known deviation", why))
