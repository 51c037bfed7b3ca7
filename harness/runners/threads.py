"""Thread runner: N persistent rank threads on torch's threaded process group, always: it
takes no ``--backend`` (``capacity.resolve_backend`` refuses one), and on an accelerator its
ranks share device 0.

One *generation* is a set of daemon rank threads that initialised the process group once
and then serve calls from their inboxes. A World keeps its generation across calls and
replaces it after any call that did not succeed on every rank: a rank that failed or was
released may have left per-thread state (process groups, meshes, dispatch modes) out of step
with its peers, and starting a generation costs milliseconds. A rank that overran its
deadline outside any collective gets ``RankAbandoned`` raised in it (a thread cannot be
killed, but one running Python code, an endless loop in a sharding rule say, unwinds at its
next instruction instead of spinning for the rest of the session); one stuck in C code is
left behind as a daemon thread. Its generation's Domain is separate from its successor's,
so it can never join their collectives.

``dist.init_process_group`` wraps ``sys.excepthook`` on every call (to prefix each line with
``[rankN]: ``), and each rank of each generation calls it: after a few hundred failed calls
the driver's own traceback would recurse through a thousand wrappers. A generation therefore
puts back the process-wide hooks it found once its ranks started, and again when it stops.
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from harness.errors import DistconfError, WorldStartError
from harness.runners import _threaded_pg
from harness.runners._hooks import ProcessHooks, hooks_lock
from harness.runners.base import (
    DEFAULT_TIMEOUT,
    RankOutcome,
    error_outcome,
    is_skip,
    released_outcome,
    skip_reason,
)
from harness.runners.world import PersistentWorld
from harness.torchkit import devices, internals
from harness.torchkit.context import RankContext

RUNNER = "threads"
_START_TIMEOUT = 60.0
_STOP = None
_STOP_GRACE = 5.0
_HEALTH_TIMEOUT = 10.0
_STUCK_LIMIT = 64
_ABANDONED_GRACE = 1.0
"""Seconds the last thread World to close waits for abandoned ranks still unwinding."""


class _Generation:
    def __init__(self, world_size: int, device: str, number: int) -> None:
        self.world_size, self.device = world_size, device
        self.domain = _threaded_pg.Domain(world_size)
        self.store = HashStore()
        self.inboxes: list[queue.SimpleQueue[Any]] = [
            queue.SimpleQueue() for _ in range(world_size)
        ]
        self.lock = threading.Lock()
        # The last rank to report a call puts its id here: the driver wakes once per call,
        # in C, instead of through a Condition's Python-level waiter locks.
        self.done: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.reports: dict[int, RankOutcome] = {}
        self.call_id = 0
        self.stuck: set[int] = set()
        self.hooks = ProcessHooks()
        self.threads = [
            threading.Thread(
                target=self._rank_main,
                args=(rank,),
                name=f"distconf-g{number}-rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]

    def start(self) -> None:
        with hooks_lock:
            self.hooks = ProcessHooks()
            try:
                for thread in self.threads:
                    thread.start()
                outcomes, _ = self.collect(time.monotonic() + _START_TIMEOUT)
            finally:
                self.hooks.restore()
        # DeviceMesh keys DTensor's caches by thread ident on this backend, and the OS hands
        # exited threads' idents to new ones: forget plans made for other ranks.
        internals.clear_dtensor_plan_caches()
        failed = [o for o in outcomes if o.status != "ok"]
        if failed:
            self.stop()
            detail = "\n".join(f"rank {o.rank}: {o.summary}\n{o.traceback}" for o in failed)
            raise WorldStartError(f"rank threads failed to start:\n{detail}")

    def call(
        self, payload: tuple[Callable[..., Any], tuple[Any, ...]], deadline: float
    ) -> tuple[list[RankOutcome], bool]:
        self.submit(*payload)
        return self.collect(deadline)

    def healthy(self) -> bool:
        outcomes, _ = self.call((_barrier, ()), time.monotonic() + _HEALTH_TIMEOUT)
        return all(o.status == "ok" for o in outcomes)

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        with self.lock:
            self.call_id += 1
            self.reports = {}
        for inbox in self.inboxes:
            inbox.put((self.call_id, fn, args))

    def collect(self, deadline: float) -> tuple[list[RankOutcome], bool]:
        """Every rank's outcome and whether the deadline expired.

        Ranks unreported at the deadline are classified from where they are: waiting in a
        collective, or stuck elsewhere (``timeout``), each with its Python stack.
        """
        self._await_reports(deadline)
        with self.lock:
            reported = dict(self.reports)
        missing = [r for r in range(self.world_size) if r not in reported]
        for rank in missing:
            reported[rank] = self._stuck_outcome(rank)
            if reported[rank].status == "timeout":
                self.stuck.add(rank)
                _interrupt(self.threads[rank])
        if missing:
            self.domain.abort("the call's deadline expired")
        return [reported[r] for r in range(self.world_size)], bool(missing)

    def stop(self, grace: float = _STOP_GRACE) -> None:
        """Ask every rank to leave; wait up to ``grace`` seconds for those that can, and
        keep the stuck ones on record (a thread cannot be killed, only left).

        Waiting matters at interpreter exit: a daemon thread still inside
        ``destroy_process_group`` when Python finalises aborts the process.
        """
        self.domain.abort("the World was closed")
        for inbox in self.inboxes:
            inbox.put(_STOP)
        deadline = time.monotonic() + grace
        for rank, thread in enumerate(self.threads):
            if rank not in self.stuck:
                thread.join(max(0.0, deadline - time.monotonic()))
        _abandoned.extend(self.threads[rank] for rank in self.stuck)
        with hooks_lock:  # a rank that was late to initialise wrapped them after start
            self.hooks.restore()

    def kill(self) -> None:
        """The same as ``stop``: a rank thread can only be asked to leave."""
        self.stop()

    def _stuck_outcome(self, rank: int) -> RankOutcome:
        frame = sys._current_frames().get(self.threads[rank].ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"
        where = self.domain.where(rank)
        if where is not None:
            return RankOutcome(rank, "waiting", summary=f"waiting in {where}", traceback=stack)
        return RankOutcome(rank, "timeout", summary="still running", traceback=stack)

    def _await_reports(self, deadline: float) -> None:
        """Until every rank reported the current call, or the deadline; a token a late
        rank left for an earlier call is passed over."""
        while (left := deadline - time.monotonic()) > 0:
            try:
                if self.done.get(timeout=left) == self.call_id:
                    return
            except queue.Empty:
                return

    def _report(self, call_id: int, outcome: RankOutcome) -> None:
        with self.lock:
            if call_id == self.call_id:
                self.reports[outcome.rank] = outcome
                if len(self.reports) == self.world_size:
                    self.done.put(call_id)

    def _rank_main(self, rank: int) -> None:
        _threaded_pg.bind_domain(self.domain)
        try:
            ctx = self._init_rank(rank)
        except BaseException as exc:
            self._report(0, error_outcome(rank, exc))
            return
        self._report(0, RankOutcome(rank, "ok"))
        try:
            while (message := self.inboxes[rank].get()) is not _STOP:
                call_id, fn, args = message
                self._report(call_id, self._execute(ctx, fn, args))
        except RankAbandoned:
            # Raised after the call it was meant for had returned (the deadline classified the
            # rank a moment before): the generation is retired, so the thread just leaves.
            # Left unhandled, each such rank printed a traceback, and Python 3.11 parses the
            # source of every frame it formats, from many threads at once, which can corrupt
            # the interpreter's shared AST state (SystemError in the driver's next ast.parse).
            pass
        finally:
            dist.destroy_process_group()

    def _init_rank(self, rank: int) -> RankContext:
        dist.init_process_group(
            _threaded_pg.BACKEND,
            rank=rank,
            world_size=self.world_size,
            store=self.store,
            timeout=timedelta(seconds=_START_TIMEOUT),
        )
        # All rank threads share one device, as upstream's FSDPTestMultiThread does.
        device = devices.rank_device(self.device, 0)
        return RankContext(rank=rank, world_size=self.world_size, device=device, runner=RUNNER)

    def _execute(
        self, ctx: RankContext, fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> RankOutcome:
        rank = ctx.rank
        try:
            return RankOutcome(rank, "ok", value=fn(ctx, *args))
        except BaseException as exc:
            released = released_outcome(rank, exc, _is_release)
            if released is not None:
                return released
            if is_skip(exc):
                # A skip leaves the peers to go on alone: release any that wait for us.
                self.domain.abort(f"rank {rank} skipped")
                return RankOutcome(rank, "skipped", summary=skip_reason(exc), exception=exc)
            self.domain.abort(f"rank {rank} raised {type(exc).__name__}")
            return error_outcome(rank, exc)


class ThreadWorld(PersistentWorld[_Generation]):
    """A persistent World of ``world_size`` rank threads (see the module docstring)."""

    runner = RUNNER
    lacks = _threaded_pg.UNSUPPORTED
    _numbers = itertools.count()

    def __init__(
        self, world_size: int, device: str = "cpu", *, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        _threaded_pg.install()
        self._holds_install = True
        internals.quiet_known_warnings()
        super().__init__(world_size, device, timeout=timeout)

    def close(self) -> None:
        """Stop the ranks and give back what ``_threaded_pg.install`` changed process-wide
        when this was the last open thread World (a later call installs it again)."""
        super().close()
        with self._lock:
            held, self._holds_install = self._holds_install, False
        if held:
            _threaded_pg.release(grace=_ABANDONED_GRACE)

    def _refuse_caller(self, method: str) -> None:
        if threading.current_thread().name.startswith("distconf-g"):
            raise DistconfError(
                f"world.{method} was called from a rank thread; call it from the driver"
            )

    def _start_ranks(self) -> _Generation:
        _refuse_past_stuck_limit()
        if not self._holds_install:  # used again after close
            _threaded_pg.install()
            self._holds_install = True
        generation = _Generation(self.world_size, self.device, next(self._numbers))
        generation.start()
        return generation

    def _after_failure(self, outcomes: list[RankOutcome], timed_out: bool) -> None:
        self._discard()  # retire the generation (see the module docstring)


# Rank threads that never came back from a call; a thread cannot be killed, only left.
_abandoned: list[threading.Thread] = []


class RankAbandoned(BaseException):
    """Raised inside a rank thread that overran its call's deadline, to unwind it (a
    ``BaseException``: ``except Exception`` in the code under test must not swallow it)."""


def _interrupt(thread: threading.Thread) -> None:
    """Raise ``RankAbandoned`` in ``thread`` at its next Python instruction; a thread blocked
    in C code sees it only if it ever returns to Python."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(RankAbandoned)
        )


def _refuse_past_stuck_limit() -> None:
    _abandoned[:] = [thread for thread in _abandoned if thread.is_alive()]
    if len(_abandoned) >= _STUCK_LIMIT:
        raise WorldStartError(
            f"{len(_abandoned)} rank threads are stuck in earlier calls and cannot be "
            "stopped; this process will not start more (use --runner processes for checks "
            "that hang, or restart the session)"
        )


def _is_release(exc: BaseException) -> bool:
    return isinstance(exc, _threaded_pg.CollectiveAborted)


def _barrier(ctx: RankContext) -> None:
    dist.barrier()
