"""torchrun started on this machine for the torchrun runner (``--nproc-per-node``): one
torchrun process per "node" (``--nnodes``, all on loopback), c10d rendezvous on a free port,
each node's workers ``python -m harness.attach`` pointed at the driver's listener. Its output
goes to ``node<N>.log`` in a temporary directory (shown when it fails), with the token file.
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

from harness.runners import _channel

_STOP_GRACE = 30.0
_TERM_WAIT = 10.0
_LOG_LINES = 30
_HARNESS_ROOT = str(Path(__file__).resolve().parents[2])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LocalTorchrun:
    """``nnodes`` torchrun processes of ``nproc_per_node`` workers each."""

    def __init__(self, token_file: Path | None) -> None:
        """A directory for the logs, and the token: ``token_file``'s, or a new one."""
        self.dir = Path(tempfile.mkdtemp(prefix="distconf-torchrun-"))
        self.processes: list[subprocess.Popen[bytes]] = []
        if token_file is None:
            token_file = self.dir / "token"
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(_channel.new_token())
        self.token_file = token_file
        self.token = _channel.load_token(token_file)

    def start(
        self, *, nnodes: int, nproc_per_node: int, max_restarts: int, driver: tuple[str, int]
    ) -> None:
        rendezvous = f"127.0.0.1:{free_port()}"
        host, port = driver
        self.command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rendezvous}",
            f"--rdzv-id=distconf-{secrets.token_hex(4)}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.2",
            "-m",
            "harness.attach",
            f"--driver={host}:{port}",
            f"--token-file={self.token_file}",
        ]
        try:
            for node in range(nnodes):
                self.processes.append(self._start(node))
        except BaseException:
            self.stop()
            raise

    def _start(self, node: int) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_HARNESS_ROOT, env.get("PYTHONPATH")]))
        # the first node hosts the rendezvous store; the others join it
        command = [*self.command[:3], f"--rdzv-conf=is_host={int(node == 0)}", *self.command[3:]]
        with open(self.log_path(node), "wb") as log:
            return subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
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
        """Let torchrun end (the driver told its agents to stop), then end what remains."""
        deadline = time.monotonic() + grace
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
        for how, wait in ((signal.SIGTERM, _TERM_WAIT), (signal.SIGKILL, None)):
            # SIGTERM: torchrun stops its workers itself; SIGKILL: what is left of it
            for process in self.processes:
                if process.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, how)
            for process in self.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(wait)
        shutil.rmtree(self.dir, ignore_errors=True)
