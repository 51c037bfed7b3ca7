"""Process runner: N persistent rank processes in a process group of any registered backend
(gloo on CPU; on an accelerator, one device per rank and its default backend, nccl on CUDA).

A *pool* is N processes that serve calls from a pipe each, and a temporary directory (their
FileStores, stacks and stderr). The processes are forked by a forkserver that imported torch
once (never initialising CUDA or a process group), so a rank starts in well under a second
after the first.

After a call that did not succeed only what is broken is replaced, before the next call: a
rank that did not answer (it died, ran past the deadline, or stayed stuck in a collective) is
killed at once and started anew; every other rank (one that raised, skipped, returned, or was
released from a collective) is reset in place; then all of them, old and new, join a new
process group on a fresh FileStore. A failed health check does the same. A new pool is
started only when that repair fails. ``ProcessWorld.respawns`` counts the rank processes
started anew, ``ProcessWorld.resets`` the repairs that kept rank processes.

A rank that fails destroys its process groups and closes their connections before it
reports, and so does a rank released that way: peers blocked in a gloo collective with it (of
the default group or of a DeviceMesh) get "Connection closed by peer" at once, report
``waiting`` and are reset in place, instead of hanging until gloo's own timeout. With strict
collectives, rank 0 reports the ranks that failed its monitored barrier: it was released too.
Peers still blocked after ``_PEER_GRACE`` seconds (on a rank that returned, say) are reported
``waiting`` with their stacks and respawned.

Rank processes re-import the driver's ``__main__`` (multiprocessing does, so that functions
defined there can be called in them): a driver script must open its Worlds under
``if __name__ == "__main__":``. A rank's stderr goes to ``stderr.<rank>.txt`` in the pool's
directory from its first instruction on; when a rank dies, its exit and its last stderr lines
are in the error, and a rank that dies while the pool starts fails the start at once.

Network: gloo binds to the loopback interface (``GLOO_SOCKET_IFNAME`` is set in every rank to
the interface that holds 127.0.0.1: ``lo`` on Linux, ``lo0`` on macOS) and the rendezvous is a
FileStore in the pool's directory, so no rank listens beyond this machine. A
``GLOO_SOCKET_IFNAME`` in the driver's environment when a pool starts (an interface name, or
several separated by commas) is passed to the ranks instead.

An interrupt (Ctrl-C; SIGTERM in a pytest run) while ranks start, serve a call, are repaired,
are health-checked or are closed kills the pool's processes and removes its directory before
it propagates. A pool whose World was never closed has its directory removed when the driver
exits, and one whose driver was killed outright by its ranks as they end.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection, wait
from typing import Any

from harness import faults
from harness.errors import WorldStartError, invalid
from harness.runners import _rank_process
from harness.runners.base import DEFAULT_TIMEOUT, RankOutcome
from harness.runners.world import PersistentWorld
from harness.torchkit import reach, surface

RUNNER = "processes"
_START_TIMEOUT = 180.0
_CONTROL_TIMEOUT = 30.0
_START_ATTEMPTS = 3
_REAP_WAIT = 5.0
_PEER_GRACE = 2.0
"""Seconds the other ranks get to answer once one rank failed the call: the call has failed
anyway, and ranks blocked in a collective with the failed rank would hold the driver to the
call's whole deadline for every failing example hypothesis tries."""

MAIN_GUARD = (
    "rank processes re-import the driver's __main__ module (multiprocessing does, so that "
    "functions defined there can be called in them), and run its top-level code again: open "
    'and use Worlds only under `if __name__ == "__main__":` in the driver script'
)


@functools.cache
def _rank_context() -> multiprocessing.context.ForkServerContext:
    """Forkserver children start as forks of a server that already imported these modules."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", _rank_process.__name__])
    return context


def _refuse_inside_rank_bootstrap() -> None:
    """A process multiprocessing is preparing (a rank re-importing an unguarded driver script)
    must not start ranks of its own: say why instead of multiprocessing's generic error."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise WorldStartError(
            f"a processes World was started while multiprocessing prepared a new process: "
            f"{MAIN_GUARD}"
        )


class _Pool:
    """One set of rank processes, the pipes to them, and their temporary directory."""

    def __init__(
        self, world_size: int, device: str, *, strict: bool, backend: str, plugins: tuple[str, ...]
    ) -> None:
        self.world_size, self.device, self.strict = world_size, device, strict
        self.backend, self.plugins = backend, plugins
        self.gloo_interface = _rank_process.gloo_interface()
        self.faults = tuple(faults.exported()), tuple(faults.exported_files())
        self.generation = 0
        self.processes: list[Any] = []
        self.conns: list[Connection] = []
        self.gone: set[int] = set()
        self.broken: set[int] = set()
        """Ranks killed because a call or health check left them unusable; respawned by
        ``mend``."""
        self.dirty = False
        """A call or health check failed: every rank must join a new group before the next."""
        self.retryable = True
        """False once a rank died before its entry point: starting again would fail alike."""
        self.dir = tempfile.mkdtemp(prefix="distconf-world-")
        # A pool never killed (a driver script that never closed its World) is removed when
        # the driver exits; its rank processes are multiprocessing's to end then.
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)
        self.files = [_rank_process.RankFiles(self.dir, rank) for rank in range(world_size)]

    @property
    def needs_repair(self) -> bool:
        return self.dirty or bool(self.broken)

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start every rank; raises ``WorldStartError`` as soon as one cannot start. On any
        failure, Ctrl-C included, nothing is left behind."""
        try:
            for rank in range(self.world_size):
                process, conn = self._launch(rank)
                self.processes.append(process)
                self.conns.append(conn)
            expected = dict.fromkeys(range(self.world_size), "ready")
            replies, missing = self._gather(expected, _deadline(_START_TIMEOUT), fail_fast=True)
            problems = self._start_problems(replies, missing)
            if problems:
                raise WorldStartError("rank processes failed to start:\n" + "\n".join(problems))
        except BaseException:
            self.kill()
            raise

    def mend(self) -> tuple[int, bool]:
        """Respawn the broken ranks (and dead ones), make every rank join a new group; how
        many were respawned, and whether every rank is ready (if not, discard the pool)."""
        respawn = sorted(self.broken | {r for r in range(self.world_size) if not self._alive(r)})
        self.generation += 1
        for rank in respawn:
            self._retire(rank)
        kept = [r for r in range(self.world_size) if r not in respawn]
        self._send(kept, pickle.dumps(("control", ("reset", self.generation))))
        for rank in respawn:
            self.processes[rank], self.conns[rank] = self._launch(rank)
        expected = {r: "ready" if r in respawn else "reset" for r in range(self.world_size)}
        limit = _START_TIMEOUT if respawn else _CONTROL_TIMEOUT
        replies, missing = self._gather(expected, _deadline(limit), fail_fast=True)
        mended = not missing and all(o.status == "ok" for o in replies.values())
        self.broken, self.dirty = set(), not mended
        return len(respawn), mended

    def kill(self) -> None:
        started = [process for process in self.processes if process.pid is not None]
        for process in started:
            if process.is_alive():
                process.kill()
        for process in started:
            process.join(_REAP_WAIT)
        for conn in self.conns:
            conn.close()
        self._remove_dir()

    def stop(self, grace: float = _CONTROL_TIMEOUT) -> None:
        """Ask every rank to leave (barrier, destroy the group, exit); kill what remains. A
        pool that awaits repair is killed: its groups are broken, a barrier could hang."""
        try:
            if not self.needs_repair:
                self._broadcast(("stop", None))
                self._await_exit(_deadline(grace))
        finally:
            self.kill()

    def _await_exit(self, deadline: float) -> None:
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))

    def healthy(self) -> bool:
        """A barrier on every rank; the ranks that fail it are marked broken."""
        dead = [r for r in range(self.world_size) if not self._alive(r)]
        if dead:
            self._mark_broken(dead)
            return False
        self._broadcast(("control", ("health", None)))
        expected = dict.fromkeys(range(self.world_size), "health")
        replies, missing = self._gather(expected, _deadline(_CONTROL_TIMEOUT))
        if missing or any(o.status != "ok" for o in replies.values()):
            self._mark_broken(missing)
            return False
        return True

    def _launch(self, rank: int) -> tuple[Any, Connection]:
        """Start a process for ``rank`` joining the current group generation."""
        context = _rank_context()
        self.files[rank].new_process()
        self.gone.discard(rank)
        ours, theirs = context.Pipe()
        config = _rank_process.RankConfig(
            rank=rank,
            world_size=self.world_size,
            device=self.device,
            directory=self.dir,
            parent_pid=os.getpid(),
            strict_collectives=self.strict,
            generation=self.generation,
            gloo_interface=self.gloo_interface,
            backend=self.backend,
            backend_plugins=self.plugins,
            faults=self.faults[0],
            fault_files=self.faults[1],
            reach_dir=os.environ.get(reach.ENV_VAR, ""),
            surface_dir=os.environ.get(surface.ENV_VAR, ""),
        )
        process = context.Process(
            target=_rank_process.main,
            args=(config, theirs),
            name=_rank_process.process_name(self.dir, rank),
            daemon=True,
        )
        try:
            process.start()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # else the rank's death never reads as EOF on our end
        return process, ours

    def _retire(self, rank: int) -> None:
        """Kill rank ``rank``'s process (if it still runs) and reap it."""
        process = self.processes[rank]
        if process.is_alive():
            process.kill()
        process.join(_REAP_WAIT)
        self.conns[rank].close()

    def _mark_broken(self, ranks: Iterable[int]) -> None:
        self.dirty = True
        for rank in ranks:
            self._retire(rank)
            self.broken.add(rank)

    def _alive(self, rank: int) -> bool:
        return bool(self.processes[rank].is_alive())

    # --- calls -------------------------------------------------------------------------

    def call(self, payload: bytes, deadline: float) -> tuple[list[RankOutcome], bool]:
        """Every rank's outcome; after a failure, the ranks that did not answer are killed
        (``mend`` starts them anew) and the others wait to be reset."""
        assert not self.needs_repair, "a pool is repaired before it takes a call"
        self._broadcast_bytes(pickle.dumps(("call", payload)))
        expected = dict.fromkeys(range(self.world_size), "call")
        replies, missing = self._gather(expected, deadline)
        outcomes = dict(replies)
        peer_failed = any(o.status == "error" for o in replies.values())
        timed_out = False
        for rank in missing:
            outcomes[rank] = self._missing_outcome(rank)
            timed_out = timed_out or (outcomes[rank].status != "crashed" and not peer_failed)
        if missing or any(o.status != "ok" for o in replies.values()):
            self._mark_broken(missing)
        return [outcomes[r] for r in range(self.world_size)], timed_out

    def _broadcast(self, message: tuple[str, Any]) -> None:
        self._broadcast_bytes(pickle.dumps(message))

    def _broadcast_bytes(self, data: bytes) -> None:
        self._send(range(self.world_size), data)

    def _send(self, ranks: Iterable[int], data: bytes) -> None:
        for rank in ranks:
            # A dead rank shows up as crashed when its reply is gathered.
            with contextlib.suppress(BrokenPipeError, OSError):
                self.conns[rank].send_bytes(data)

    def _gather(
        self, expected: dict[int, str], deadline: float, *, fail_fast: bool = False
    ) -> tuple[dict[int, RankOutcome], list[int]]:
        """Replies of the kind ``expected`` names for each rank, until every one of those
        ranks answered, died, or the deadline passed; with ``fail_fast``, until the first
        rank died or answered with a failure (the others could wait for it forever)."""
        replies: dict[int, RankOutcome] = {}
        dead: set[int] = set()
        while True:
            pending = [r for r in expected if r not in replies and r not in dead]
            failed = dead or any(o.status != "ok" for o in replies.values())
            if not pending or (fail_fast and failed):
                break
            waiting = {
                handle: rank
                for rank in pending
                for handle in (self.conns[rank], self.processes[rank].sentinel)
            }
            ready = wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for handle in ready:
                rank = waiting[handle]
                if rank in replies or rank in dead:
                    continue
                if handle is self.conns[rank]:
                    reply = self._receive(rank)
                    if reply is None:
                        dead.add(rank)
                        self.gone.add(rank)
                    elif reply[0] == expected[rank]:
                        replies[rank] = reply[1]
                        if reply[1].status == "error":
                            deadline = min(deadline, time.monotonic() + _PEER_GRACE)
                elif not self.conns[rank].poll():
                    dead.add(rank)
        return replies, [r for r in expected if r not in replies]

    def _receive(self, rank: int) -> tuple[str, RankOutcome] | None:
        try:
            kind, outcome = pickle.loads(self.conns[rank].recv_bytes())
        except (EOFError, OSError):
            return None
        return str(kind), outcome

    # --- what a rank that did not answer was doing ---------------------------------------

    def _start_problems(self, replies: dict[int, RankOutcome], missing: list[int]) -> list[str]:
        failed = {r: o for r, o in replies.items() if o.status != "ok"}
        if any(o.summary.startswith(_rank_process.PLUGIN_FAILURE) for o in failed.values()):
            self.retryable = False  # it would fail alike
        problems = [f"rank {r}: {o.summary}\n{o.traceback}" for r, o in sorted(failed.items())]
        exited = [r for r in missing if self._reaped(r)]
        problems += [f"rank {r}: {self._exit_story(r)}" for r in exited]
        if problems:
            problems += [f"rank {r}: stopped while it started" for r in missing if r not in exited]
        else:
            limit = f"{_START_TIMEOUT:g} s"
            problems = [f"rank {r}: did not answer within {limit}" for r in missing]
        return problems

    def _reaped(self, rank: int) -> bool:
        """Whether the rank's process has exited (waiting a moment for the forkserver to
        report an exit whose signs - a closed pipe - came first)."""
        process = self.processes[rank]
        exited = rank in self.gone or not process.is_alive() or self._pipe_closed(rank)
        process.join(_REAP_WAIT if exited else 0)
        return not process.is_alive()

    def _exit_story(self, rank: int) -> str:
        """How the rank's process ended, where, and its last stderr lines."""
        story = _rank_process.describe_exit(self.processes[rank].exitcode)
        if not os.path.exists(self.files[rank].stack):
            self.retryable = False
            story += _before_entry_point()
        stack = self.files[rank].new_stack_text().strip()
        if stack:
            story += f"\n{stack}"
        return story + self.files[rank].stderr_tail()

    def _missing_outcome(self, rank: int) -> RankOutcome:
        if self._reaped(rank):
            return RankOutcome(
                rank,
                "crashed",
                summary=_rank_process.describe_exit(self.processes[rank].exitcode),
                traceback=self.files[rank].new_stack_text() + self.files[rank].stderr_tail(),
            )
        stack = self.files[rank].dump_stack(self.processes[rank].pid)
        if _rank_process.in_collective(stack):
            return RankOutcome(rank, "waiting", summary="waiting in a collective", traceback=stack)
        return RankOutcome(rank, "timeout", summary="still running", traceback=stack)

    def _pipe_closed(self, rank: int) -> bool:
        return bool(self.processes[rank].sentinel in wait([self.processes[rank].sentinel], 0))


def _deadline(seconds: float) -> float:
    return time.monotonic() + seconds


def _before_entry_point() -> str:
    """Why a rank can die before distconf's code runs in it."""
    main_file = getattr(sys.modules["__main__"], "__file__", None)
    if main_file is None:
        return " before distconf's rank code ran (while multiprocessing prepared the process)"
    return (
        f" while multiprocessing re-imported the driver's __main__ ({main_file}) in it, before "
        f"distconf's rank code ran: {MAIN_GUARD}"
    )


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
        backend: str = "gloo",
        backend_plugins: tuple[str, ...] = (),
    ) -> None:
        super().__init__(world_size, device, timeout=timeout)
        self.strict_collectives = strict_collectives
        self.backend, self.backend_plugins = backend, backend_plugins
        self.respawns = 0
        """Rank processes killed and started anew because a failed call or health check left
        them unusable (dead, past the deadline, stuck in a collective), or a repair failed;
        counted when they are killed (their successors start before the next call)."""
        self.resets = 0
        """Repairs that kept rank processes and rebuilt their process group in place."""

    def _prepare(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
        return _pickled_call(fn, args)

    def _repair(self) -> None:
        pool = self._ranks
        if pool is None or not pool.needs_repair:
            return
        counted = len(pool.broken)
        respawned, mended = pool.mend()
        self.respawns += respawned - counted  # ranks that died between calls
        if not mended:
            self._discard()  # the next call starts a new pool
            self.respawns += self.world_size
        elif respawned < self.world_size:
            self.resets += 1

    def _start_ranks(self) -> _Pool:
        _refuse_inside_rank_bootstrap()
        errors = []
        for _ in range(_START_ATTEMPTS):
            pool = _Pool(
                self.world_size,
                self.device,
                strict=self.strict_collectives,
                backend=self.backend,
                plugins=self.backend_plugins,
            )
            try:
                pool.start()
            except WorldStartError as exc:
                if not pool.retryable:
                    raise
                errors.append(str(exc))
                continue
            return pool
        raise WorldStartError(
            f"{_START_ATTEMPTS} attempts to start {self.world_size} rank processes failed:\n"
            + "\n---\n".join(errors)
        )

    def _after_failure(self, outcomes: list[RankOutcome], timed_out: bool) -> None:
        """Count the ranks the pool killed for not answering: it is repaired (they are
        started anew) before its next call."""
        self._count_broken()

    def _after_unhealthy(self) -> None:
        """Count the ranks the pool killed for failing the health check: it is repaired
        (they are started anew) before its next call."""
        self._count_broken()

    def _count_broken(self) -> None:
        # A pool is repaired before every call and health check: what is broken now broke in
        # the one that just failed.
        if self._ranks is not None:
            self.respawns += len(self._ranks.broken)


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
