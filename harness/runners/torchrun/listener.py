"""The driver's end of the authenticated channel (``channel``): the listening socket and the
admission of each connection, up to its hello.

One thread serves every connection with a selector, so a peer that stalls holds no thread
and no thread ever needs starting while agents attach. At most ``max_handshakes``
connections are admitted at once (the others wait in the kernel's queue), each with one
deadline (``handshake_timeout``) for its whole handshake and hello, however slowly its bytes
come. A connection that fails (a wrong token, a closed socket, the deadline, a hello over
``MAX_HELLO_BYTES`` or one that does not load as an ``AgentInfo``) is closed, counted, kept
for the attach error and logged as a warning. Whatever goes wrong in the loop itself is
logged and the loop goes on: only ``close`` ends it.
"""

from __future__ import annotations

import contextlib
import queue
import secrets
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from harness.errors import WorldStartError, check_int, check_seconds
from harness.runners.torchrun.channel import (
    HANDSHAKE_TIMEOUT,
    MAGIC,
    MAX_HELLO_BYTES,
    NONCE_BYTES,
    PROOF_BYTES,
    load_hello,
    log,
    proof,
    proves,
)

MAX_HANDSHAKES = 64
REFUSALS_SHOWN = 50
"""Refused connections logged one by one (and kept for the attach error); those after are
counted, so that a flood does not flood the terminal."""
_BACKLOG = 128
_POLL = 0.2
_ACCEPT_BACKOFF = 0.2
"""After accept fails (no file descriptor left, say): the wait before it is tried again."""
_CLOSE_WAIT = 5.0
_LENGTH = struct.Struct("!i")
"""``multiprocessing.connection``'s frame header (-1: an 8-byte length follows)."""


class _Refused(Exception):
    """Why a connection being admitted is refused."""


@dataclass(eq=False)
class _Admission:
    """A connection being admitted: the agent's proof, then its hello's length, then the
    hello, all before ``deadline``."""

    sock: socket.socket
    who: str
    deadline: float
    nonce: bytes
    outgoing: bytes
    stage: str = "proof"
    wanted: int = PROOF_BYTES + NONCE_BYTES
    received: bytearray = field(default_factory=bytearray)

    def events(self) -> int:
        return selectors.EVENT_READ | (selectors.EVENT_WRITE if self.outgoing else 0)


class AgentListener:
    """The driver's listening socket: connections admitted (see the module docstring), then
    each authenticated connection's hello queued with the connection."""

    def __init__(
        self,
        address: tuple[str, int],
        token: bytes,
        *,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_handshakes: int = MAX_HANDSHAKES,
    ) -> None:
        check_seconds("handshake_timeout", handshake_timeout)
        check_int("max_handshakes", max_handshakes)
        self._token, self._timeout, self._max = token, handshake_timeout, max_handshakes
        try:
            self._socket = socket.create_server(address, backlog=_BACKLOG)
        except OSError as exc:
            raise WorldStartError(
                f"the torchrun runner cannot listen on {address}: {exc}"
            ) from None
        self._socket.setblocking(False)
        self.address: tuple[str, int] = self._socket.getsockname()[:2]
        self.refused: list[str] = []
        """The first ``REFUSALS_SHOWN`` refused connections: who, and why."""
        self.refused_count = 0
        self._lock = threading.Lock()
        self._arrivals: queue.Queue[tuple[Any, Connection]] = queue.Queue()
        self._admitting: dict[socket.socket, _Admission] = {}
        self._selector = selectors.DefaultSelector()
        self._wake, self._waker = socket.socketpair()
        self._wake.setblocking(False)
        self._selector.register(self._wake, selectors.EVENT_READ)
        self._listening = False
        self._accept_after = 0.0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="distconf-listener", daemon=True)
        try:
            self._thread.start()
        except RuntimeError as exc:
            self._release()
            raise WorldStartError(f"the torchrun runner cannot start its listener: {exc}") from None

    def next(self, timeout: float) -> tuple[Any, Connection] | None:
        """The next authenticated connection's hello and the connection, or None."""
        try:
            return self._arrivals.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None

    def refuse(self, who: str, why: str) -> None:
        """Count and log a refused connection (the caller closed it)."""
        with self._lock:
            self.refused_count += 1
            count = self.refused_count
            if count <= REFUSALS_SHOWN:
                self.refused.append(f"{who}: {why}")
        if count <= REFUSALS_SHOWN:
            log.warning(
                "distconf: refused a connection from %s to the torchrun listener: %s", who, why
            )
        elif count == REFUSALS_SHOWN + 1:
            log.warning(
                "distconf: the torchrun listener refused more than %d connections: those "
                "after are counted (the results' end record), not shown",
                REFUSALS_SHOWN,
            )

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._waker.send(b"\0")
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(_CLOSE_WAIT)
        self._release()
        while True:
            try:
                _, conn = self._arrivals.get_nowait()
            except queue.Empty:
                return
            conn.close()

    def _release(self) -> None:
        for sock in (self._socket, self._wake, self._waker):
            with contextlib.suppress(OSError):
                sock.close()

    # --- the listener's thread ---------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._closed.is_set():
                try:
                    self._step()
                except Exception:
                    log.exception("distconf: the torchrun listener goes on after an error")
                    time.sleep(_POLL)
        finally:
            for admission in list(self._admitting.values()):
                self._drop(admission)
            with contextlib.suppress(OSError):
                self._selector.close()

    def _step(self) -> None:
        now = time.monotonic()
        for admission in [a for a in self._admitting.values() if a.deadline <= now]:
            self._refuse(admission, self._overdue(admission))
        self._listen_while_there_is_room(now)
        deadlines = [a.deadline - now for a in self._admitting.values()]
        for key, events in self._selector.select(max(0.0, min([_POLL, *deadlines]))):
            if key.fileobj is self._socket:
                self._accept()
            elif key.fileobj is self._wake:
                with contextlib.suppress(OSError):
                    self._wake.recv(64)
            else:
                self._advance(key.data, events)

    def _listen_while_there_is_room(self, now: float) -> None:
        room = len(self._admitting) < self._max and now >= self._accept_after
        if room and not self._listening:
            self._selector.register(self._socket, selectors.EVENT_READ)
        elif self._listening and not room:
            self._selector.unregister(self._socket)
        self._listening = room

    def _accept(self) -> None:
        while len(self._admitting) < self._max and not self._closed.is_set():
            try:
                sock, peer = self._socket.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("distconf: the torchrun listener cannot accept now (%s)", exc)
                self._accept_after = time.monotonic() + _ACCEPT_BACKOFF
                return
            self._begin(sock, f"{peer[0]}:{peer[1]}")

    def _begin(self, sock: socket.socket, who: str) -> None:
        nonce = secrets.token_bytes(NONCE_BYTES)
        admission = _Admission(
            sock, who, time.monotonic() + self._timeout, nonce, outgoing=MAGIC + nonce
        )
        try:
            sock.setblocking(False)
            self._selector.register(sock, admission.events(), admission)
        except (OSError, ValueError) as exc:
            sock.close()
            self.refuse(who, f"it could not be served ({exc})")
            return
        self._admitting[sock] = admission

    def _advance(self, admission: _Admission, events: int) -> None:
        try:
            if events & selectors.EVENT_WRITE and admission.outgoing:
                sent = admission.sock.send(admission.outgoing)
                admission.outgoing = admission.outgoing[sent:]
            if events & selectors.EVENT_READ:
                self._read(admission)
        except BlockingIOError:
            pass
        except _Refused as exc:
            self._refuse(admission, str(exc))
            return
        except OSError as exc:
            self._refuse(admission, f"no handshake ({exc})")
            return
        if admission.sock in self._admitting:
            self._selector.modify(admission.sock, admission.events(), admission)

    def _read(self, admission: _Admission) -> None:
        chunk = admission.sock.recv(admission.wanted - len(admission.received))
        if not chunk:
            raise _Refused(f"it closed the connection {self._where(admission)}")
        admission.received += chunk
        if len(admission.received) < admission.wanted:
            return
        data = bytes(admission.received)
        admission.received.clear()
        if admission.stage == "proof":
            if not proves(self._token, b"agent", admission.nonce, data[:PROOF_BYTES]):
                raise _Refused("wrong token")
            admission.outgoing += proof(self._token, b"driver", data[PROOF_BYTES:])
            admission.stage, admission.wanted = "length", _LENGTH.size
        elif admission.stage == "length":
            (size,) = _LENGTH.unpack(data)
            if not 0 < size <= MAX_HELLO_BYTES:
                shown = f"{size} bytes" if size >= 0 else "over 2 GiB"
                raise _Refused(f"its hello would be {shown} (at most {MAX_HELLO_BYTES})")
            admission.stage, admission.wanted = "hello", size
        else:
            try:
                hello = load_hello(data)
            except ValueError as exc:
                raise _Refused(str(exc)) from None
            self._admit(admission, hello)

    def _admit(self, admission: _Admission, hello: Any) -> None:
        self._forget(admission)
        sock = admission.sock
        sock.setblocking(True)
        conn = Connection(sock.detach())
        if self._closed.is_set():
            conn.close()
            return
        self._arrivals.put((hello, conn))

    def _overdue(self, admission: _Admission) -> str:
        return f"it did not finish {self._where(admission)} within {self._timeout:g} s"

    @staticmethod
    def _where(admission: _Admission) -> str:
        return "the handshake" if admission.stage == "proof" else "its hello after the handshake"

    def _refuse(self, admission: _Admission, why: str) -> None:
        self._drop(admission)
        self.refuse(admission.who, why)

    def _drop(self, admission: _Admission) -> None:
        self._forget(admission)
        admission.sock.close()

    def _forget(self, admission: _Admission) -> None:
        if self._admitting.pop(admission.sock, None) is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(admission.sock)
