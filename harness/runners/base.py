"""What every runner shares: rank outcomes, how a call's outcomes become a verdict, RankFailure.

A runner executes ``fn(ctx, *args)`` on every rank and hands one ``RankOutcome`` per rank to
``settle``, which returns the values when every rank succeeded and raises otherwise. Keeping
the verdict here means both runners agree on what a failure, a skip and a primary rank are.
"""

from __future__ import annotations

import traceback
import unittest
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias, TypeVar

import pytest

from harness.errors import DistconfError, check_seconds

RankStatus: TypeAlias = Literal["ok", "error", "waiting", "timeout", "skipped", "crashed"]
T = TypeVar("T")

DEFAULT_TIMEOUT = 60.0
"""Seconds one ``world.run`` call may take on every rank, unless the World is told otherwise
(``harness.config.RunConfig.rank_timeout`` defaults to it)."""

# After a call hung, later calls get at most this long until the next health check (the next
# test): hypothesis re-runs a hanging example while it shrinks, and each re-run would
# otherwise cost the full deadline.
AFTER_HANG_TIMEOUT = 5.0

# Which rank's story explains a failed call: a real error first (the others were only
# released because of it), then a dead process, a rank stuck outside any collective, a rank
# that skipped alone, and last a rank that was merely waiting for its peers.
_PRIMARY_ORDER: tuple[RankStatus, ...] = ("error", "crashed", "timeout", "skipped", "waiting")


@dataclass
class RankOutcome:
    """What one rank did in one call."""

    rank: int
    status: RankStatus
    value: Any = None
    summary: str = ""
    """One line: the exception, the skip reason, or where the rank was waiting."""
    traceback: str = ""
    """The traceback of an error, or the rank's Python stack when the deadline expired."""
    exception: BaseException | None = field(default=None, repr=False)


def error_outcome(
    rank: int, exc: BaseException, *, keep: bool = True, context: str = ""
) -> RankOutcome:
    """An ``error`` outcome for ``exc``; ``keep=False`` drops the exception object (it must
    cross a process boundary, and exceptions need not pickle)."""
    summary = f"{type(exc).__name__}: {exc}".strip()
    return RankOutcome(
        rank,
        "error",
        summary=f"{context}: {summary}" if context else summary,
        traceback="".join(traceback.format_exception(exc)),
        exception=exc if keep else None,
    )


def call_limit(default: float, requested: float | None, *, after_hang: bool) -> float:
    """The deadline of one call in seconds: ``requested`` or the World's default, validated,
    capped at ``AFTER_HANG_TIMEOUT`` once the World hung in the current test."""
    limit = check_seconds("timeout", default if requested is None else requested)
    return min(limit, AFTER_HANG_TIMEOUT) if after_hang else limit


def released_outcome(
    rank: int, exc: BaseException, is_release: Callable[[BaseException], bool]
) -> RankOutcome | None:
    """A ``waiting`` outcome when ``exc`` is, or was raised while handling, the release of a
    rank blocked on a failed peer (a ``finally`` that fails while unwinding must not make
    the released rank look like the culprit); None otherwise."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if is_release(current):
            also = "" if current is exc else f", then {type(exc).__name__}: {exc} while unwinding"
            return RankOutcome(
                rank,
                "waiting",
                summary=f"released: {current}{also}",
                traceback="".join(traceback.format_exception(exc)),
            )
        seen.add(id(current))
        current = current.__context__
    return None


RANK_PROCESS_RUNNERS = ("processes", "torchrun")
"""Runners whose ranks are processes with a real process-group backend: what a test marked
or a deviation keyed ``processes`` is about holds on torchrun's ranks too."""


def answers_to(runner: str, names: Collection[str]) -> bool:
    """Whether ``runner`` is one of ``names``, a torchrun World counting as ``processes``."""
    return runner in names or ("processes" in names and runner in RANK_PROCESS_RUNNERS)


def is_skip(exc: BaseException) -> bool:
    return isinstance(exc, pytest.skip.Exception | unittest.SkipTest)


def skip_reason(exc: BaseException) -> str:
    return str(getattr(exc, "msg", None) or exc)


def primary_rank(outcomes: Sequence[RankOutcome]) -> int | None:
    """The lowest rank with the most telling non-ok status, or None when all are ok; among
    ranks of that status, one that says what happened (a traceback or a story) before one
    that does not (a rank process torchrun stopped because another died says only that its
    connection closed)."""
    for status in _PRIMARY_ORDER:
        ranks = [o for o in outcomes if o.status == status]
        if ranks:
            return min(ranks, key=lambda o: (not o.traceback, o.rank)).rank
    return None


class AllRanksSkipped(pytest.skip.Exception):  # type: ignore[misc,name-defined]
    """Every rank skipped; ``reasons`` maps each rank to its own reason."""

    def __init__(self, reasons: dict[int, str]) -> None:
        distinct = sorted(set(reasons.values()))
        if len(distinct) == 1:
            message = f"all {len(reasons)} ranks skipped: {distinct[0]}"
        else:
            per_rank = "; ".join(f"rank {r}: {why}" for r, why in sorted(reasons.items()))
            message = f"all {len(reasons)} ranks skipped: {per_rank}"
        super().__init__(message, pytrace=False)
        self.reasons = reasons


class RankFailure(DistconfError):
    """A call failed on at least one rank; carries every rank's outcome.

    ``primary`` is the rank whose failure explains the call (``primary_rank``); ``outcomes``
    holds every rank's status with its traceback or stack.
    """

    def __init__(
        self,
        outcomes: Sequence[RankOutcome],
        *,
        runner: str,
        device: str,
        deadline: float | None = None,
        shortened: bool = False,
    ) -> None:
        self.outcomes = tuple(sorted(outcomes, key=lambda o: o.rank))
        self.shortened = shortened
        rank = primary_rank(self.outcomes)
        assert rank is not None, "RankFailure needs at least one rank that did not succeed"
        self.primary = self.outcomes[rank]
        self.runner, self.device, self.deadline = runner, device, deadline
        super().__init__(self.describe())

    @property
    def world_size(self) -> int:
        return len(self.outcomes)

    @property
    def statuses(self) -> dict[int, RankStatus]:
        return {o.rank: o.status for o in self.outcomes}

    @property
    def timed_out(self) -> bool:
        return self.deadline is not None

    def describe(self) -> str:
        where = f"[{self.runner}, {self.device}, world size {self.world_size}]"
        p = self.primary
        if self.timed_out:
            cut = " (shortened: this World already hung in this test)" if self.shortened else ""
            head = (
                f"deadline of {self.deadline:g} s{cut} expired {where}: rank {p.rank} "
                f"{'timed out outside any collective' if p.status == 'timeout' else p.status}"
            )
        else:
            head = f"rank {p.rank} of {self.world_size} {_VERB[p.status]} {where}: {p.summary}"
        lines = [head, *(f"  rank {o.rank}: {o.status}{_detail(o)}" for o in self.outcomes)]
        if self.timed_out:
            lines.append("Python stack of every rank at the deadline:")
            lines += [f"--- rank {o.rank} ({o.status}) ---\n{o.traceback}" for o in self.outcomes]
        elif p.exception is None and p.traceback:
            lines.append(f"traceback of rank {p.rank}:\n{p.traceback}")
        return "\n".join(lines)


_VERB: dict[RankStatus, str] = {
    "ok": "succeeded",
    "error": "failed",
    "crashed": "crashed",
    "timeout": "timed out",
    "skipped": "skipped alone",
    "waiting": "was left waiting",
}


def _detail(outcome: RankOutcome) -> str:
    return f" - {outcome.summary}" if outcome.summary and outcome.status != "ok" else ""


def settle(
    outcomes: Sequence[RankOutcome],
    *,
    runner: str,
    device: str,
    deadline: float | None = None,
    shortened: bool = False,
) -> list[Any]:
    """The per-rank values in rank order, or the exception that describes the call."""
    ordered = sorted(outcomes, key=lambda o: o.rank)
    if all(o.status == "ok" for o in ordered):
        return [o.value for o in ordered]
    if all(o.status == "skipped" for o in ordered):
        raise AllRanksSkipped({o.rank: o.summary for o in ordered})
    failure = RankFailure(
        ordered, runner=runner, device=device, deadline=deadline, shortened=shortened
    )
    raise failure from failure.primary.exception


class World(Protocol):
    """N ranks that run the same function; one per runner × world size × device."""

    runner: str
    world_size: int
    device: str
    lacks: frozenset[str]
    """Operations this runner cannot serve (``send``, ``reduce``, ...)."""

    def run(self, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> list[T]:
        """Run ``fn(ctx, *args)`` on every rank; return the values in rank order."""
        ...

    def start(self) -> None:
        """Start the ranks now (they otherwise start at the first call); raises
        ``WorldStartError`` when they cannot."""
        ...

    def check_health(self) -> bool:
        """A barrier with a short deadline; a failing World rebuilds itself. True if healthy.

        Call it between tests: it also lifts the short deadline that follows a hang."""
        ...

    def close(self) -> None: ...
