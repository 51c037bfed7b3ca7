"""Process runner: N persistent rank processes on gloo (CPU) or nccl (one GPU per rank).

A *pool* is N processes that serve calls from a pipe each. They are forked by a forkserver
that imported torch once (never initialising CUDA or a process group), so a pool starts in
well under a second after the first: a failing hypothesis example that strands ranks in a
collective costs a respawn, and shrinking may need dozens of them.
The process group inside them is rebuilt cheaply after a call that failed (every rank
destroys its group and joins a new one on a fresh FileStore); the processes themselves are
respawned only when one died, a call's deadline expired, or a health check failed.

A rank that fails destroys its process group before it reports: peers blocked in a gloo
collective of the default group with it get "Connection closed by peer" at once and report
``waiting`` instead of hanging until gloo's own timeout. Peers blocked in a DeviceMesh group's
collective are not released that way: the driver gives them ``_PEER_GRACE`` seconds, reports
them ``waiting`` with their stacks, and respawns the pool.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from harness import faults
from harness.errors import WorldStartError, invalid
from harness.runners import _rank_process
from harness.runners.base import DEFAULT_TIMEOUT, RankOutcome
from harness.runners.world import PersistentWorld

RUNNER = "processes"
_START_TIMEOUT = 180.0
_CONTROL_TIMEOUT = 30.0
_STACK_WAIT = 1.0
_START_ATTEMPTS = 3
_REAP_WAIT = 5.0
_PEER_GRACE = 2.0
"""Seconds the other ranks get to answer once one rank failed the call: the call has failed
anyway, and ranks blocked in a collective with the failed rank would hold the driver to the
call's whole deadline for every failing example hypothesis tries."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


@functools.cache
def _rank_context() -> multiprocessing.context.ForkServerContext:
    """Forkserver children start as forks of a server that already imported these modules."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", _rank_process.__name__])
    return context


class _Pool:
    """One set of rank processes and the pipes to them."""

    def __init__(self, world_size: int, device: str, *, strict: bool) -> None:
        self.world_size, self.device = world_size, device
        self.dir = tempfile.mkdtemp(prefix="distconf-world-")
        self.group_generation = 0
        context = _rank_context()
        self.conns: list[Connection] = []
        self.child_ends: list[Connection] = []
        self.processes: list[Any] = []
        self.stack_offsets = [0] * world_size
        self.gone: set[int] = set()
        for rank in range(world_size):
            ours, theirs = context.Pipe()
            config = _rank_process.RankConfig(
                rank=rank,
                world_size=world_size,
                device=device,
                directory=self.dir,
                parent_pid=os.getpid(),
                strict_collectives=strict,
                faults=tuple(faults.exported()),
                fault_files=tuple(faults.exported_files()),
            )
            process = context.Process(
                target=_rank_process.main,
                args=(config, theirs),
                name=f"distconf-rank{rank}",
                daemon=True,
            )
            self.conns.append(ours)
            self.child_ends.append(theirs)
            self.processes.append(process)

    def stack_path(self, rank: int) -> str:
        return _rank_process.stack_path(self.dir, rank)

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        for process, child_end in zip(self.processes, self.child_ends, strict=True):
            process.start()
            child_end.close()  # else the rank's death never reads as EOF on our end
        replies, missing = self._gather("ready", time.monotonic() + _START_TIMEOUT)
        failed = {r: o for r, o in replies.items() if o.status != "ok"}
        if missing or failed:
            detail = [f"rank {r}: {o.summary}\n{o.traceback}" for r, o in sorted(failed.items())]
            detail += [f"rank {r}: {self._exit_or_silence(r)}" for r in missing]
            self.kill()
            raise WorldStartError("rank processes failed to start:\n" + "\n".join(detail))

    def kill(self) -> None:
        started = [process for process in self.processes if process.pid is not None]
        for process in started:
            if process.is_alive():
                process.kill()
        for process in started:
            process.join(5)
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def stop(self, grace: float = _CONTROL_TIMEOUT) -> None:
        """Ask every rank to leave (barrier, destroy the group, exit); kill what remains."""
        self._broadcast(("stop", None))
        deadline = time.monotonic() + grace
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def alive(self) -> bool:
        return all(process.is_alive() for process in self.processes)

    def healthy(self) -> bool:
        return self.alive() and self.control("health", None)

    def reset(self) -> bool:
        """Every rank joins a new process group; True when all of them did."""
        self.group_generation += 1
        return self.alive() and self.control("reset", self.group_generation)

    # --- calls -------------------------------------------------------------------------

    def call(self, payload: bytes, deadline: float) -> tuple[list[RankOutcome], bool]:
        self._broadcast_bytes(pickle.dumps(("call", payload)))
        replies, missing = self._gather("call", deadline)
        outcomes = dict(replies)
        peer_failed = any(o.status == "error" for o in replies.values())
        timed_out = False
        for rank in missing:
            outcomes[rank] = self._missing_outcome(rank)
            timed_out = timed_out or (outcomes[rank].status != "crashed" and not peer_failed)
        return [outcomes[r] for r in range(self.world_size)], timed_out

    def control(self, kind: str, argument: Any) -> bool:
        """Send a control message to every rank; True when every rank acknowledged it."""
        self._broadcast(("control", (kind, argument)))
        replies, missing = self._gather(kind, time.monotonic() + _CONTROL_TIMEOUT)
        return not missing and all(o.status == "ok" for o in replies.values())

    def _broadcast(self, message: tuple[str, Any]) -> None:
        self._broadcast_bytes(pickle.dumps(message))

    def _broadcast_bytes(self, data: bytes) -> None:
        for conn in self.conns:
            # A dead rank shows up as crashed when its reply is gathered.
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send_bytes(data)

    def _gather(self, kind: str, deadline: float) -> tuple[dict[int, RankOutcome], list[int]]:
        """Replies of kind ``kind`` until every rank answered, died, or the deadline passed."""
        replies: dict[int, RankOutcome] = {}
        dead: set[int] = set()
        while len(replies) + len(dead) < self.world_size:
            waiting = {
                handle: rank
                for rank in range(self.world_size)
                if rank not in replies and rank not in dead
                for handle in (self.conns[rank], self.processes[rank].sentinel)
            }
            ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for handle in ready:
                rank = waiting[handle]
                if handle is self.conns[rank] and rank not in replies:
                    reply = self._receive(rank)
                    if reply is None:
                        dead.add(rank)
                        self.gone.add(rank)
                    elif reply[0] == kind:
                        replies[rank] = reply[1]
                        if reply[1].status == "error":
                            deadline = min(deadline, time.monotonic() + _PEER_GRACE)
                elif handle is not self.conns[rank] and not self.conns[rank].poll():
                    dead.add(rank)
        missing = [r for r in range(self.world_size) if r not in replies]
        return replies, missing

    def _receive(self, rank: int) -> tuple[str, RankOutcome] | None:
        try:
            kind, outcome = pickle.loads(self.conns[rank].recv_bytes())
        except (EOFError, OSError):
            return None
        return str(kind), outcome

    # --- what a missing rank was doing ---------------------------------------------------

    def _missing_outcome(self, rank: int) -> RankOutcome:
        process = self.processes[rank]
        # Its pipe closes a moment before the forkserver reaps it and reports its exit.
        exited = rank in self.gone or not process.is_alive() or self._pipe_closed(rank)
        process.join(_REAP_WAIT if exited else 0)
        if not process.is_alive():
            return RankOutcome(
                rank,
                "crashed",
                summary=_describe_exit(process.exitcode),
                traceback=self._new_stack_text(rank),
            )
        stack = self._dump_stack(rank)
        if _rank_process.in_collective(stack):
            return RankOutcome(rank, "waiting", summary="waiting in a collective", traceback=stack)
        return RankOutcome(rank, "timeout", summary="still running", traceback=stack)

    def _pipe_closed(self, rank: int) -> bool:
        return bool(self.processes[rank].sentinel in wait([self.processes[rank].sentinel], 0))

    def _exit_or_silence(self, rank: int) -> str:
        process = self.processes[rank]
        if process.is_alive():
            return "did not answer in time"
        return f"{_describe_exit(process.exitcode)}\n{self._new_stack_text(rank)}"

    def _dump_stack(self, rank: int) -> str:
        """Ask faulthandler in the rank for every thread's stack and read it back."""
        try:
            os.kill(self.processes[rank].pid, _rank_process.STACK_SIGNAL)
        except ProcessLookupError:
            return "(process gone)"
        deadline = time.monotonic() + _STACK_WAIT
        text = ""
        while time.monotonic() < deadline:
            time.sleep(0.05)
            text += self._new_stack_text(rank)
            if text.rstrip().endswith(")") or "File" in text:
                time.sleep(0.05)
                return text + self._new_stack_text(rank)
        return text or "(no stack: the rank did not answer the stack signal)"

    def _new_stack_text(self, rank: int) -> str:
        try:
            with open(self.stack_path(rank), encoding="utf-8", errors="replace") as handle:
                handle.seek(self.stack_offsets[rank])
                text = handle.read()
                self.stack_offsets[rank] = handle.tell()
        except OSError:
            return ""
        return text


class ProcessWorld(PersistentWorld[_Pool]):
    """A persistent World of ``world_size`` rank processes (see the module docstring)."""

    runner = RUNNER

    def __init__(
        self,
        world_size: int,
        device: str = "cpu",
        *,
        timeout: float = DEFAULT_TIMEOUT,
        strict_collectives: bool = False,
    ) -> None:
        if device == "cuda":
            _check_gpus(world_size)
        super().__init__(world_size, device, timeout=timeout)
        self.strict_collectives = strict_collectives
        self.respawns = 0
        self._needs_reset = False

    def _prepare(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
        return _pickled_call(fn, args)

    def _ready(self) -> _Pool:
        if self._ranks is not None and self._needs_reset:
            if not self._ranks.reset():
                self._discard()
            self._needs_reset = False
        return super()._ready()

    def _start_ranks(self) -> _Pool:
        errors = []
        for _ in range(_START_ATTEMPTS):
            pool = _Pool(self.world_size, self.device, strict=self.strict_collectives)
            try:
                pool.start()
            except WorldStartError as exc:
                errors.append(str(exc))
                continue
            return pool
        raise WorldStartError(
            f"{_START_ATTEMPTS} attempts to start {self.world_size} rank processes failed:\n"
            + "\n---\n".join(errors)
        )

    def _after_failure(self, outcomes: list[RankOutcome], timed_out: bool) -> None:
        """Respawn the pool when a rank cannot take the next call, else rebuild its group."""
        stranded = ("crashed", "waiting", "timeout")
        if timed_out or any(o.status in stranded for o in outcomes):
            self.respawns += 1
            self._discard()
        else:
            self._needs_reset = True


def _pickled_call(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    """Pickle the call in the driver, so an unpicklable function or argument is named here."""
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise invalid(
            "fn", fn, f"picklable to reach rank processes ({exc}): a module-level function"
        ) from None
    for index, arg in enumerate(args):
        try:
            pickle.dumps(arg)
        except Exception as exc:
            raise invalid(
                f"args[{index}]", arg, f"picklable to reach rank processes ({exc})"
            ) from None
    return pickle.dumps((fn, args))


def _check_gpus(world_size: int) -> None:
    import torch

    available = torch.cuda.device_count()
    if available < world_size:
        raise invalid(
            "world_size",
            world_size,
            f"at most {available}, the GPUs visible (the process runner gives each rank one)",
        )
