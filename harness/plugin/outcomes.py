"""Turn pytest's per-phase reports of one test into the fields of a results record."""

from __future__ import annotations

from typing import Any

import pytest

from harness.errors import WorldStartError
from harness.runners.base import RankFailure

_Phase = tuple[pytest.TestReport, "pytest.ExceptionInfo[BaseException] | None"]


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _falsifying_example(exc: BaseException) -> str | None:
    notes = [n for leaf in [exc, *_leaves(exc)] for n in getattr(leaf, "__notes__", [])]
    return "\n".join(dict.fromkeys(notes)) or None


def _failure_fields(report: pytest.TestReport, exc: BaseException | None) -> dict[str, Any]:
    fields: dict[str, Any] = {"traceback": report.longreprtext or None}
    if exc is None:
        return fields
    fields["falsifying_example"] = _falsifying_example(exc)
    if any(isinstance(e, WorldStartError) for e in _leaves(exc)):
        return {**fields, "status": "error", "error": f"{type(exc).__name__}: {exc}"}
    failure = next((e for e in _leaves(exc) if isinstance(e, RankFailure)), None)
    if failure is None:
        fields["error"] = f"{type(exc).__name__}: {exc}"
        return fields
    fields["error"] = failure.describe()
    fields["primary_rank"] = failure.primary.rank
    fields["rank_statuses"] = failure.statuses
    if failure.timed_out:
        fields["status"] = "timeout"
    elif failure.primary.status == "crashed":
        fields["status"] = "crashed"
    return fields


def _is_strict_xpass(report: pytest.TestReport) -> bool:
    return isinstance(report.longrepr, str) and report.longrepr.startswith("[XPASS(strict)]")


def _is_test_timeout(exc: BaseException | None) -> bool:
    """pytest-timeout's own expiry (the backstop above the rank deadlines)."""
    return exc is not None and str(exc).startswith("Timeout (>")


def describe_outcome(phases: dict[str, _Phase]) -> dict[str, Any]:
    """``status`` and the details that explain it, from the setup/call/teardown reports."""
    for when in ("setup", "call", "teardown"):
        if when not in phases:
            continue
        report, excinfo = phases[when]
        exc = excinfo.value if excinfo is not None else None
        xfail = getattr(report, "wasxfail", None)
        if report.skipped and xfail is not None:
            # Keep what failed: an expected deviation should be seen to be the expected one.
            details = _failure_fields(report, exc) if exc is not None else {}
            return {**details, "status": "xfailed", "skip_reason": xfail or None}
        if report.skipped:
            return {"status": "skipped", "skip_reason": _skip_reason(report)}
        if report.failed and _is_strict_xpass(report):
            return {"status": "xpassed", "error": str(report.longrepr)}
        if report.failed:
            details = _failure_fields(report, exc)
            status = "failed" if when == "call" else "error"
            if _is_test_timeout(exc):
                status = "timeout"
            return {"status": status, **details}
        if when == "call" and xfail is not None:
            return {"status": "xpassed", "skip_reason": xfail or None}
    return {"status": "passed"}
