"""The authenticated channel between the driver and the rank agents torchrun starts.

Pickles read from a network are code execution, so no pickle crosses a connection before both
ends proved they hold the session's token: the driver sends a nonce, the agent answers with
an HMAC-SHA256 of it under the token and a nonce of its own, the driver answers that one
(each end's proof names its role, so neither can reflect the other's). After the handshake
the socket carries ``multiprocessing.connection`` frames; the first, the agent's hello, is
read by an unpickler that builds nothing but an ``AgentInfo``. The driver's end, which
refuses and logs whatever fails this, is ``listener``. The channel authenticates its peers;
it does not encrypt, so run it on a network you trust.

The token comes from ``$DISTCONF_TOKEN`` or a file (``--token-file``); the single-host
launcher makes one and hands its file to the agents.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import ipaddress
import logging
import os
import pickle
import secrets
import socket
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from harness.errors import invalid, require

TOKEN_VAR = "DISTCONF_TOKEN"
GROUP_STORE_VAR = "DISTCONF_GROUP_STORE"
"""``HOST:PORT`` of the store the ranks' groups meet in, where the driver hosts it (the
torchrun it starts here): the agents use it in place of torchrun's ``MASTER_ADDR``/``PORT``."""
MIN_TOKEN_CHARS = 16
HANDSHAKE_TIMEOUT = 10.0
"""Seconds a connection has, from its arrival, to prove the token and send its hello; and
seconds an agent waits for each of the driver's handshake messages."""
MAX_HELLO_BYTES = 64 * 1024
MAGIC = b"distconf-attach/1\n"
NONCE_BYTES = 32
PROOF_BYTES = 32
log = logging.getLogger("distconf.torchrun")
"""The torchrun runner's notices: where the driver waits, refused connections, a listener
beyond loopback (warnings: what an operator must see; the plugin puts them on the terminal)."""


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


def proof(token: bytes, role: bytes, nonce: bytes) -> bytes:
    """What ``role`` (``b"agent"`` or ``b"driver"``) answers to the other end's ``nonce``."""
    return hmac.new(token, role + nonce, hashlib.sha256).digest()


def proves(token: bytes, role: bytes, nonce: bytes, answer: bytes) -> bool:
    return hmac.compare_digest(answer, proof(token, role, nonce))


class NoGreeting(ConnectionError):
    """The driver took the connection but sent no greeting: it is busy admitting others (the
    connection waits in its queue) or not ready yet; an agent tries again."""


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
        try:
            greeting = _receive_exactly(sock, len(MAGIC) + NONCE_BYTES)
        except (TimeoutError, ConnectionError) as exc:
            raise NoGreeting(f"{address} sent no greeting ({exc})") from None
        if not greeting.startswith(MAGIC):
            raise ConnectionError(f"{address} is not a distconf driver")
        ours = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(proof(token, b"agent", greeting[len(MAGIC) :]) + ours)
        answer = _receive_exactly(sock, PROOF_BYTES)
        if not proves(token, b"driver", ours, answer):
            raise ConnectionError(f"the driver at {address} did not prove it holds the token")
        sock.settimeout(None)
        return Connection(sock.detach())
    except BaseException:
        sock.close()
        raise


class _HelloUnpickler(pickle.Unpickler):
    """A hello builds tuples, strings, ints and one ``AgentInfo``: no other class is looked
    up, so loading it runs no code of the sender's choosing."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (__name__, AgentInfo.__name__):
            return AgentInfo
        raise pickle.UnpicklingError(f"it names {module}.{name}, not an AgentInfo")


def load_hello(data: bytes) -> Any:
    """An agent's first message, unpickled without running anything (``_HelloUnpickler``);
    what does not load raises ``ValueError`` saying why."""
    try:
        return _HelloUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # a malformed pickle raises almost any type
        raise ValueError(f"its hello does not unpickle ({type(exc).__name__}: {exc})") from None
