"""torchrun started on this machine for the torchrun runner (``--nproc-per-node``): one
torchrun process per "node" (``--nnodes``, all on this machine), each node's workers
``python -m harness.attach`` pointed at the driver's listener.

Nothing it starts listens beyond loopback. A TCPStore server binds every interface (torch
binds a given address only to a listening socket handed to it), so torchrun hosts none: its
rendezvous is a file store in the launcher's directory (``--rdzv-conf=store_type=file``), its
agent store is switched off (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``), and the ranks' groups
meet in a TCPStore this process hosts on a socket bound to 127.0.0.1 (the agents point their
ranks at it: ``channel.GROUP_STORE_VAR``); gloo runs on the loopback interface unless
``GLOO_SOCKET_IFNAME`` names another.

Everything torchrun and its workers write goes into one directory, removed on ``stop``:
each node's output (``node<N>.log``, shown when it fails), the token file, torchelastic's
logs (``--log-dir``) and every temporary file (``TMPDIR``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.runners.torchrun import channel

_STOP_GRACE = 30.0
_TERM_WAIT = 10.0
_LOG_LINES = 30
_LOOPBACK = "127.0.0.1"
_HARNESS_ROOT = str(Path(__file__).resolve().parents[2])


def loopback_store() -> tuple[Any, int]:
    """A TCPStore server listening on 127.0.0.1 only, and its port (closed when dropped)."""
    from torch._C import _distributed_c10d as c10d

    with socket.create_server((_LOOPBACK, 0)) as listening:
        port = int(listening.getsockname()[1])
        descriptor = listening.detach()
    try:
        store = c10d.TCPStore(
            _LOOPBACK, port, is_master=True, wait_for_workers=False, master_listen_fd=descriptor
        )
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(descriptor)
        raise
    return store, port


class LocalTorchrun:
    """``nnodes`` torchrun processes of ``nproc_per_node`` workers each."""

    def __init__(self, token_file: Path | None) -> None:
        """A directory for everything torchrun writes, and the token: ``token_file``'s, or a
        new one."""
        self.dir = Path(tempfile.mkdtemp(prefix="distconf-torchrun-"))
        self.processes: list[subprocess.Popen[bytes]] = []
        self._store: Any = None
        try:
            if token_file is None:
                token_file = self.dir / "token"
                fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    handle.write(channel.new_token())
            self.token_file = token_file
            self.token = channel.load_token(token_file)
        except BaseException:
            self._remove_files()
            raise

    def start(
        self, *, nnodes: int, nproc_per_node: int, max_restarts: int, driver: tuple[str, int]
    ) -> None:
        host, port = driver
        self.command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.dir / 'rendezvous'}",
            "--rdzv-conf=store_type=file",
            f"--rdzv-id=distconf-{secrets.token_hex(4)}",
            f"--local-addr={_LOOPBACK}",
            f"--log-dir={self.dir / 'torchelastic'}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.2",
            "-m",
            "harness.attach",
            f"--driver={host}:{port}",
            f"--token-file={self.token_file}",
        ]
        try:
            self._store, store_port = loopback_store()
            env = self._environment(store_port)
            for node in range(nnodes):
                self.processes.append(self._start(node, env))
        except BaseException:
            self.stop()
            raise

    def _environment(self, store_port: int) -> dict[str, str]:
        from harness.runners._rank_process import GLOO_INTERFACE_VAR, gloo_interface

        temporary = self.dir / "tmp"
        temporary.mkdir()
        env = dict(os.environ)
        env.update(
            {
                "PYTHONPATH": os.pathsep.join(filter(None, [_HARNESS_ROOT, env.get("PYTHONPATH")])),
                "TMPDIR": str(temporary),
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                channel.GROUP_STORE_VAR: f"{_LOOPBACK}:{store_port}",
                GLOO_INTERFACE_VAR: gloo_interface(),
            }
        )
        return env

    def _start(self, node: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.log_path(node), "wb") as log:
            return subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def log_path(self, node: int) -> Path:
        return self.dir / f"node{node}.log"

    def finished(self) -> bool:
        """Every torchrun process has exited."""
        return all(process.poll() is not None for process in self.processes)

    def story(self) -> str:
        """How each torchrun process stands, and the end of its log."""
        parts = []
        for node, process in enumerate(self.processes):
            code = process.poll()
            state = "running" if code is None else f"exited with code {code}"
            try:
                lines = self.log_path(node).read_text(errors="replace").rstrip().splitlines()
            except OSError:
                lines = []
            tail = "\n".join(f"  | {line}" for line in lines[-_LOG_LINES:])
            parts.append(f"torchrun node {node}: {state}\n{tail}")
        return "\n".join(parts)

    def stop(self, grace: float = _STOP_GRACE) -> None:
        """Let torchrun end (the driver told its agents to stop), then end what remains, and
        remove the directory, however the waits end (an interrupt among them)."""
        try:
            deadline = time.monotonic() + grace
            for process in self.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(max(0.0, deadline - time.monotonic()))
        finally:
            try:
                self._end_remaining()
            finally:
                self._store = None  # its server closes with it
                self._remove_files()

    def _end_remaining(self) -> None:
        for how, wait in ((signal.SIGTERM, _TERM_WAIT), (signal.SIGKILL, None)):
            # SIGTERM: torchrun stops its workers itself; SIGKILL: what is left of it
            for process in self.processes:
                if process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, how)
            for process in self.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(wait)

    def _remove_files(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
