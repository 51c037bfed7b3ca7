"""The driver's listener under peers that stall, flood it or send hostile frames: a real
listener on loopback, real sockets, its real thread. Each test shortens the handshake
deadline so that it runs in seconds."""

from __future__ import annotations

import errno
import os
import pickle
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from harness.runners.torchrun import channel
from harness.runners.torchrun.listener import MAX_HELLO_BYTES, AgentListener

TOKEN = b"a-token-for-the-channel-tests-0123456789"
INFO = channel.AgentInfo(
    rank=0, world_size=1, local_rank=0, node=0, host="here", restart=0, max_restarts=0, pid=1
)


@pytest.fixture
def listen() -> Iterator[Callable[..., AgentListener]]:
    made: list[AgentListener] = []

    def make(**options: Any) -> AgentListener:
        listener = AgentListener(("127.0.0.1", 0), TOKEN, **options)
        made.append(listener)
        return listener

    yield make
    for listener in made:
        listener.close()


def _attach(listener: AgentListener) -> Connection:
    """An agent: the handshake, then its hello."""
    conn = channel.connect(listener.address, TOKEN, timeout=10.0)
    conn.send_bytes(pickle.dumps(("supervisor", INFO)))
    return conn


def _arrives(listener: AgentListener, timeout: float = 10.0) -> None:
    arrival = listener.next(timeout)
    assert arrival is not None, f"no agent arrived; refused: {listener.refused}"
    hello, conn = arrival
    conn.close()
    assert hello == ("supervisor", INFO)


def _refusal(listener: AgentListener, timeout: float = 5.0) -> str:
    """The listener's first refusal, waited for (its thread records it)."""
    deadline = time.monotonic() + timeout
    while not listener.refused and time.monotonic() < deadline:
        time.sleep(0.01)
    assert listener.refused, f"nothing refused within {timeout} s"
    return listener.refused[0]


def _assert_logged(caplog: pytest.LogCaptureFixture, text: str, timeout: float = 2.0) -> None:
    """``text`` in the log, waited for: the listener's thread records a refusal, then logs it."""
    deadline = time.monotonic() + timeout
    while text not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    assert text in caplog.text


class _Peer:
    """A connection that sends nothing unless told, and what it saw of the driver."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=5.0)
        self.received = b""
        self.closed = False

    def state(self) -> str:
        """``"waiting"`` (nothing from the driver yet), ``"greeted"`` or ``"closed"``."""
        while not self.closed and select.select([self.sock], [], [], 0)[0]:
            try:
                data = self.sock.recv(4096)
            except ConnectionError:
                data = b""
            self.received += data
            self.closed = not data
        assert len(self.received) <= len(channel.MAGIC) + channel.NONCE_BYTES, self.received
        return "closed" if self.closed else "greeted" if self.received else "waiting"


def test_an_agent_attaches_past_150_idle_connections_while_no_thread_can_start(
    listen: Callable[..., AgentListener], monkeypatch: pytest.MonkeyPatch
) -> None:
    listener = listen(handshake_timeout=0.5)
    threads = threading.active_count()

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    idle = [socket.create_connection(listener.address, timeout=5.0) for _ in range(150)]
    try:
        started = time.monotonic()
        agent = _attach(listener)
        _arrives(listener)
        agent.close()
        assert time.monotonic() - started < 8.0
        # the idle ones wait their turn, 64 at a time, and are refused at the deadline
        deadline = time.monotonic() + 8.0
        while listener.refused_count < len(idle) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert listener.refused_count == len(idle)
        assert threading.active_count() <= threads
    finally:
        for sock in idle:
            sock.close()


def test_a_peer_sending_a_byte_every_so_often_is_refused_at_the_deadline(
    listen: Callable[..., AgentListener],
) -> None:
    listener = listen(handshake_timeout=1.0)
    peer = _Peer(listener.address)
    started = time.monotonic()
    try:
        while peer.state() != "closed" and time.monotonic() - started < 6.0:
            peer.sock.send(b"x")  # never the 64 bytes of a proof, but always something
            time.sleep(0.2)
    except OSError:
        pass  # the driver closed it
    finally:
        took = time.monotonic() - started
        peer.sock.close()
    assert 0.8 < took < 4.0, f"the dripping peer was held {took:.1f} s"
    assert "did not finish the handshake within 1 s" in _refusal(listener)


def test_no_more_connections_are_admitted_at_once_than_the_cap(
    listen: Callable[..., AgentListener],
) -> None:
    listener = listen(handshake_timeout=1.0, max_handshakes=4)
    peers = [_Peer(listener.address) for _ in range(10)]
    try:
        most, deadline = 0, time.monotonic() + 8.0
        states = ["waiting"]
        while set(states) != {"closed"} and time.monotonic() < deadline:
            states = [peer.state() for peer in peers]
            most = max(most, states.count("greeted"))
            time.sleep(0.02)
        assert states == ["closed"] * len(peers), states
        assert most == 4
    finally:
        for peer in peers:
            peer.sock.close()
    assert listener.refused_count == 10


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (
            struct.pack("!i", 2**31 - 1),
            f"its hello would be 2147483647 bytes (at most {MAX_HELLO_BYTES})",
        ),
        (
            struct.pack("!i", -1) + struct.pack("!Q", 2**40),
            "its hello would be over 2 GiB (at most 65536)",
        ),
    ],
    ids=["2 GiB", "1 TiB"],
)
def test_a_token_holder_announcing_a_huge_hello_is_refused_and_logged(
    listen: Callable[..., AgentListener], caplog: pytest.LogCaptureFixture, header: bytes, why: str
) -> None:
    listener = listen(handshake_timeout=5.0)
    conn = channel.connect(listener.address, TOKEN, timeout=5.0)
    try:
        os.write(conn.fileno(), header)
        assert _refusal(listener, timeout=2.0).endswith(why)
        assert conn.poll(2.0)
        with pytest.raises((EOFError, OSError)):
            conn.recv_bytes()
    finally:
        conn.close()
    _assert_logged(caplog, f"to the torchrun listener: {why}")
    agent = _attach(listener)  # the listener goes on
    _arrives(listener)
    agent.close()


class _Runs:
    """Unpickling it calls ``os.getpid``: a hello must not run anything."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.getpid, ())


@pytest.mark.parametrize(
    ("hello", "why"),
    [
        (b"not a pickle", "its hello does not unpickle (UnpicklingError"),
        (b"cno_such_module\nthing\n.", "its hello does not unpickle (UnpicklingError: it names"),
        (pickle.dumps(("supervisor", _Runs())), "it names posix.getpid, not an AgentInfo"),
    ],
    ids=["garbage", "missing module", "code"],
)
def test_a_token_holders_hello_that_does_not_load_is_refused_and_runs_nothing(
    listen: Callable[..., AgentListener], caplog: pytest.LogCaptureFixture, hello: bytes, why: str
) -> None:
    listener = listen(handshake_timeout=5.0)
    conn = channel.connect(listener.address, TOKEN, timeout=5.0)
    try:
        conn.send_bytes(hello)
        assert why in _refusal(listener)
    finally:
        conn.close()
    assert listener.next(0.2) is None
    _assert_logged(caplog, "refused a connection from 127.0.0.1")
    agent = _attach(listener)  # the listener goes on
    _arrives(listener)
    agent.close()


def test_the_accept_loop_survives_accept_failing(
    listen: Callable[..., AgentListener], monkeypatch: pytest.MonkeyPatch
) -> None:
    listener = listen()
    accept, failures = socket.socket.accept, []

    def out_of_descriptors(self: socket.socket) -> tuple[socket.socket, Any]:
        if len(failures) < 3:
            failures.append(self)
            raise OSError(errno.EMFILE, "Too many open files")
        return accept(self)

    monkeypatch.setattr(socket.socket, "accept", out_of_descriptors)
    agent = _attach(listener)
    _arrives(listener)
    agent.close()
    assert len(failures) == 3
