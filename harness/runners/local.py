"""Local runner: one thread simulates every rank, in torch's ``LocalTensorMode``.

A check runs once for all ranks of the World: its tensors are ``LocalTensor``s holding one
local tensor per rank, and each collective is computed from those (torch's
``_local_tensor``), on torch's fake process group (rank 0 of the World's size; no data
moves through it). So World sizes of 8-256 and meshes such as (4, 4, 4) or (3, 5, 7) run on
one CPU. The check's result is split per rank (``torchkit.local.split``): ``world.run``
returns one value per rank, as on the other runners.

It serves DTensor-level checks only (``harness.runners.SERVES``): FSDP's hooks, DCP and
anything that needs a process group of its own per rank skip on it. What differs between
ranks a check says through ``harness.torchkit.local``; reading ``ctx.rank`` raises
``RankIsSimulated``.

One *simulation* is a daemon thread that serves calls from its inbox, like a generation of
the thread runner with a single thread; a call's deadline is kept by the driver, which on
expiry takes the thread's stack and raises ``RankAbandoned`` in it, and so does a call that
grows the process past its memory budget (``capacity.LOCAL_MEMORY_SHARE``): one process
holds every rank's tensors, and a World of 256 ranks can outgrow the host. ``LocalTensorMode``
is process-wide (its mode stack, and the ``DeviceMesh`` methods it patches while entered),
so calls of every local World take turns, each entering the mode for the call only, and the
process's default group is the fake group of the World whose call runs (remade, and that
World's meshes forgotten, when another World's call made its own since). A thread that
could not be unwound after a deadline (stuck in C code, still in the mode) stops this
process from starting another simulation.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from harness.errors import DistconfError, WorldStartError
from harness.runners._hooks import ProcessHooks, hooks_lock
from harness.runners.base import (
    DEFAULT_TIMEOUT,
    AllRanksSkipped,
    RankFailure,
    RankOutcome,
    RankStatus,
    error_outcome,
    is_skip,
    skip_reason,
)
from harness.runners.capacity import LOCAL_BACKEND, LOCAL_MEMORY_SHARE, available_memory
from harness.runners.world import PersistentWorld
from harness.torchkit import devices, internals
from harness.torchkit import local as simulated

RUNNER = "local"

_START_TIMEOUT = 60.0
_HEALTH_TIMEOUT = 10.0
_UNWIND_GRACE = 2.0
"""Seconds a simulation that overran its deadline gets to unwind out of LocalTensorMode."""
_STUCK_GRACE = 10.0
"""Seconds a new simulation waits for an abandoned one still in the mode to unwind."""
_MEMORY_POLL = 0.05
"""Seconds between two looks at the process's memory while a call runs."""
_STOP = None
_THREAD_PREFIX = "distconf-local"
SIMULATION_ONLY = (
    "simulation only: the same call passes on {world_size} rank threads, so LocalTensorMode "
    "cannot simulate it (a limitation of the local runner, not of the code under test)"
)
"""Added to a failure the thread runner's ranks do not share (``LocalWorld.run``)."""
CROSS_CHECK_TIMEOUT = 15.0
"""Seconds rank threads get to run a failed call again: a redistribute on 64 of them takes
about one, a long program on 64 of them more than a minute; past it the cross-check cannot
tell, and the failure is told as it is."""
T = TypeVar("T")

# Calls of every local World take turns: LocalTensorMode's state is process-wide.
_turn = threading.Lock()
# Held while a local World makes or destroys the default group: only groups of the fake
# backend (LOCAL_BACKEND) are local Worlds', any other default group is not ours.
_group_lock = threading.Lock()
# Simulation threads that never unwound from a call that overran its deadline.
_stuck: list[threading.Thread] = []


class RankAbandoned(BaseException):
    """Raised inside a simulation thread that overran its call's deadline, to unwind it (a
    ``BaseException``: ``except Exception`` in the code under test must not swallow it)."""


class _Simulation:
    """One simulation thread and what it built: the context and its meshes."""

    def __init__(self, world_size: int, device: str, number: int) -> None:
        self.world_size, self.device = world_size, device
        self.ranks = tuple(range(world_size))
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.cond = threading.Condition()
        self.call_id = 0
        self.report: tuple[int, list[RankOutcome]] | None = None
        self.fit = True
        """False once a call left the process's simulation state behind (mode, patches)."""
        self.group: Any = None
        self.memory_budget = _memory_budget()
        self.thread = threading.Thread(
            target=self._main, name=f"{_THREAD_PREFIX}{number}", daemon=True
        )

    # --- the driver's side ---------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()
        outcomes, timed_out = self.collect(time.monotonic() + _START_TIMEOUT)
        failed = [o for o in outcomes if o.status != "ok"]
        if timed_out or failed:
            self.stop()
            why = failed[0].traceback if failed else f"no answer in {_START_TIMEOUT:g} s"
            raise WorldStartError(f"the {RUNNER} runner's simulation failed to start:\n{why}")

    def call(
        self, payload: tuple[Callable[..., Any], tuple[Any, ...]], deadline: float
    ) -> tuple[list[RankOutcome], bool]:
        resident = _resident_bytes()
        if resident is not None and resident > self.memory_budget:
            summary = (
                f"not started: the process holds {resident / 2**30:.1f} GiB, past {self._budget}"
            )
            return _as_one(self.ranks, RankOutcome(0, "error", summary=summary)), False
        with self.cond:
            self.call_id += 1
            self.report = None
        self.inbox.put((self.call_id, *payload))
        return self.collect(deadline)

    @property
    def _budget(self) -> str:
        return (
            f"the local runner's budget of {self.memory_budget / 2**30:.1f} GiB "
            "(capacity.LOCAL_MEMORY_SHARE of the memory available when this process started "
            "its first simulation: one process holds every rank's tensors)"
        )

    def collect(self, deadline: float) -> tuple[list[RankOutcome], bool]:
        """Every rank's outcome, and whether the deadline expired (then the thread's stack
        is rank 0's story, and the thread is asked to unwind); a call that grows the process
        past its memory budget is stopped the same way and fails, naming the budget."""
        while True:
            with self.cond:
                done = self.cond.wait_for(
                    lambda: self.report is not None and self.report[0] == self.call_id,
                    timeout=max(0.0, min(deadline - time.monotonic(), _MEMORY_POLL)),
                )
                report = self.report
            if done and report is not None:
                return report[1], False
            if time.monotonic() >= deadline:
                summary = f"still running (one thread simulates all {self.world_size} ranks)"
                return self._abandon("timeout", summary), True
            resident = _resident_bytes()
            if resident is not None and resident > self.memory_budget:
                summary = (
                    f"the call grew the process to {resident / 2**30:.1f} GiB, past {self._budget}"
                )
                return self._abandon("error", summary), False

    def _abandon(self, status: RankStatus, summary: str) -> list[RankOutcome]:
        """Rank 0's outcome ``status`` with the thread's stack (the others: simulated with
        it); the thread is asked to unwind, and the simulation is not used again."""
        frame = sys._current_frames().get(self.thread.ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"
        self.fit = False
        _interrupt(self.thread)
        return _as_one(self.ranks, RankOutcome(0, status, summary=summary, traceback=stack))

    def healthy(self) -> bool:
        outcomes, _ = self.call((_barrier, ()), time.monotonic() + _HEALTH_TIMEOUT)
        return self.fit and all(o.status == "ok" for o in outcomes)

    def stop(self) -> None:
        """Let the thread leave; one still in a call is asked to unwind and, if it cannot
        (stuck in C code, inside LocalTensorMode), kept on record."""
        self.inbox.put(_STOP)
        if self.thread.ident is None:
            return
        self.thread.join(_UNWIND_GRACE)
        if self.thread.is_alive() and not self.fit:
            _stuck.append(self.thread)

    def kill(self) -> None:
        self.stop()

    # --- the simulation thread -----------------------------------------------------------

    def _main(self) -> None:
        try:
            ctx = simulated.SimulatedContext(
                rank=0,
                world_size=self.world_size,
                device=devices.rank_device(self.device, 0),
                runner=RUNNER,
            )
            with _turn:
                self._own_default_group(ctx)
        except BaseException as exc:
            self._report(0, _as_one(self.ranks, _error(0, exc)))
            return
        self._report(0, [RankOutcome(rank, "ok") for rank in self.ranks])
        try:
            while (message := self.inbox.get()) is not _STOP:
                call_id, fn, args = message
                self._report(call_id, self._execute(ctx, fn, args))
        except RankAbandoned:
            return
        finally:
            self._leave()

    def _execute(
        self, ctx: simulated.SimulatedContext, fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> list[RankOutcome]:
        from torch.distributed._local_tensor import LocalTensorMode

        try:
            with _turn:
                self._own_default_group(ctx)
                with LocalTensorMode(self.world_size):
                    value = fn(ctx, *args)
                self.fit = _mode_left()
                return [RankOutcome(r, "ok", value=simulated.split(value, r)) for r in self.ranks]
        except BaseException as exc:
            self.fit = self.fit and _mode_left() and not isinstance(exc, RankAbandoned)
            if is_skip(exc):
                reason = skip_reason(exc)
                return [
                    RankOutcome(r, "skipped", summary=reason, exception=exc) for r in self.ranks
                ]
            rank = simulated.note_rank(exc)
            return _as_one(self.ranks, _error(0 if rank is None else rank, exc))

    def _own_default_group(self, ctx: simulated.SimulatedContext) -> None:
        """Make this World's fake group the process's default group, if another World's
        call made its own since (that destroys this World's meshes: forget them)."""
        with _group_lock:
            current = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
            if current is not None and current is self.group:
                return
            if current is not None:
                # Another local World's fake group (the thread runner's thread-local world,
                # installed and given back meanwhile, can bring an older one back) is ours.
                backend = dist.get_backend()
                if backend != LOCAL_BACKEND:
                    raise WorldStartError(
                        f"this process already has a default process group ({backend}); the "
                        f"{RUNNER} runner needs torch's fake group as the default group"
                    )
                dist.destroy_process_group()
            _register_fake_backend()
            with hooks_lock:
                hooks = ProcessHooks()
                try:
                    dist.init_process_group(
                        LOCAL_BACKEND,
                        store=HashStore(),
                        rank=0,
                        world_size=self.world_size,
                        timeout=timedelta(seconds=_START_TIMEOUT),
                    )
                finally:
                    hooks.restore()
            self.group = dist.distributed_c10d._get_default_group()
            ctx.forget_meshes()
            internals.clear_dtensor_plan_caches()

    def _leave(self) -> None:
        with _group_lock:
            # The default group is a local World's (a fake group) or another runner's; any
            # local World's call makes its own again when it is gone.
            if dist.is_initialized() and dist.get_backend() == LOCAL_BACKEND:
                dist.destroy_process_group()
            self.group = None

    def _report(self, call_id: int, outcomes: list[RankOutcome]) -> None:
        with self.cond:
            if call_id == self.call_id:
                self.report = (call_id, outcomes)
                self.cond.notify_all()


class LocalWorld(PersistentWorld[_Simulation]):
    """A persistent World whose ranks one thread simulates (see the module docstring)."""

    runner = RUNNER
    lacks = frozenset(
        {
            "send",
            "recv",
            "reduce",
            "gather",
            "reduce_scatter.premul_sum",
            "mesh.from_group",
            "scatter.group_src",
        }
    )
    """What LocalTensorMode cannot simulate: point-to-point and rooted collectives but
    broadcast and scatter from group rank 0, PreMulSum, and meshes that are another object on
    every rank (``DeviceMesh.from_group``)."""
    _numbers = itertools.count()

    def __init__(
        self, world_size: int, device: str = "cpu", *, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        internals.quiet_known_warnings()
        super().__init__(world_size, device, timeout=timeout)
        self._threads: PersistentWorld[Any] | None = None
        """Rank threads of the same size, started at the first failed call to cross-check it."""

    def run(self, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> list[T]:
        """``PersistentWorld.run``; a call that raised on the simulation is run again on rank
        threads of the same World size, and where they take it the failure says so
        (``SIMULATION_ONLY``): a limitation of LocalTensorMode, not of the code under test."""
        try:
            return super().run(fn, *args, timeout=timeout)
        except RankFailure as failure:
            if failure.timed_out or failure.primary.status != "error":
                raise
            told = self._cross_checked(failure, fn, args, timeout)
            if told is failure:
                raise
            raise told from failure.primary.exception

    def _cross_checked(
        self,
        failure: RankFailure,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        timeout: float | None,
    ) -> RankFailure:
        from harness.runners.threads import ThreadWorld

        if self._threads is None:
            self._threads = ThreadWorld(self.world_size, self.device, timeout=self.timeout)
        try:
            self._threads.run(fn, *args, timeout=min(timeout or self.timeout, CROSS_CHECK_TIMEOUT))
        except (DistconfError, AllRanksSkipped):  # failed there too, or could not tell
            return failure
        primary = failure.primary
        summary = f"{primary.summary} [{SIMULATION_ONLY.format(world_size=self.world_size)}]"
        told = dataclasses.replace(primary, summary=summary)
        outcomes = [told if o.rank == primary.rank else o for o in failure.outcomes]
        return RankFailure(outcomes, runner=self.runner, device=self.device)

    def close(self) -> None:
        # Rank threads first: the last thread World gives the process back c10d's shared
        # world, whose fake default group the simulation then destroys as it leaves.
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.close()
        super().close()

    def _refuse_caller(self, method: str) -> None:
        if threading.current_thread().name.startswith(_THREAD_PREFIX):
            raise DistconfError(
                f"world.{method} was called from a simulated check; call it from the driver"
            )

    def _start_ranks(self) -> _Simulation:
        waited_until = time.monotonic() + _STUCK_GRACE
        for thread in _stuck:  # one still unwinding from a long op in C code may finish
            thread.join(max(0.0, waited_until - time.monotonic()))
        _stuck[:] = [thread for thread in _stuck if thread.is_alive()]
        if _stuck:
            raise WorldStartError(
                f"a {RUNNER}-runner call overran its deadline in code that cannot be "
                "interrupted and still holds LocalTensorMode, which is process-wide: this "
                "process will not simulate ranks again (restart the session; checks that "
                "hang belong on --runner processes)"
            )
        simulation = _Simulation(self.world_size, self.device, next(self._numbers))
        simulation.start()
        return simulation

    def _after_failure(self, outcomes: list[RankOutcome], timed_out: bool) -> None:
        # An exception unwinds the simulation cleanly: keep it (shrinking re-runs failing
        # examples); one that overran its deadline or left the mode behind is dropped.
        if timed_out or (self._ranks is not None and not self._ranks.fit):
            self._discard()


def _as_one(ranks: tuple[int, ...], primary: RankOutcome) -> list[RankOutcome]:
    """Every rank's outcome of a call that ended for all of them with ``primary``'s: the
    others ran in the same thread, and are told so."""
    summary = f"simulated in one thread with rank {primary.rank}, whose {primary.status} ended it"
    return [
        primary if rank == primary.rank else RankOutcome(rank, "waiting", summary=summary)
        for rank in ranks
    ]


def _error(rank: int, exc: BaseException) -> RankOutcome:
    """An ``error`` outcome; one raised inside torch's simulation says where, so that a
    limitation of the simulation reads apart from a failure of the code under test."""
    frames = traceback.extract_tb(exc.__traceback__)
    inner = frames[-1] if frames else None
    context = ""
    if inner is not None and "/distributed/_local_tensor/" in inner.filename.replace("\\", "/"):
        context = f"in LocalTensorMode ({Path(inner.filename).name}:{inner.lineno} in {inner.name})"
    return error_outcome(rank, exc, context=context)


def _mode_left() -> bool:
    """Whether the simulation left nothing behind: no LocalTensorMode still entered."""
    from torch.distributed._local_tensor import local_tensor_mode

    return local_tensor_mode() is None


def _register_fake_backend() -> None:
    """Torch's fake process group under its name (upstream registers it in
    ``torch.testing._internal``, which only the thread runner's module may import)."""
    if LOCAL_BACKEND.upper() in dist.Backend._plugins:
        return
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common: Any, options: Any) -> Any:
        # the group's default options: the simulation needs none of them
        return FakeProcessGroup._create_internal(common.group_rank, common.group_size)

    dist.Backend.register_backend(LOCAL_BACKEND, create, extended_api=True, devices=["cpu"])


def _interrupt(thread: threading.Thread) -> None:
    """Raise ``RankAbandoned`` in ``thread`` at its next Python instruction."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(RankAbandoned)
        )


@functools.cache
def _memory_budget() -> int:
    """The resident size past which no local-runner call may grow this process: what it
    held when its first simulation started plus ``LOCAL_MEMORY_SHARE`` of the memory then
    available (fixed for the process, so that what checks keep between calls counts)."""
    return int((_resident_bytes() or 0) + LOCAL_MEMORY_SHARE * available_memory())


def _resident_bytes() -> int | None:
    """The process's resident memory now (Linux ``/proc``); None where it cannot be read."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _barrier(ctx: Any) -> None:
    dist.barrier()
