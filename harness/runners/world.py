"""The call logic every runner shares: a World that keeps one set of ranks across calls.

``PersistentWorld.run`` is written once: the deadline, the lock, ready ranks, the call, an
interrupt, the book-keeping after a failed call, the short deadline after a hang, and the
verdict (``settle``). A runner supplies its ranks (a ``Ranks``: a thread generation, a
process pool) and decides what a call or health check that did not succeed costs them:
dropping them (the next call starts new ones), or ``_repair`` before the next call or health
check. An interrupt (Ctrl-C) during a repair, a call or a health check drops the ranks before
it propagates; one while ranks start is the runner's ``_start_ranks`` to clean up.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from harness.runners.base import RankOutcome, call_limit, settle

T = TypeVar("T")


class Ranks(Protocol):
    """One started set of ranks that serves calls until it is stopped or killed."""

    def call(self, payload: Any, deadline: float) -> tuple[list[RankOutcome], bool]:
        """Every rank's outcome of one call, and whether the deadline expired."""
        ...

    def healthy(self) -> bool:
        """A barrier on every rank with a short deadline; True when every rank passed."""
        ...

    def stop(self) -> None:
        """Let the ranks leave (the World is closed)."""
        ...

    def kill(self) -> None:
        """Drop the ranks now (an interrupted call, or ranks that cannot take another)."""
        ...


RanksT = TypeVar("RanksT", bound=Ranks)


class PersistentWorld(ABC, Generic[RanksT]):
    """A ``World`` whose ranks start at the first call (or ``start``) and serve every call
    until a failed call, a failed health check or ``close`` costs them."""

    runner: str
    lacks: frozenset[str] = frozenset()

    def __init__(self, world_size: int, device: str, *, timeout: float) -> None:
        self.world_size, self.device, self.timeout = world_size, device, timeout
        self.calls = 0
        self.generations = 0
        self._ranks: RanksT | None = None
        self._hung = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size}, device={self.device!r})"

    def run(self, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> list[T]:
        """Run ``fn(ctx, *args)`` on every rank; the values in rank order, or ``RankFailure``."""
        limit = call_limit(self.timeout, timeout, after_hang=self._hung)
        self._refuse_caller("run")
        payload = self._prepare(fn, args)
        with self._lock:
            try:
                ranks = self._ready()
                self.calls += 1
                outcomes, timed_out = ranks.call(payload, time.monotonic() + limit)
            except BaseException:
                self._discard()  # interrupted (Ctrl-C): never leave ranks mid-call or mid-repair
                raise
            if any(o.status != "ok" for o in outcomes):
                self._after_failure(outcomes, timed_out)
            shortened, self._hung = self._hung, self._hung or timed_out
        return settle(
            outcomes,
            runner=self.runner,
            device=self.device,
            deadline=limit if timed_out else None,
            shortened=shortened,
        )

    def start(self) -> None:
        self._refuse_caller("start")
        with self._lock:
            self._ready()

    def check_health(self) -> bool:
        """A barrier with a short deadline; ranks that fail it are dropped (the next call
        starts new ones). Lifts the short deadline that follows a hang. True if healthy."""
        self._refuse_caller("check_health")
        with self._lock:
            self._hung = False
            if self._ranks is None:
                return True
            try:
                self._repair()
                ranks = self._ranks
                healthy = ranks is not None and ranks.healthy()
            except BaseException:
                self._discard()  # interrupted (Ctrl-C): never leave ranks mid-barrier
                raise
            if not healthy:
                self._after_unhealthy()
            return healthy

    def close(self) -> None:
        self._refuse_caller("close")
        with self._lock:
            ranks, self._ranks = self._ranks, None
            if ranks is not None:
                ranks.stop()

    # --- what a runner decides ---------------------------------------------------------

    def _refuse_caller(self, method: str) -> None:
        """Raise when the calling thread must not use this World (it would wait on itself)."""

    def _prepare(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """What ``Ranks.call`` is given for ``fn(ctx, *args)``; raises, before any rank is
        started or counted, for a call that cannot be made."""
        return fn, args

    @abstractmethod
    def _start_ranks(self) -> RanksT:
        """Started ranks; raises ``WorldStartError`` when they cannot start."""

    @abstractmethod
    def _after_failure(self, outcomes: list[RankOutcome], timed_out: bool) -> None:
        """Make the ranks fit for the next call after one that did not succeed everywhere."""

    def _after_unhealthy(self) -> None:
        """After a failed health check: drop the ranks (the next call starts new ones)."""
        self._discard()

    def _repair(self) -> None:
        """Before a call or health check: mend ranks a failure left unfit, or drop them."""

    # --- the ranks ---------------------------------------------------------------------

    def _ready(self) -> RanksT:
        """The ranks, repaired, or started when there are none; called with the lock held."""
        self._repair()
        if self._ranks is None:
            self._ranks = self._start_ranks()
            self.generations += 1
        return self._ranks

    def _discard(self) -> None:
        ranks, self._ranks = self._ranks, None
        if ranks is not None:
            ranks.kill()
