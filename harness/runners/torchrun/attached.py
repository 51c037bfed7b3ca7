"""The driver's side of a set of torchrun agents: their arrivals sorted (``Inbox``), one
attached set serving calls as ``world.Ranks`` (``Agents``), and a World torchrun can no
longer restart (``Dead``)."""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection, wait
from typing import Any

from harness.runners import _rank_process
from harness.runners.base import RankOutcome
from harness.runners.torchrun import channel
from harness.runners.torchrun.listener import AgentListener

START_TIMEOUT = 180.0
CONTROL_TIMEOUT = 30.0
STOP_GRACE = 30.0
_PEER_GRACE = 2.0
_EXIT_WAIT = 5.0
_STACK_WAIT = 3.0


class Inbox:
    """The listener's authenticated arrivals, sorted: agents by rank, rank connections by
    (agent pid, serial)."""

    def __init__(self, listener: AgentListener, world_size: int) -> None:
        self.listener, self.world_size = listener, world_size
        self.agents: dict[int, tuple[channel.AgentInfo, Connection]] = {}
        self.rank_conns: dict[tuple[int, int], Connection] = {}

    def pump(self, timeout: float) -> None:
        """Sort the next arrival (waiting up to ``timeout``)."""
        arrival = self.listener.next(timeout)
        if arrival is None:
            return
        hello, conn = arrival
        if not _known_hello(hello):
            conn.close()
            self.listener.refuse("a peer with the token", f"its hello was {hello!r:.80}")
            return
        if hello[0] == "rank":
            _, info, serial = hello
            self.rank_conns[(info.pid, serial)] = conn
            return
        info = hello[1]
        problem = self._misfit(info)
        if problem:
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(("refuse", problem)))
            conn.close()
            self.listener.refuse(info.where(), problem)
            return
        replaced = self.agents.get(info.rank)
        if replaced is not None:
            replaced[1].close()  # an agent torchrun has restarted since
        self.agents[info.rank] = (info, conn)

    def _misfit(self, info: channel.AgentInfo) -> str:
        if info.world_size != self.world_size:
            return f"its WORLD_SIZE is {info.world_size}, the driver expects {self.world_size}"
        return ""

    def complete(self) -> bool:
        """An agent of every rank, all still connected."""
        for rank, (_, conn) in list(self.agents.items()):
            if closed(conn):
                del self.agents[rank]
        return len(self.agents) == self.world_size

    def claim_rank(self, pid: int, serial: int, deadline: float) -> Connection | None:
        while (pid, serial) not in self.rank_conns and time.monotonic() < deadline:
            self.pump(min(0.5, deadline - time.monotonic()))
        return self.rank_conns.pop((pid, serial), None)

    def take_agents(self) -> dict[int, tuple[channel.AgentInfo, Connection]]:
        agents, self.agents = self.agents, {}
        return agents

    def missing(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.agents]


def _known_hello(hello: Any) -> bool:
    """``("rank", AgentInfo, serial)`` or ``("supervisor", AgentInfo)``."""
    shapes = {"rank": 3, "supervisor": 2}
    return (
        isinstance(hello, tuple)
        and bool(hello)
        and len(hello) == shapes.get(hello[0], -1)
        and isinstance(hello[1], channel.AgentInfo)
    )


def closed(conn: Connection) -> bool:
    """A connection whose peer is gone (nothing is expected on it yet)."""
    try:
        if not conn.poll(0):
            return False
        conn.recv_bytes()
    except (EOFError, OSError):
        return True
    return False


def receive(conn: Any) -> Any:
    try:
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return None


def send(conns: Iterable[Connection], message: Any) -> None:
    data = pickle.dumps(message)
    for conn in conns:
        with contextlib.suppress(OSError):  # a dead peer shows when its reply is gathered
            conn.send_bytes(data)


class Agents:
    """One attached set of agents and their ranks (``world.Ranks``)."""

    def __init__(
        self,
        inbox: Inbox,
        agents: dict[int, tuple[channel.AgentInfo, Connection]],
        conns: dict[int, Connection],
    ) -> None:
        self.inbox = inbox
        self.world_size = len(agents)
        self.info = {rank: info for rank, (info, _) in agents.items()}
        self.control = {rank: conn for rank, (_, conn) in agents.items()}
        self.conns = conns
        self.serials = dict.fromkeys(agents, 1)
        self.generation = 0
        self.dead: set[int] = set()
        """Ranks whose connection closed: their process ended (the agent says how)."""
        self.agent_gone: set[int] = set()
        self.exits: dict[int, tuple[int, str]] = {}
        self.stacks: dict[int, str] = {}
        self.broken: set[int] = set()
        self.dirty = False
        self.closed = False

    @property
    def lost(self) -> bool:
        """A rank or agent ended: only torchrun can bring them back."""
        return bool(self.dead or self.agent_gone)

    def crash_story(self) -> tuple[int, str, bool]:
        """The rank that died (the one its agent reported, once it did), its story, and
        whether its torchrun may restart: the agents' own count says so, whether or not the
        report came (a loaded machine may send it late; a vanished node never does)."""
        ended = self.dead | self.agent_gone
        self._await_agents(lambda: bool(ended & set(self.exits)) or ended <= self.agent_gone)
        rank = min(ended & set(self.exits) or ended)
        info = self.info[rank]
        _, story = self.exits.get(rank, (None, ""))
        if not story:
            story = f"{info.where()}: its connections closed: the node or torchrun went away"
        return rank, story, info.restart < info.max_restarts

    # --- calls -------------------------------------------------------------------------

    def call(self, payload: bytes, deadline: float) -> tuple[list[RankOutcome], bool]:
        assert not self.dirty, "agents are repaired before a call"
        assert not self.lost, "lost agents are replaced before a call"
        send(self.conns.values(), ("call", payload))
        replies, missing = self.gather(dict.fromkeys(self.conns, "call"), deadline)
        peer_failed = any(o.status == "error" for o in replies.values())
        outcomes = dict(replies) | self.missing_outcomes(missing)
        timed_out = any(outcomes[r].status != "crashed" for r in missing) and not peer_failed
        self._note_failure(replies, missing)
        return [outcomes[r] for r in range(self.world_size)], timed_out

    def healthy(self) -> bool:
        if self.lost:
            return False
        send(self.conns.values(), ("control", ("health", None)))
        expected = dict.fromkeys(self.conns, "health")
        replies, missing = self.gather(expected, time.monotonic() + CONTROL_TIMEOUT)
        return not self._note_failure(replies, missing)

    def _note_failure(self, replies: dict[int, RankOutcome], missing: list[int]) -> bool:
        """After a call or health check: whether it failed; if so every rank joins a new
        group before the next, and those that did not answer (alive) are started anew."""
        failed = bool(missing) or any(o.status != "ok" for o in replies.values())
        if failed:
            self.dirty = True
            self.broken |= set(missing) - self.dead
        return failed

    def mend(self) -> bool:
        """Ranks that did not answer started anew by their agents, the others reset; all in a
        new group. Whether every rank is ready."""
        self.generation += 1
        respawn = sorted(self.broken)
        kept = [r for r in range(self.world_size) if r not in self.broken]
        send([self.control[r] for r in respawn], ("respawn", self.generation))
        send([self.conns[r] for r in kept], ("control", ("reset", self.generation)))
        deadline = time.monotonic() + (START_TIMEOUT if respawn else CONTROL_TIMEOUT)
        for rank in respawn:
            self.conns[rank].close()
            self.serials[rank] += 1
            conn = self.inbox.claim_rank(self.info[rank].pid, self.serials[rank], deadline)
            if conn is None:
                self.agent_gone.add(rank)
                return False
            self.conns[rank] = conn
        expected = {r: "ready" if r in respawn else "reset" for r in range(self.world_size)}
        replies, missing = self.gather(expected, deadline, fail_fast=True)
        self.broken, self.dirty = (
            set(),
            bool(missing) or any(o.status != "ok" for o in replies.values()),
        )
        return not self.dirty

    def gather(
        self, expected: dict[int, str], deadline: float, *, fail_fast: bool = False
    ) -> tuple[dict[int, RankOutcome], list[int]]:
        """Replies of the kind ``expected`` names per rank, until every rank answered or
        died, or the deadline passed (with ``fail_fast``: or one failed); the agents'
        reports are read meanwhile."""
        replies: dict[int, RankOutcome] = {}
        while True:
            pending = [r for r in expected if r not in replies and r not in self.dead]
            failed = self.dead & set(expected) or any(o.status != "ok" for o in replies.values())
            if not pending or (fail_fast and failed):
                break
            handles = self._handles(pending)
            ready = wait(list(handles), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for handle in ready:
                kind, rank = handles[handle]
                if kind == "agent":
                    self._read_agent(rank)
                    continue
                reply = receive(self.conns[rank])
                if reply is None:
                    self.dead.add(rank)
                elif reply[0] == expected[rank] and rank not in replies:
                    replies[rank] = reply[1]
                    if reply[1].status == "error":
                        deadline = min(deadline, time.monotonic() + _PEER_GRACE)
        return replies, [r for r in expected if r not in replies]

    def _handles(self, pending: Iterable[int]) -> dict[Any, tuple[str, int]]:
        handles: dict[Any, tuple[str, int]] = {self.conns[r]: ("rank", r) for r in pending}
        for rank, conn in self.control.items():
            if rank not in self.agent_gone:
                handles[conn] = ("agent", rank)
        return handles

    def _read_agent(self, rank: int) -> None:
        message = receive(self.control[rank])
        if message is None:
            self.agent_gone.add(rank)
        elif message[0] == "exited":
            self.exits[rank] = message[1]
        elif message[0] == "stack":
            self.stacks[rank] = message[1]

    # --- ranks that did not answer ---------------------------------------------------------

    def missing_outcomes(self, missing: list[int]) -> dict[int, RankOutcome]:
        stuck = [r for r in missing if r not in self.dead]
        for rank in stuck:
            self.stacks.pop(rank, None)
        send([self.control[r] for r in stuck], ("stack", None))
        self._await_agents(lambda: all(r in self.stacks or r in self.agent_gone for r in stuck))
        died = [r for r in missing if r in self.dead]
        self._await_agents(lambda: all(r in self.exits or r in self.agent_gone for r in died))
        outcomes = {}
        for rank in missing:
            if rank in self.dead:
                _, story = self.exits.get(rank, (None, ""))
                summary = story.splitlines()[0] if story else "its connection closed"
                outcomes[rank] = RankOutcome(rank, "crashed", summary=summary, traceback=story)
                continue
            stack = self.stacks.get(rank, "(no stack: its agent did not answer)")
            if _rank_process.in_collective(stack):
                outcome = RankOutcome(rank, "waiting", summary="waiting in a collective")
            else:
                outcome = RankOutcome(rank, "timeout", summary="still running")
            outcome.traceback = stack
            outcomes[rank] = outcome
        return outcomes

    def _await_agents(self, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + max(_STACK_WAIT, _EXIT_WAIT)
        while not done() and time.monotonic() < deadline:
            live: dict[Any, int] = {
                c: r for r, c in self.control.items() if r not in self.agent_gone
            }
            for conn in wait(list(live), timeout=max(0.0, deadline - time.monotonic())):
                self._read_agent(live[conn])

    # --- the end -----------------------------------------------------------------------

    def stop(self) -> None:
        """Ask every rank and agent to leave, give them a grace, then close."""
        if self.closed:
            return
        leaving = not (self.dirty or self.broken or self.lost)
        if leaving:
            send(self.conns.values(), ("stop", None))
        # the agents give ranks that were asked to leave time to; the others are ended
        send(self.control.values(), ("stop", STOP_GRACE if leaving else 0.0))
        deadline = time.monotonic() + STOP_GRACE
        live: list[Any] = [c for r, c in self.control.items() if r not in self.agent_gone]
        while live and time.monotonic() < deadline:
            for conn in wait(live, timeout=max(0.0, deadline - time.monotonic())):
                if receive(conn) is None:
                    live.remove(conn)
        self.kill()

    def kill(self) -> None:
        """Close every connection: the agents end their ranks and leave."""
        self.closed = True
        for conn in [*self.conns.values(), *self.control.values()]:
            conn.close()


class Dead:
    """A World torchrun can no longer restart: every call is ``crashed`` with its story."""

    def __init__(self, world_size: int, rank: int, story: str, remains: Agents | None) -> None:
        self.world_size, self.rank, self.story = world_size, rank, story
        self.remains = remains

    def call(self, payload: bytes, deadline: float) -> tuple[list[RankOutcome], bool]:
        first = self.story.splitlines()[0]
        outcomes = [
            RankOutcome(r, "crashed", summary=first, traceback=self.story)
            if r == self.rank
            else RankOutcome(r, "waiting", summary="its World ended with that rank")
            for r in range(self.world_size)
        ]
        return outcomes, False

    def healthy(self) -> bool:
        return True

    def stop(self) -> None:
        remains, self.remains = self.remains, None
        if remains is not None:
            remains.stop()

    def kill(self) -> None:
        remains, self.remains = self.remains, None
        if remains is not None:
            remains.kill()
