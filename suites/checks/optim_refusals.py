"""Rank-side code of the specs where torch refuses an optimizer option."""

from __future__ import annotations

from harness import RankContext
from harness.cases.training import StepCase
from suites.checks.training import step_on_rank


def refused_step_on_rank(ctx: RankContext, case: StepCase) -> str | None:
    """``step_on_rank``'s steps; the error they raise as ``"Type: message"`` (None: none)."""
    try:
        step_on_rank(ctx, case)
    except (AssertionError, RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None
