"""A rank agent: what ``python -m harness.attach`` runs in each process torchrun starts.

The agent is a supervisor of one rank process. It reads who it is from torchrun's
environment, connects to the driver twice over the authenticated channel (``channel``): a
control connection it keeps, and a rank connection it hands to the rank process it starts
(``_rank_process.main``, the process runner's rank code, on a socket instead of a pipe,
joining the process group through torchrun's store). On the control connection it answers
the driver's requests for the rank's Python stack (faulthandler, as the process runner does),
starts the rank anew when the driver asks (it ran past a deadline), and reports how the rank
ended when it dies on its own; then the agent ends the same way, so that torchrun sees the
failure and restarts the workers (``--max-restarts``) or gives up.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from harness.runners import _rank_process
from harness.runners.torchrun import channel
from harness.torchkit import reach

CONNECT_TIMEOUT = 120.0


def agent_info() -> channel.AgentInfo:
    """This process's place in torchrun's world, from the environment torchrun sets."""
    env = os.environ
    missing = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if name not in env]
    if missing:
        raise SystemExit(
            f"harness.attach runs under torchrun: {', '.join(missing)} not set "
            "(torchrun ... -m harness.attach --driver HOST:PORT)"
        )
    return channel.AgentInfo(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env["LOCAL_RANK"]),
        node=int(env.get("GROUP_RANK", "0")),
        host=socket.gethostname(),
        restart=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")),
        pid=os.getpid(),
    )


def _connect(driver: tuple[str, int], token: bytes, timeout: float) -> Connection:
    """Connect, retrying while the driver is not listening yet or not greeting yet (busy
    admitting other connections)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return channel.connect(driver, token, timeout=channel.HANDSHAKE_TIMEOUT)
        except (ConnectionRefusedError, channel.NoGreeting):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _use_group_store() -> None:
    """Where the driver hosts the store of the ranks' groups (the torchrun it started here:
    on loopback, where torchrun's own would listen on every interface), the rank process
    meets its peers there, as a client of an agent store, instead of torchrun's."""
    address = os.environ.get(channel.GROUP_STORE_VAR)
    if not address:
        return
    host, port = channel.parse_address(channel.GROUP_STORE_VAR, address)
    os.environ.update(
        MASTER_ADDR=host, MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE=str(True)
    )


class _Supervisor:
    def __init__(self, driver: tuple[str, int], token: bytes, info: channel.AgentInfo) -> None:
        self.driver, self.token, self.info = driver, token, info
        self.serial = 0
        self.child: Any = None
        self.dir = tempfile.mkdtemp(prefix="distconf-agent-")
        try:
            self.control = _connect(driver, token, CONNECT_TIMEOUT)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.files = _rank_process.RankFiles(self.dir, info.rank)

    def attach(self) -> None:
        """Say who this agent is, and take the driver's settings."""
        self.control.send_bytes(pickle.dumps(("supervisor", self.info)))
        kind, body = pickle.loads(self.control.recv_bytes())
        if kind != "settings":
            raise SystemExit(f"harness.attach: the driver refused this agent: {body}")
        self.settings: channel.AgentSettings = body

    def start_rank(self, generation: int) -> None:
        """A rank process on a new rank connection, joining group ``generation``."""
        self.serial += 1
        conn = _connect(self.driver, self.token, CONNECT_TIMEOUT)
        conn.send_bytes(pickle.dumps(("rank", self.info, self.serial)))
        info, settings = self.info, self.settings
        config = _rank_process.RankConfig(
            rank=info.rank,
            world_size=info.world_size,
            device=settings.device,
            directory=self.dir,
            parent_pid=os.getpid(),
            strict_collectives=settings.strict_collectives,
            generation=generation,
            gloo_interface=os.environ.get(_rank_process.GLOO_INTERFACE_VAR, ""),
            backend=settings.backend,
            backend_plugins=settings.backend_plugins,
            rendezvous="env",
            device_index=info.local_rank,
            round=settings.round,
            reach_dir=os.environ.get(reach.ENV_VAR, ""),
        )
        self.files.new_process()
        context = multiprocessing.get_context("spawn")
        self.child = context.Process(
            target=_rank_process.main, args=(config, conn), name=f"distconf-rank{info.rank}"
        )
        try:
            self.child.start()
        finally:
            conn.close()

    def serve(self) -> int:
        """Answer the driver until it says stop or goes; the exit code the agent ends with
        (negative: the signal that killed the rank)."""
        self.start_rank(0)
        while True:
            ready = wait([self.control, self.child.sentinel])
            if self.control in ready:
                try:
                    kind, argument = pickle.loads(self.control.recv_bytes())
                except (EOFError, OSError):
                    return 0  # the driver is gone: nothing left to serve
                if kind == "stop":
                    return self.stop(float(argument))
                self.answer(kind, argument)
            elif self.child.sentinel in ready:
                self.child.join()
                code = int(self.child.exitcode)
                if code == 0:
                    return 0  # a rank leaves only when told to, or when the driver is gone
                with contextlib.suppress(OSError):
                    self.control.send_bytes(pickle.dumps(("exited", (code, self.exit_story(code)))))
                return code

    def answer(self, kind: str, argument: Any) -> None:
        if kind == "stack":
            self.control.send_bytes(pickle.dumps(("stack", self.files.dump_stack(self.child.pid))))
        elif kind == "respawn":
            self.kill_rank()
            self.start_rank(int(argument))
        else:
            raise AssertionError(f"the driver sent an unknown request {kind!r}")

    def exit_story(self, code: int) -> str:
        how = _rank_process.describe_exit(code)
        story = f"{self.info.where()}: its rank process (pid {self.child.pid}) {how}"
        stack = self.files.new_stack_text().strip()
        if stack:
            story += f"\n{stack}"
        return story + self.files.stderr_tail()

    def stop(self, grace: float) -> int:
        """The driver is done: let the rank leave within ``grace`` (it was told to), or end
        it."""
        self.child.join(grace)
        self.kill_rank()
        return 0

    def kill_rank(self) -> None:
        if self.child is not None and self.child.is_alive():
            self.child.kill()
        if self.child is not None:
            self.child.join()

    def close(self) -> None:
        try:
            self.kill_rank()
            self.control.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def _leave(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # torchrun stops the workers: clean up on the way out


def _end_like(code: int) -> int:
    """Exit as the rank did: by its signal (torchrun then names it), or with its code."""
    if code < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
        return 128 - code
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harness.attach",
        description="serve a distconf driver as one rank: run under torchrun",
    )
    parser.add_argument("--driver", required=True, help="the driver's HOST:PORT (its --listen)")
    parser.add_argument(
        "--token-file",
        type=Path,
        default=None,
        help=f"file holding the session's token (default: ${channel.TOKEN_VAR})",
    )
    args = parser.parse_args(argv)
    try:
        driver = channel.parse_address("--driver", args.driver)
        token = channel.load_token(args.token_file)
    except Exception as exc:
        parser.error(str(exc))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # torchrun stops its workers with SIGTERM
    signal.signal(signal.SIGTERM, _leave)
    _use_group_store()
    supervisor = _Supervisor(driver, token, agent_info())
    try:
        supervisor.attach()
        code = supervisor.serve()
    finally:
        supervisor.close()
    sys.stdout.flush()
    return _end_like(code)
