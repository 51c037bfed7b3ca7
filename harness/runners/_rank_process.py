"""What runs inside one rank process of the process runner.

The driver sends pickled messages over a pipe: ``("call", payload)``, ``("control", (kind,
argument))`` for ``health`` and ``reset``, and ``("stop", None)``; the rank answers every call
and control message with ``(kind, RankOutcome)``, and its start with ``("ready", RankOutcome)``
once it joined the process group of its ``RankConfig.generation``. Stacks go to a per-rank
file through faulthandler: on a fatal signal, and on ``STACK_SIGNAL`` when the driver's
deadline expires.

A rank's stderr goes to ``stderr.<rank>.txt`` in the pool's directory from its first
instruction on, before multiprocessing re-imports the driver's ``__main__`` in it: the
forkserver preloads this module, which then wraps the forkserver's ``spawn.prepare`` so that
each child it forks redirects its stderr before preparing. The child learns where from its
process name (``process_name``), the one thing multiprocessing tells it before preparing.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import re
import select
import shutil
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

from harness.errors import WorldStartError, invalid
from harness.runners.base import (
    RankOutcome,
    error_outcome,
    is_skip,
    released_outcome,
    skip_reason,
)
from harness.torchkit import reach, surface

STACK_SIGNAL = signal.SIGUSR1
GLOO_INTERFACE_VAR = "GLOO_SOCKET_IFNAME"
_PROCESS_NAME = re.compile(r"distconf-rank(?P<rank>[0-9]+):(?P<directory>.+)", re.DOTALL)
_stderr_now: str | None = None
"""Where this process's stderr goes, once a rank redirected it."""
# What a rank reads when a peer failed (a failing rank closes its connections; a dead one
# loses them): it was released from a collective, it did not fail on its own. gloo's own words,
# and those of ProcessGroupGloo::monitoredBarrier (strict collectives run one before each
# collective), on rank 0 naming the others, and on the others naming rank 0 (torch 2.13).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
_MONITORED_BARRIER_RELEASES = (
    re.compile(r"\[Rank 0\]: Ranks? [0-9]+(, [0-9]+)* failed to pass monitoredBarrier in "),
    re.compile(
        r"Rank [1-9][0-9]* successfully reached monitoredBarrier, but received errors while "
        r"waiting for send/recv from rank 0\."
    ),
)
_COLLECTIVE_FRAMES = ("distributed_c10d.py", "_functional_collectives.py", "c10d_logger.py")
PLUGIN_FAILURE = "importing the --backend-plugin modules in the rank"
"""How a rank's start outcome begins when a plugin failed to import (no use retrying)."""
# The driver enforces every deadline; the group's own timeout only has to outlast them.
_GROUP_TIMEOUT = timedelta(hours=2)
_STORE_TIMEOUT = timedelta(minutes=5)
_STACK_WAIT = 1.0
_OWNER_WAIT = 2.0
"""Seconds a rank whose driver is gone waits to see whether the owner of its directory went
too (the same process, but for torchrun's ranks: their agent)."""
_STDERR_LINES = 20


@dataclass(frozen=True)
class RankConfig:
    rank: int
    world_size: int
    device: str
    directory: str
    parent_pid: int
    strict_collectives: bool
    generation: int = 0
    """The process group to join at start (``store.<generation>``), the one the other ranks
    join: 0 for a new pool, the next one for a rank respawned into a running pool."""
    gloo_interface: str = ""
    """``GLOO_SOCKET_IFNAME`` for this rank's gloo groups (the driver's choice)."""
    backend: str = "gloo"
    """The process-group backend (resolved in the driver: a registered name)."""
    backend_plugins: tuple[str, ...] = ()
    """Modules imported before anything else in the rank (they may register the backend)."""
    faults: tuple[str, ...] = ()
    fault_files: tuple[str, ...] = ()
    reach_dir: str = ""
    """Where the rank records the DTensor ops it reaches (the driver's $DISTCONF_REACH_DIR)."""
    surface_dir: str = ""
    """Where the rank records the options it passes to the public API ($DISTCONF_SURFACE_DIR)."""
    rendezvous: str = "file"
    """``file``: a FileStore per generation in ``directory`` (the process runner); ``env``:
    torchrun's store (``MASTER_ADDR``/``MASTER_PORT``), a key prefix per generation."""
    device_index: int | None = None
    """The rank's device (default: ``rank``; under torchrun, ``LOCAL_RANK``)."""
    round: int = 0
    """Under torchrun, the driver's count of the sets of agents that attached: the store
    prefix of this set's groups."""


def gloo_interface() -> str:
    """The network interface(s) gloo uses in every rank, chosen by the driver when a pool
    starts: ``$GLOO_SOCKET_IFNAME`` when its environment sets it, else the loopback
    interface."""
    names = _interface_names()
    chosen = os.environ.get(GLOO_INTERFACE_VAR, "")
    if not chosen:
        return _loopback_interface(names)
    if names and not set(chosen.split(",")) <= set(names):
        raise invalid(
            GLOO_INTERFACE_VAR,
            chosen,
            f"names of network interfaces of this machine, comma-separated (it has {names})",
        )
    return chosen


def _interface_names() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def _loopback_interface(names: list[str]) -> str:
    for name in names:
        if _ipv4_address(name) == "127.0.0.1":
            return name
    for name in ("lo", "lo0"):
        if name in names:
            return name
    raise WorldStartError(
        "no loopback network interface found for gloo: set GLOO_SOCKET_IFNAME to the "
        "interface the rank processes should talk over"
    )


def _ipv4_address(interface: str) -> str | None:
    """The interface's IPv4 address (Linux only: elsewhere None)."""
    if not sys.platform.startswith("linux"):
        return None
    import fcntl
    import struct

    siocgifaddr = 0x8915
    request = struct.pack("256s", interface.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            reply = fcntl.ioctl(probe.fileno(), siocgifaddr, request)
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])


def _is_release(exc: BaseException) -> bool:
    if not isinstance(exc, RuntimeError):
        return False
    message = str(exc)
    return any(text in message for text in _PEER_GONE) or any(
        pattern.search(message) for pattern in _MONITORED_BARRIER_RELEASES
    )


def _disconnect_gloo_pairs(keep_fd: int = -1, keep_port: int = -1) -> None:
    """Shut down every connected TCP socket of this process: gloo's connections to its peers.

    gloo closes a group's connections only when the last reference to the group goes (in
    torch 2.13 its ``shutdown`` and ``abort`` leave them open), and a DeviceMesh holds its
    groups (``_pg_registry``) while the rank context or DTensor's caches hold the mesh: after
    ``destroy_process_group`` such a group still connects us to peers blocked in a collective
    with us. A shut-down socket reads as "Connection closed by peer" on both ends, as when a
    peer process dies, which gloo survives. Listening sockets are left alone, and so are the
    driver's connection (``keep_fd``) and the store's (either end on ``keep_port``)."""
    for descriptor in _open_descriptors():
        if descriptor == keep_fd:
            continue
        try:
            if not stat.S_ISSOCK(os.fstat(descriptor).st_mode):
                continue
            duplicate = os.dup(descriptor)
        except OSError:
            continue  # closed meanwhile
        with socket.socket(fileno=duplicate) as connection:
            inet = connection.family in (socket.AF_INET, socket.AF_INET6)
            if inet and _connected(connection) and not _on_port(connection, keep_port):
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)


def _open_descriptors() -> list[int]:
    for listing in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return [int(name) for name in os.listdir(listing) if name.isdigit()]
    return []


def _on_port(connection: socket.socket, port: int) -> bool:
    try:
        return port in (connection.getsockname()[1], connection.getpeername()[1])
    except OSError:
        return False


def _connected(connection: socket.socket) -> bool:
    if connection.type != socket.SOCK_STREAM:
        return False
    try:
        connection.getpeername()
    except OSError:
        return False  # listening, or never connected
    return True


def stack_path(directory: str, rank: int) -> str:
    """Where the rank's faulthandler writes; the rank creates it when its ``main`` starts."""
    return os.path.join(directory, f"stack.{rank}.txt")


def stderr_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"stderr.{rank}.txt")


class RankFiles:
    """One rank's stack and stderr files in ``directory``, each read from where the last read
    stopped: what the rank process now running wrote, not its predecessors."""

    def __init__(self, directory: str, rank: int) -> None:
        self.stack, self.stderr = stack_path(directory, rank), stderr_path(directory, rank)
        self.stack_offset = self.stderr_offset = 0

    def new_process(self) -> None:
        """A new process of this rank starts: its stack file anew (it makes it when it reaches
        its ``main``), its stderr read from here on."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.stack)
        self.stack_offset = 0
        try:
            self.stderr_offset = os.path.getsize(self.stderr)
        except OSError:
            self.stderr_offset = 0

    def new_stack_text(self) -> str:
        try:
            with open(self.stack, encoding="utf-8", errors="replace") as handle:
                handle.seek(self.stack_offset)
                text = handle.read()
                self.stack_offset = handle.tell()
        except OSError:
            return ""
        return text

    def dump_stack(self, pid: int) -> str:
        """Ask faulthandler in process ``pid`` for every thread's stack and read it back."""
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            return "(process gone)"
        deadline = time.monotonic() + _STACK_WAIT
        text = ""
        while time.monotonic() < deadline:
            time.sleep(0.05)
            text += self.new_stack_text()
            if text.rstrip().endswith(")") or "File" in text:
                time.sleep(0.05)
                return text + self.new_stack_text()
        return text or "(no stack: the rank did not answer the stack signal)"

    def stderr_tail(self) -> str:
        """The last lines the process wrote to its stderr, indented for a failure's text."""
        try:
            with open(self.stderr, "rb") as handle:
                handle.seek(self.stderr_offset)
                text = handle.read().decode("utf-8", errors="replace")
        except OSError:
            return ""
        lines = text.rstrip().splitlines()[-_STDERR_LINES:]
        if not lines:
            return "\n  (its stderr is empty)"
        return f"\n  last {len(lines)} lines of its stderr:\n" + "\n".join(
            f"  | {line}" for line in lines
        )


def process_name(directory: str, rank: int) -> str:
    """The multiprocessing name of rank ``rank`` of the pool in ``directory``."""
    return f"distconf-rank{rank}:{directory}"


def _stderr_path_of(name: str) -> str | None:
    """Where the process named ``name`` writes its stderr, if it is a distconf rank."""
    match = _PROCESS_NAME.fullmatch(name)
    if match is None:
        return None
    return stderr_path(match["directory"], int(match["rank"]))


def _redirect_stderr(path: str) -> None:
    global _stderr_now
    if _stderr_now == path:
        return
    sys.stderr.flush()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    _stderr_now = path


def _imported_by_forkserver() -> bool:
    """Whether this import is the forkserver's preload (``forkserver.main`` is on the stack)."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    if forkserver is None:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _capture_stderr_from_birth() -> None:
    """In the forkserver: every distconf rank it forks redirects its stderr before
    multiprocessing prepares it (and re-imports the driver's ``__main__``, where an unguarded
    driver script fails)."""
    from multiprocessing import spawn

    prepare = spawn.prepare

    def redirected_prepare(data: Mapping[str, Any]) -> None:
        path = _stderr_path_of(str(data.get("name", "")))
        if path is not None:
            _redirect_stderr(path)
        prepare(data)

    spawn.prepare = redirected_prepare


def describe_exit(code: int | None) -> str:
    """A process's exit code in words."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def in_collective(stack: str) -> bool:
    """Whether a faulthandler stack shows the rank inside a torch.distributed call."""
    return any(marker in stack for marker in _COLLECTIVE_FRAMES)


def main(config: RankConfig, conn: Connection) -> None:
    """Entry point of a rank process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    owner_watch = _exit_with_parent(config.parent_pid, config.directory)
    _redirect_stderr(stderr_path(config.directory, config.rank))
    if config.gloo_interface:
        # gloo reads it when a group is made: its sockets bind to this interface's address
        os.environ[GLOO_INTERFACE_VAR] = config.gloo_interface
    stacks = open(stack_path(config.directory, config.rank), "w")  # noqa: SIM115 (process-long)
    faulthandler.enable(stacks, all_threads=True)
    faulthandler.register(STACK_SIGNAL, stacks, all_threads=True)
    from harness.torchkit import devices

    try:
        devices.import_plugins(config.backend_plugins)
    except BaseException as exc:
        outcome = error_outcome(config.rank, exc, keep=False, context=PLUGIN_FAILURE)
        conn.send_bytes(pickle.dumps(("ready", outcome)))
        return
    try:
        rank = _Rank(config)
    except BaseException as exc:
        conn.send_bytes(pickle.dumps(("ready", error_outcome(config.rank, exc, keep=False))))
        return
    conn.send_bytes(pickle.dumps(("ready", RankOutcome(config.rank, "ok"))))
    if rank.serve(conn) == "driver gone":
        # Gone with the directory's owner (the process runner's driver, killed outright)?
        # Then the watch removes the directory and ends this process in a moment.
        owner_watch.join(_OWNER_WAIT)


def _exit_with_parent(parent_pid: int, directory: str) -> threading.Thread:
    """A rank never outlives its driver, even when it is stuck in a collective, and removes
    the directory its driver can no longer remove (killed outright, say). (The driver is not
    the rank's parent: the forkserver is.)"""

    def watch() -> None:
        if hasattr(os, "pidfd_open"):  # Linux: no polling, no pid reuse
            with contextlib.suppress(ProcessLookupError):
                select.select([os.pidfd_open(parent_pid)], [], [])  # readable at its exit
        else:
            while _alive(parent_pid):
                time.sleep(0.5)
        shutil.rmtree(directory, ignore_errors=True)
        os._exit(1)

    watcher = threading.Thread(target=watch, name="distconf-parent-watch", daemon=True)
    watcher.start()
    return watcher


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class _Rank:
    def __init__(self, config: RankConfig) -> None:

        from harness import faults
        from harness.torchkit import devices, internals
        from harness.torchkit.context import RankContext

        internals.quiet_known_warnings()
        if config.reach_dir:
            reach.install(config.reach_dir)
        if config.surface_dir:
            surface.install(config.surface_dir)
            surface.begin(surface.RANK_PROCESSES)
        # a mutation run: the driver's faults, here too
        faults.apply_in_rank(config.faults, config.fault_files)
        self.config = config
        index = config.rank if config.device_index is None else config.device_index
        device = devices.rank_device(config.device, index)  # one device per rank
        self.ctx = RankContext(
            rank=config.rank,
            world_size=config.world_size,
            device=device,
            runner="torchrun" if config.rendezvous == "env" else "processes",
        )
        self.driver_fd = -1
        self._base_store: Any = None
        self.join_group(config.generation)

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
        store = self._store(generation)
        accelerator = self.ctx.device.type != "cpu"
        # init_process_group wraps sys.excepthook each time; a rank reset in place hundreds
        # of times would otherwise report an uncaught error through as many wrappers.
        excepthook = sys.excepthook
        try:
            dist.init_process_group(
                self.config.backend,
                rank=self.config.rank,
                world_size=self.config.world_size,
                store=store,
                timeout=_GROUP_TIMEOUT,
                device_id=self.ctx.device if accelerator else None,
            )
        finally:
            sys.excepthook = excepthook
        made = dist.get_backend()
        if made != self.config.backend:  # a plugin that registered its name to another
            raise WorldStartError(
                f"the process group runs {made!r}, not the backend asked for "
                f"({self.config.backend!r})"
            )

    def _store(self, generation: int) -> Any:
        """The rendezvous of group ``generation``."""
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d

        config = self.config
        if config.rendezvous == "file":
            path = os.path.join(config.directory, f"store.{generation}")
            return c10d.FileStore(path, config.world_size)
        if self._base_store is None:  # releasing peers leaves its sockets (on MASTER_PORT)
            rendezvous = dist.rendezvous  # type: ignore[attr-defined]
            self._base_store, _, _ = next(rendezvous("env://", timeout=_STORE_TIMEOUT))
        return c10d.PrefixStore(f"distconf/{config.round}/{generation}/", self._base_store)

    def serve(self, conn: Connection) -> str:
        """Calls and control messages until the driver says stop; how it ended."""
        self.driver_fd = conn.fileno()
        while True:
            try:
                kind, body = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return "driver gone"
            if kind == "stop":
                self.leave()
                return "stopped"
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
        finally:
            reach.flush()
            surface.flush()
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
        """Destroy our groups and close their connections, so that peers blocked in a
        collective with us (of the default group or of a DeviceMesh) fail now instead of at
        gloo's timeout."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        if self.config.backend != "nccl":  # nccl's destroy aborts its communicators
            env_store = self.config.rendezvous == "env"
            store_port = int(os.environ.get("MASTER_PORT", -1)) if env_store else -1
            _disconnect_gloo_pairs(self.driver_fd, store_port)

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


if _imported_by_forkserver():
    _capture_stderr_from_birth()
