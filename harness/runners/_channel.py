"""The authenticated channel between the driver and the rank agents torchrun starts.

Pickles read from a network are code execution, so no pickle crosses a connection before both
ends proved they hold the session's token: the driver sends a nonce, the agent answers with
an HMAC-SHA256 of it under the token and a nonce of its own, the driver answers that one
(each end's proof names its role, so neither can reflect the other's). A connection that
fails this is closed, and the driver logs it and keeps it for its attach error. After the
handshake the socket carries ``multiprocessing.connection`` frames. The channel
authenticates its peers; it does not encrypt, so run it on a network you trust.

The token comes from ``$DISTCONF_TOKEN`` or a file (``--token-file``); the single-host
launcher makes one and hands its file to the agents.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import pickle
import queue
import secrets
import socket
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from harness.errors import WorldStartError, invalid, require

TOKEN_VAR = "DISTCONF_TOKEN"
MIN_TOKEN_CHARS = 16
HANDSHAKE_TIMEOUT = 10.0
_MAGIC = b"distconf-attach/1\n"
_NONCE = 32
_ACCEPT_POLL = 0.2
log = logging.getLogger("distconf.torchrun")


@dataclass(frozen=True, kw_only=True)
class AgentInfo:
    """Who an agent is: torchrun's environment of the rank it serves."""

    rank: int
    world_size: int
    local_rank: int
    node: int
    """torchrun's ``GROUP_RANK``: which node (agent group) the rank runs on."""
    host: str
    restart: int
    """``TORCHELASTIC_RESTART_COUNT``: how often this node's torchrun restarted its workers
    after one of them failed."""
    max_restarts: int
    """``TORCHELASTIC_MAX_RESTARTS``: torchrun's ``--max-restarts``."""
    pid: int

    def where(self) -> str:
        return f"rank {self.rank} on node {self.node} ({self.host}, agent pid {self.pid})"


@dataclass(frozen=True, kw_only=True)
class AgentSettings:
    """What the driver tells an agent once it attached: how to make its rank."""

    device: str
    backend: str
    backend_plugins: tuple[str, ...] = ()
    strict_collectives: bool = False
    round: int = 0
    """Which attach of the driver's this is: the ranks' store prefix (torchrun's restart
    count differs between nodes: only the failing node's agent counts a restart)."""


def new_token() -> str:
    return secrets.token_hex(32)


def load_token(token_file: Path | None) -> bytes:
    """The session's token: the file's first line, else ``$DISTCONF_TOKEN``."""
    if token_file is not None:
        try:
            text = token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise invalid("token_file", str(token_file), f"a readable file ({exc})") from None
        name, shown = "token_file", str(token_file)
    else:
        text = os.environ.get(TOKEN_VAR, "").strip()
        name, shown = TOKEN_VAR, "<unset>" if not text else "<hidden>"
    require(
        len(text) >= MIN_TOKEN_CHARS,
        name,
        shown,
        f"a shared secret of at least {MIN_TOKEN_CHARS} characters for the torchrun runner "
        f"(set ${TOKEN_VAR} or pass --token-file)",
    )
    return text.encode()


def parse_address(name: str, text: str) -> tuple[str, int]:
    """``HOST:PORT`` (port 0: any free port) -> ``(host, port)``."""
    host, _, port = str(text).rpartition(":")
    ok = bool(host) and port.isdigit() and 0 <= int(port) < 2**16
    require(ok, name, text, "HOST:PORT, a port from 0 to 65535 (0: any free port)")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _digest(token: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, role + nonce, hashlib.sha256).digest()


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection during the handshake")
        data += chunk
    return data


def connect(address: tuple[str, int], token: bytes, timeout: float) -> Connection:
    """The agent's end: connect to the driver and prove the token both ways."""
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.settimeout(timeout)
        greeting = _receive_exactly(sock, len(_MAGIC) + _NONCE)
        if not greeting.startswith(_MAGIC):
            raise ConnectionError(f"{address} is not a distconf driver")
        ours = secrets.token_bytes(_NONCE)
        sock.sendall(_digest(token, b"agent", greeting[len(_MAGIC) :]) + ours)
        proof = _receive_exactly(sock, 32)
        if not hmac.compare_digest(proof, _digest(token, b"driver", ours)):
            raise ConnectionError(f"the driver at {address} did not prove it holds the token")
        sock.settimeout(None)
        return Connection(sock.detach())
    except BaseException:
        sock.close()
        raise


def _challenge(sock: socket.socket, token: bytes) -> bool:
    """The driver's end of the handshake: whether the peer proved the token."""
    sock.settimeout(HANDSHAKE_TIMEOUT)
    ours = secrets.token_bytes(_NONCE)
    sock.sendall(_MAGIC + ours)
    reply = _receive_exactly(sock, 32 + _NONCE)
    if not hmac.compare_digest(reply[:32], _digest(token, b"agent", ours)):
        return False
    sock.sendall(_digest(token, b"driver", reply[32:]))
    sock.settimeout(None)
    return True


class AgentListener:
    """The driver's listening socket: every connection authenticated in a thread of its
    own (a peer that stalls holds only its thread), then its first message (the hello)
    queued with the connection."""

    def __init__(self, address: tuple[str, int], token: bytes) -> None:
        self._token = token
        try:
            self._socket = socket.create_server(address, backlog=128)
        except OSError as exc:
            raise WorldStartError(
                f"the torchrun runner cannot listen on {address}: {exc}"
            ) from None
        self.address: tuple[str, int] = self._socket.getsockname()[:2]
        self.refused: list[str] = []
        self._arrivals: queue.Queue[tuple[Any, Connection]] = queue.Queue()
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="distconf-listener", daemon=True).start()

    def next(self, timeout: float) -> tuple[Any, Connection] | None:
        """The next authenticated connection's hello and the connection, or None."""
        try:
            return self._arrivals.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._socket.close()
        while True:
            try:
                _, conn = self._arrivals.get_nowait()
            except queue.Empty:
                return
            conn.close()

    def _accept(self) -> None:
        self._socket.settimeout(_ACCEPT_POLL)
        while not self._closed.is_set():
            try:
                sock, peer = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            threading.Thread(
                target=self._admit, args=(sock, peer), name="distconf-handshake", daemon=True
            ).start()

    def _admit(self, sock: socket.socket, peer: Any) -> None:
        who = f"{peer[0]}:{peer[1]}"
        try:
            proved = _challenge(sock, self._token)
        except (OSError, ConnectionError) as exc:
            self._refuse(sock, who, f"no handshake ({exc})")
            return
        if not proved:
            self._refuse(sock, who, "wrong token")
            return
        conn = Connection(sock.detach())
        try:
            if not conn.poll(HANDSHAKE_TIMEOUT):
                raise ConnectionError("no hello")
            hello = pickle.loads(conn.recv_bytes())
        except (OSError, EOFError, ConnectionError, pickle.UnpicklingError) as exc:
            conn.close()
            self._refuse(None, who, f"no hello after the handshake ({exc})")
            return
        if self._closed.is_set():
            conn.close()
            return
        self._arrivals.put((hello, conn))

    def _refuse(self, sock: socket.socket | None, who: str, why: str) -> None:
        if sock is not None:
            sock.close()
        self.refused.append(f"{who}: {why}")
        log.warning("distconf: refused a connection from %s to the torchrun listener: %s", who, why)
