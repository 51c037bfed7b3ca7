"""Failure-injection soak: one World per runner takes thousands of calls, every tenth failing.

The failing calls cycle through the failures a session meets: an exception on one rank, a
rank that overruns a short deadline (``HANG_DEADLINE``), a rank process that dies (process
runner only), and ranks that issue mismatched collectives (a different collective, or a
different shape; the process World checks collectives strictly, the thread World always
does). The failing rank cycles through every rank. The other calls all-reduce a rank-valued
tensor and return it.

Figures, per runner: every failing call must come back as a ``RankFailure`` of the injected
kind naming the injected rank (``misattributed`` otherwise), every passing call must return
the right value on every rank (``wrong values``), and no call may come back as anything else
(``lost``); the RSS of the driver (and of the rank processes) from the end of the first 10%
of calls to the end; the median time of the passing calls in the last 10% against the first
10% (the call after a failure, which also rebuilds the ranks, is one passing call in nine).
``main`` returns 1 when a call was lost, misattributed or wrong, never because of a time.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from harness.errors import DistconfError, check_int, check_one_of, require
from harness.runners import RankFailure, World, make_world
from harness.torchkit.context import RankContext

FAIL_EVERY = 10
HANG_DEADLINE = 0.5
"""Seconds a call that injects a hang may take (``world.run(..., timeout=)``)."""
HANG_SECONDS = 30.0
"""How long the hanging rank spins if nothing stops it."""
CRASH_CODE = 17
KINDS: dict[str, tuple[str, ...]] = {
    "threads": ("exception", "hang", "mismatch"),
    "processes": ("exception", "hang", "crash", "mismatch"),
}
RSS_TARGET_MB = 50.0
SLOWDOWN_TARGET = 1.2

SOAK_RUNNERS = ("threads", "processes")
"""The runners ``soak`` serves (torchrun's ranks cannot be killed and respawned by it)."""


# --- rank side -------------------------------------------------------------------------


class InjectedError(Exception):
    """What the failing rank of an ``exception`` call raises."""


def _scale(call: int) -> float:
    return float(call % 97 + 1)


def expected_sum(world_size: int, call: int) -> float:
    """The all-reduced value of call ``call``: every rank contributes (rank + 1) * scale."""
    return _scale(call) * world_size * (world_size + 1) / 2


def _all_reduced(ctx: RankContext, call: int) -> float:
    tensor = torch.tensor([(ctx.rank + 1) * _scale(call)])
    dist.all_reduce(tensor)
    return float(tensor.item())


def passing(ctx: RankContext, call: int) -> tuple[int, int, float, int]:
    """(call, rank, the all-reduced value, this rank's process id)."""
    return call, ctx.rank, _all_reduced(ctx, call), os.getpid()


def raising(ctx: RankContext, call: int, rank: int) -> None:
    if ctx.rank == rank:
        raise InjectedError(f"injected [call {call}]")
    _all_reduced(ctx, call)


def hanging(ctx: RankContext, call: int, rank: int) -> None:
    if ctx.rank == rank:
        # Python-level spinning: a rank thread is unwound at its next instruction.
        until = time.monotonic() + HANG_SECONDS
        while time.monotonic() < until:
            time.sleep(0.005)
    _all_reduced(ctx, call)


def crashing(ctx: RankContext, call: int, rank: int) -> None:
    if ctx.rank == rank:
        os._exit(CRASH_CODE)
    _all_reduced(ctx, call)


def mismatched(ctx: RankContext, call: int, rank: int) -> None:
    """Rank ``rank`` issues a different collective (even failures) or shape (odd ones)."""
    if ctx.rank != rank:
        dist.all_reduce(torch.ones(1))
    elif (call // FAIL_EVERY) % 2:
        dist.all_reduce(torch.ones(2))
    else:
        dist.broadcast(torch.ones(1), src=0)


_INJECTORS: dict[str, tuple[Callable[..., None], float | None]] = {
    "exception": (raising, None),
    "hang": (hanging, HANG_DEADLINE),
    "crash": (crashing, None),
    "mismatch": (mismatched, None),
}


# --- how a failure was reported --------------------------------------------------------


def observed_kind(failure: RankFailure) -> str:
    """The kind of failure ``failure`` reports (``other`` when none of the injected ones)."""
    primary = failure.primary
    if failure.timed_out and primary.status == "timeout":
        return "hang"
    if any(o.status == "crashed" for o in failure.outcomes):
        return "crash"
    if "mismatch" in primary.summary.lower():
        return "mismatch"
    if any(InjectedError.__name__ in o.summary for o in failure.outcomes):
        return "exception"
    return "other"


def names_rank(failure: RankFailure, kind: str, rank: int, call: int) -> bool:
    """Whether ``failure`` puts the injected failure of call ``call`` on ``rank``: the primary
    rank, or, for a mismatch (every rank fails), the rank its message sets apart."""
    primary = failure.primary
    if kind == "mismatch":
        # The thread runner's message and gloo's (TORCH_DISTRIBUTED_DEBUG=DETAIL) one.
        pattern = rf"ranks \[{rank}\] called|Rank {rank} is running"
        return re.search(pattern, primary.summary) is not None
    if primary.rank != rank:
        return False
    if kind == "exception":
        return f"[call {call}]" in primary.summary
    if kind == "crash":
        return f"code {CRASH_CODE}" in primary.summary
    return True


# --- the soak --------------------------------------------------------------------------


@dataclass
class SoakFigures:
    """The figures of one runner's soak."""

    runner: str
    world_size: int
    calls: int = 0
    injected: Counter[str] = field(default_factory=Counter)
    observed: Counter[str] = field(default_factory=Counter)
    right: Counter[str] = field(default_factory=Counter)
    kind_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds spent in the failing calls of each kind and in the call after each."""
    lost: int = 0
    wrong_values: int = 0
    examples: list[str] = field(default_factory=list)
    passing_seconds: dict[int, float] = field(default_factory=dict)
    rss_mb: list[float] = field(default_factory=list)
    """[after the first 10% of calls, at the end]."""
    seconds: float = 0.0
    hooks_kept: bool = True
    threads_before: int = 0
    threads_after: int = 0

    @property
    def misattributed(self) -> int:
        return sum(self.injected.values()) - sum(self.right.values())

    @property
    def clean(self) -> bool:
        return not (self.lost or self.wrong_values or self.misattributed)

    def note(self, text: str) -> None:
        if len(self.examples) < 8:
            self.examples.append(text)

    def median_ms(self, last: bool) -> float | None:
        window = max(1, self.calls // 10)
        start, stop = (self.calls - window, self.calls) if last else (0, window)
        times = [s for call, s in self.passing_seconds.items() if start <= call < stop]
        return 1000 * statistics.median(times) if times else None

    def as_dict(self) -> dict[str, Any]:
        first, last = self.median_ms(last=False), self.median_ms(last=True)
        return {
            "runner": self.runner,
            "world_size": self.world_size,
            "calls": self.calls,
            "kinds": {
                kind: {
                    "injected": self.injected[kind],
                    "observed": self.observed[kind],
                    "right": self.right[kind],
                    "seconds": self.kind_seconds.get(kind, 0.0),
                }
                for kind in sorted(set(self.injected) | set(self.observed))
            },
            "misattributed": self.misattributed,
            "lost": self.lost,
            "wrong_values": self.wrong_values,
            "examples": self.examples,
            "rss_mb": self.rss_mb,
            "rss_growth_mb": self.rss_mb[-1] - self.rss_mb[0] if self.rss_mb else None,
            "median_ms_first": first,
            "median_ms_last": last,
            "slowdown": last / first if first and last else None,
            "seconds": self.seconds,
            "hooks_kept": self.hooks_kept,
            "threads_before": self.threads_before,
            "threads_after": self.threads_after,
        }


def _driver_hooks() -> tuple[Any, ...]:
    return sys.excepthook, threading.excepthook, sys.unraisablehook


def rss_mb(pid: int | str = "self") -> float:
    """VmRSS of process ``pid`` in MB (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _rss_with_ranks(rank_pids: set[int]) -> float:
    """The driver's RSS plus that of every rank process (thread ranks are the driver)."""
    return rss_mb() + sum(rss_mb(pid) for pid in rank_pids - {os.getpid()})


def _passing_call(world: World, figures: SoakFigures, call: int) -> set[int]:
    """One passing call; the rank processes' ids (empty when it failed)."""
    started = time.perf_counter()
    try:
        values = world.run(passing, call)
    except DistconfError as exc:
        figures.lost += 1
        figures.note(f"call {call}: a passing call raised {type(exc).__name__}: {exc}"[:500])
        return set()
    figures.passing_seconds[call] = time.perf_counter() - started
    size = figures.world_size
    expected = [(call, rank, expected_sum(size, call)) for rank in range(size)]
    got = [tuple(value[:3]) for value in values]
    if got != expected:
        figures.wrong_values += 1
        figures.note(f"call {call}: returned {got}, should be {expected}")
    return {value[3] for value in values}


def _failing_call(world: World, figures: SoakFigures, call: int, kind: str, rank: int) -> None:
    fn, timeout = _INJECTORS[kind]
    figures.injected[kind] += 1
    started = time.perf_counter()
    try:
        world.run(fn, call, rank, timeout=timeout)
    except RankFailure as failure:
        observed = observed_kind(failure)
        figures.observed[observed] += 1
        if observed == kind and names_rank(failure, kind, rank, call):
            figures.right[kind] += 1
        else:
            head = failure.describe().splitlines()[0]
            injected = f"call {call}: injected {kind} on rank {rank}"
            figures.note(f"{injected}, reported {observed}: {head}")
    except DistconfError as exc:
        figures.lost += 1
        figures.note(f"call {call}: injected {kind}, raised {type(exc).__name__}: {exc}"[:500])
    else:
        figures.lost += 1
        figures.note(f"call {call}: injected {kind} on rank {rank}, but the call succeeded")
    finally:
        _add_seconds(figures, kind, time.perf_counter() - started)


def _add_seconds(figures: SoakFigures, kind: str, seconds: float) -> None:
    figures.kind_seconds[kind] = figures.kind_seconds.get(kind, 0.0) + seconds


def _injection(runner: str, call: int, world_size: int) -> tuple[str, int] | None:
    """(kind, rank) for a failing call, None for a passing one."""
    if call % FAIL_EVERY != FAIL_EVERY - 1:
        return None
    kinds = KINDS[runner]
    failure = call // FAIL_EVERY
    return kinds[failure % len(kinds)], (failure // len(kinds)) % world_size


def soak(runner: str, world_size: int, calls: int) -> SoakFigures:
    """Run the soak on a new World of ``runner`` (see the module docstring)."""
    result = SoakFigures(runner, world_size)
    hooks, result.threads_before = _driver_hooks(), threading.active_count()
    started = time.perf_counter()
    world = make_world(runner, world_size, strict_collectives=runner == "processes")
    try:
        world.start()
        _make_calls(world, result, calls)
    finally:
        world.close()
    result.seconds = time.perf_counter() - started
    result.hooks_kept = _driver_hooks() == hooks
    result.threads_after = threading.active_count()
    return result


def _make_calls(world: World, result: SoakFigures, calls: int) -> None:
    after: str | None = None  # the kind of the failing call just made
    for call in range(calls):
        result.calls += 1
        injection = _injection(world.runner, call, world.world_size)
        if injection is not None:
            _failing_call(world, result, call, *injection)
            after = injection[0]
            continue
        pids = _passing_call(world, result, call)
        if after is not None:  # the call after a failure pays for the rebuild
            _add_seconds(result, after, result.passing_seconds.get(call, 0.0))
            after = None
        if pids and call >= calls // 10 - 1:  # past the first 10% of calls
            _record_rss(result, pids)


def _record_rss(result: SoakFigures, pids: set[int]) -> None:
    """Keep the first RSS past the 10% mark, and the latest."""
    rss = _rss_with_ranks(pids)
    result.rss_mb = [result.rss_mb[0] if result.rss_mb else rss, rss]


# --- printing --------------------------------------------------------------------------


def _print(result: SoakFigures) -> None:
    figures = result.as_dict()
    failing = sum(result.injected.values())
    print(
        f"\nsoak: {result.runner}, world size {result.world_size}, {result.calls} calls "
        f"({failing} failing, every {FAIL_EVERY}th), {result.seconds:.1f} s"
    )
    print(f"{'kind':<12}{'injected':>10}{'observed':>10}{'right rank':>12}{'seconds':>10}")
    for kind, row in figures["kinds"].items():
        print(
            f"{kind:<12}{row['injected']:>10}{row['observed']:>10}{row['right']:>12}"
            f"{row['seconds']:>10.1f}"
        )
    print(
        f"misattributed {result.misattributed}, lost {result.lost}, "
        f"wrong values {result.wrong_values}"
    )
    for example in result.examples:
        print(f"  {example}")
    who = "driver" if result.runner == "threads" else "driver + rank processes"
    if result.rss_mb:
        start, end = result.rss_mb
        print(
            f"RSS ({who}): {start:.1f} MB after the first 10%, {end:.1f} MB at the end, "
            f"growth {end - start:+.1f} MB (target < {RSS_TARGET_MB:g} MB)"
        )
    first, last, ratio = figures["median_ms_first"], figures["median_ms_last"], figures["slowdown"]
    if ratio is not None:
        print(
            f"passing calls, median: {first:.2f} ms in the first 10%, {last:.2f} ms in the "
            f"last 10%, ratio {ratio:.2f}x (target <= {SLOWDOWN_TARGET:g}x)"
        )
    print(
        f"driver hooks kept: {'yes' if result.hooks_kept else 'NO'}; driver threads "
        f"{result.threads_before} before, {result.threads_after} after close"
    )


def main(calls: int, world_size: int, runners: tuple[str, ...], as_json: bool) -> int:
    """Soak each of ``runners`` in turn; 1 when a call was lost, misattributed or wrong."""
    check_int("calls", calls, minimum=FAIL_EVERY)
    check_int("world_size", world_size, minimum=2)
    require(bool(runners), "runners", runners, f"a non-empty tuple of {SOAK_RUNNERS}")
    for runner in runners:
        check_one_of("runner", runner, SOAK_RUNNERS)
    results = []
    for runner in runners:
        result = soak(runner, world_size, calls)
        _print(result)
        results.append(result)
    if as_json:
        print(json.dumps({"soak": [result.as_dict() for result in results]}))
    return 0 if all(result.clean for result in results) else 1
