"""What runs inside one rank process of the process runner.

The driver sends pickled messages over a pipe: ``("call", payload)``, ``("control", (kind,
argument))`` for ``health`` and ``reset``, and ``("stop", None)``; the rank answers every call
and control message with ``(kind, RankOutcome)``. Stacks go to a per-rank file through
faulthandler: on a fatal signal, and on ``STACK_SIGNAL`` when the driver's deadline expires.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import select
import signal
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from harness.runners.base import (
    RankOutcome,
    error_outcome,
    is_skip,
    released_outcome,
    skip_reason,
)

STACK_SIGNAL = signal.SIGUSR1
# gloo's message when a peer destroyed its group (we make failing ranks do that): the rank
# reading it was released from a collective, it did not fail on its own.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
_COLLECTIVE_FRAMES = ("distributed_c10d.py", "_functional_collectives.py", "c10d_logger.py")
# The driver enforces every deadline; the group's own timeout only has to outlast them.
_GROUP_TIMEOUT = timedelta(hours=2)


@dataclass(frozen=True)
class RankConfig:
    rank: int
    world_size: int
    device: str
    directory: str
    parent_pid: int
    strict_collectives: bool
    faults: tuple[str, ...] = ()
    fault_files: tuple[str, ...] = ()


def _is_release(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _PEER_GONE)


def stack_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"stack.{rank}.txt")


def in_collective(stack: str) -> bool:
    """Whether a faulthandler stack shows the rank inside a torch.distributed call."""
    return any(marker in stack for marker in _COLLECTIVE_FRAMES)


def main(config: RankConfig, conn: Connection) -> None:
    """Entry point of a rank process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    _exit_with_parent(config.parent_pid)
    stacks = open(stack_path(config.directory, config.rank), "w")  # noqa: SIM115 (process-long)
    faulthandler.enable(stacks, all_threads=True)
    faulthandler.register(STACK_SIGNAL, stacks, all_threads=True)
    try:
        rank = _Rank(config)
    except BaseException as exc:
        conn.send_bytes(pickle.dumps(("ready", error_outcome(config.rank, exc, keep=False))))
        return
    conn.send_bytes(pickle.dumps(("ready", RankOutcome(config.rank, "ok"))))
    rank.serve(conn)


def _exit_with_parent(parent_pid: int) -> None:
    """A rank never outlives its driver, even when it is stuck in a collective. (The driver
    is not the rank's parent: the forkserver is.)"""

    def watch() -> None:
        if hasattr(os, "pidfd_open"):  # Linux: no polling, no pid reuse
            with contextlib.suppress(ProcessLookupError):
                select.select([os.pidfd_open(parent_pid)], [], [])  # readable at its exit
            os._exit(1)
        while _alive(parent_pid):
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="distconf-parent-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class _Rank:
    def __init__(self, config: RankConfig) -> None:
        import torch

        from harness import faults
        from harness.torchkit import internals
        from harness.torchkit.context import RankContext

        internals.quiet_known_warnings()
        # a mutation run: the driver's faults, here too
        faults.apply_in_rank(config.faults, config.fault_files)
        self.config = config
        device = torch.device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(config.rank)
            device = torch.device("cuda", config.rank)
        self.ctx = RankContext(
            rank=config.rank, world_size=config.world_size, device=device, runner="processes"
        )
        self.join_group(0)

    def join_group(self, generation: int) -> None:
        """Leave the current process group (if any) and join a new one on a fresh store."""
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d

        from harness.torchkit import internals

        if dist.is_initialized():
            dist.destroy_process_group()
        if self.config.strict_collectives:
            # What TORCH_DISTRIBUTED_DEBUG=DETAIL does, set here because the variable is read
            # when torch.distributed is imported, which may precede this process's main.
            c10d.set_debug_level(c10d.DebugLevel.DETAIL)
        self.ctx.forget_meshes()
        internals.clear_dtensor_plan_caches()
        store = c10d.FileStore(
            os.path.join(self.config.directory, f"store.{generation}"), self.config.world_size
        )
        cuda = self.ctx.device.type == "cuda"
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            rank=self.config.rank,
            world_size=self.config.world_size,
            store=store,
            timeout=_GROUP_TIMEOUT,
            device_id=self.ctx.device if cuda else None,
        )

    def serve(self, conn: Connection) -> None:
        while True:
            try:
                kind, body = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return  # the driver is gone
            if kind == "stop":
                self.leave()
                return
            if kind == "call":
                reply = ("call", self.execute(body))
            else:
                control, argument = body
                reply = (control, self.control(control, argument))
            conn.send_bytes(self._dumps(reply))

    def execute(self, payload: bytes) -> RankOutcome:
        rank = self.config.rank
        try:
            fn, args = pickle.loads(payload)
        except BaseException as exc:
            return error_outcome(rank, exc, keep=False, context="loading the call in the rank")
        try:
            return RankOutcome(rank, "ok", value=fn(self.ctx, *args))
        except BaseException as exc:
            outcome = self._failure(exc)
        self._release_peers()
        return outcome

    def _failure(self, exc: BaseException) -> RankOutcome:
        rank = self.config.rank
        released = released_outcome(rank, exc, _is_release)
        if released is not None:
            return released
        if is_skip(exc):
            return RankOutcome(rank, "skipped", summary=skip_reason(exc))
        return error_outcome(rank, exc, keep=False)

    def _release_peers(self) -> None:
        """Destroy our group so peers blocked on us fail now instead of at gloo's timeout.

        This releases peers blocked in the default group; a peer blocked in a DeviceMesh's
        collective is only released when this process exits, so the driver gives peers
        ``_PEER_GRACE`` seconds and then respawns the pool."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def control(self, kind: str, argument: Any) -> RankOutcome:
        rank = self.config.rank
        try:
            if kind == "health":
                import torch.distributed as dist

                dist.barrier()
            elif kind == "reset":
                self.join_group(int(argument))
            else:
                raise AssertionError(f"the driver sent an unknown control message {kind!r}")
        except BaseException as exc:
            return error_outcome(rank, exc, keep=False, context=f"control message {kind!r}")
        return RankOutcome(rank, "ok")

    def leave(self) -> None:
        """Barrier, then destroy: gloo aborts at exit when a group is torn down unevenly."""
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.barrier()
            finally:
                dist.destroy_process_group()

    def _dumps(self, reply: tuple[str, RankOutcome]) -> bytes:
        try:
            return pickle.dumps(reply)
        except Exception as exc:
            kind, outcome = reply
            value_type = type(outcome.value).__name__
            failed = RankOutcome(
                outcome.rank,
                "error",
                summary=f"the return value (a {value_type}) cannot be sent to the driver: {exc}",
            )
            return pickle.dumps((kind, failed))
