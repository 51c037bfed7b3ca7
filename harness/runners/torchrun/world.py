"""torchrun runner: ranks started by torchrun, on this machine or several, attach to the driver.

The driver listens (``TorchrunOptions.listen``, loopback unless told otherwise) and waits up to
``attach_timeout`` for exactly ``world_size`` agents (``python -m harness.attach``, one per
process torchrun starts; ``agent``) to attach over the authenticated channel (``channel``).
Each agent supervises one rank process running the process runner's rank code
(``_rank_process``), which joins the default process group through torchrun's store. With
``nproc_per_node`` the driver starts torchrun itself (``launch``: ``nnodes`` local "nodes").

A failed call costs what it costs on the process runner, except that the driver cannot start
ranks: a rank that ran past the deadline or stayed stuck is started anew by its agent; the
others are reset in place; all join a new group. A rank that died ends its agent the same
way, and torchrun decides: with restarts left (``--max-restarts``) every agent is restarted,
attaches again and the World goes on with them; with none left, every later call of the World
is ``crashed``, naming the rank, its node and how it ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import WorldStartError, check_int, check_seconds, require
from harness.runners.base import DEFAULT_TIMEOUT, RankOutcome
from harness.runners.processes import _pickled_call
from harness.runners.torchrun import channel
from harness.runners.torchrun.attached import START_TIMEOUT, STOP_GRACE, Agents, Dead, Inbox, send
from harness.runners.torchrun.listener import AgentListener
from harness.runners.world import PersistentWorld

RUNNER = "torchrun"
NOTICES = channel.log.name
"""The logger of what an operator must see at once (warnings): where the driver waits,
refused connections, a listener beyond loopback."""
DEFAULT_LISTEN = "127.0.0.1:0"
DEFAULT_ATTACH_TIMEOUT = 300.0
_DEAD_GRACE = 3.0


@dataclass(frozen=True, kw_only=True)
class TorchrunOptions:
    """Where the driver listens and how long it waits; with ``nproc_per_node``, the torchrun
    it starts here."""

    world_size: int
    """How many agents attach: ``nnodes * nproc_per_node`` when the driver starts them."""
    listen: str = DEFAULT_LISTEN
    attach_timeout: float = DEFAULT_ATTACH_TIMEOUT
    token_file: Path | None = None
    """The shared secret's file; None: ``$DISTCONF_TOKEN`` (or, when the driver starts
    torchrun, one made for the session)."""
    nproc_per_node: int | None = None
    nnodes: int = 1
    max_restarts: int = 0

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size)
        channel.parse_address("listen", self.listen)
        check_seconds("attach_timeout", self.attach_timeout)
        check_int("nnodes", self.nnodes)
        check_int("max_restarts", self.max_restarts, minimum=0)
        if self.nproc_per_node is not None:
            check_int("nproc_per_node", self.nproc_per_node)
            launched = self.nnodes * self.nproc_per_node
            require(
                self.world_size == launched,
                "world_size",
                self.world_size,
                f"--nnodes x --nproc-per-node = {launched}",
            )

    @property
    def launches(self) -> bool:
        return self.nproc_per_node is not None


class _AttachFailed(Exception):
    pass


class TorchrunWorld(PersistentWorld["Agents | Dead"]):
    """A World of ranks torchrun started (see the module docstring)."""

    runner = RUNNER

    def __init__(
        self,
        world_size: int,
        device: str = "cpu",
        *,
        options: TorchrunOptions,
        timeout: float = DEFAULT_TIMEOUT,
        strict_collectives: bool = False,
        backend: str = "gloo",
        backend_plugins: tuple[str, ...] = (),
    ) -> None:
        require(
            world_size == options.world_size,
            "world_size",
            world_size,
            f"the torchrun World's size ({options.world_size}): it is fixed per session",
        )
        super().__init__(world_size, device, timeout=timeout)
        self.options = options
        self.settings = channel.AgentSettings(
            device=device,
            backend=backend,
            backend_plugins=backend_plugins,
            strict_collectives=strict_collectives,
        )
        self.attaches = 0
        """Sets of agents that attached: 1 at the start, one more per torchrun restart."""
        self.respawns = 0
        self.resets = 0
        self._inbox: Inbox | None = None
        self._launcher: Any = None
        self._dead: Dead | None = None
        self._start_error: WorldStartError | None = None

    @property
    def address(self) -> tuple[str, int]:
        """Where the driver listens (starting the listener, and torchrun when it launches)."""
        return self._open().listener.address

    def _prepare(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
        require(
            getattr(fn, "__module__", None) != "__main__",
            "fn",
            fn,
            "a function of an importable module: torchrun's ranks load it by its module's "
            "name, and the driver's __main__ is not theirs",
        )
        return _pickled_call(fn, args)

    @property
    def refused_connections(self) -> int:
        """Connections the driver's listener refused so far (none before it listens)."""
        return 0 if self._inbox is None else self._inbox.listener.refused_count

    def _open(self) -> Inbox:
        """The listener (and, when the driver starts torchrun here, torchrun), once."""
        if self._inbox is not None:
            return self._inbox
        options = self.options
        address = channel.parse_address("listen", options.listen)
        if options.launches:
            from harness.runners.torchrun.launch import LocalTorchrun

            self._launcher = launcher = LocalTorchrun(options.token_file)
            listener = AgentListener(address, launcher.token)
            launcher.start(
                nnodes=options.nnodes,
                nproc_per_node=int(options.nproc_per_node or 0),
                max_restarts=options.max_restarts,
                driver=listener.address,
            )
        else:
            listener = AgentListener(address, channel.load_token(options.token_file))
        host, port = listener.address
        if not channel.is_loopback(address[0]):
            channel.log.warning(
                "distconf: WARNING: the torchrun runner listens on %s:%d, beyond this machine's "
                "loopback: anyone who can reach it may try to attach. Only agents proving the "
                "token are served; the channel is not encrypted.",
                host,
                port,
            )
        if not options.launches:
            channel.log.warning(
                "distconf: waiting up to %g s for %d agents: torchrun ... -m harness.attach "
                "--driver %s:%d",
                options.attach_timeout,
                self.world_size,
                host,
                port,
            )
        self._inbox = Inbox(listener, self.world_size)
        return self._inbox

    def _start_ranks(self) -> Agents | Dead:
        if self._dead is not None:
            return self._dead
        if self._start_error is not None:
            raise self._start_error
        try:
            return self._attach()
        except _AttachFailed as exc:
            if self.attaches == 0:
                self._start_error = WorldStartError(str(exc))
                raise self._start_error from None
            self._dead = Dead(self.world_size, 0, str(exc), None)
            return self._dead

    def _attach(self) -> Agents:
        """Wait for an agent of every rank, tell them their settings, wait for their
        ranks to join the group."""
        inbox = self._open()
        deadline = time.monotonic() + self.options.attach_timeout
        while not inbox.complete():
            self._check_attach(inbox, deadline)
            inbox.pump(min(0.5, max(0.0, deadline - time.monotonic())))
        agents = inbox.take_agents()
        self.attaches += 1
        settings = channel.AgentSettings(**{**vars(self.settings), "round": self.attaches})
        send([conn for _, conn in agents.values()], ("settings", settings))
        conns = {}
        for rank, (info, _) in sorted(agents.items()):
            conn = inbox.claim_rank(info.pid, 1, deadline)
            if conn is None:
                raise _AttachFailed(f"{info.where()} attached but its rank never connected")
            conns[rank] = conn
        ranks = Agents(inbox, agents, conns)
        replies, missing = ranks.gather(dict.fromkeys(conns, "ready"), deadline + START_TIMEOUT)
        failed = {r: o for r, o in replies.items() if o.status != "ok"}
        if missing or failed:
            ranks.kill()
            problems = [f"rank {r}: {o.summary}\n{o.traceback}" for r, o in failed.items()]
            problems += [f"rank {r}: did not join the process group" for r in missing]
            raise _AttachFailed("the attached ranks failed to start:\n" + "\n".join(problems))
        return ranks

    def _check_attach(self, inbox: Inbox, deadline: float) -> None:
        launcher = self._launcher
        ended = launcher is not None and launcher.finished()
        if not ended and time.monotonic() < deadline:
            return
        host, port = inbox.listener.address
        what = (
            "torchrun ended"
            if ended
            else f"--attach-timeout={self.options.attach_timeout:g} s passed"
        )
        lines = [
            f"{what} before {self.world_size} agents attached to {host}:{port}: ranks "
            f"{inbox.missing()} missing ({len(inbox.agents)} attached)"
        ]
        listener = inbox.listener
        lines += [f"refused: {r}" for r in listener.refused]
        if listener.refused_count > len(listener.refused):
            lines.append(f"refused: {listener.refused_count - len(listener.refused)} more")
        if launcher is not None:
            lines.append(launcher.story())
        raise _AttachFailed("\n".join(lines))

    def _after_failure(self, outcomes: list[RankOutcome], timed_out: bool) -> None:
        ranks = self._ranks
        if isinstance(ranks, Agents):
            self.respawns += len(ranks.broken)

    def _after_unhealthy(self) -> None:
        self._after_failure([], False)

    def _repair(self) -> None:
        ranks = self._ranks
        if not isinstance(ranks, Agents):
            return
        if ranks.lost:
            self._ranks = None
            self._await_restart(ranks)
            return
        if ranks.dirty or ranks.broken:
            respawned = len(ranks.broken)
            if ranks.mend():
                self.resets += respawned < self.world_size
            elif ranks.lost:
                self._ranks = None
                self._await_restart(ranks)

    def _await_restart(self, lost: Agents) -> None:
        """After a rank died: torchrun restarts the agents (the next call waits for them)
        or it cannot, and the World is dead from now on."""
        rank, story, may_restart = lost.crash_story()
        if not may_restart:
            info = lost.info[rank]
            self._dead = Dead(
                self.world_size,
                rank,
                f"{story}\nno restarts left (--max-restarts={info.max_restarts}): this World "
                "cannot go on",
                lost,
            )
            return
        # The others stay connected until torchrun stops them: an agent the driver let go
        # would end well, and torchrun would take its node's workers for finished.
        try:
            self._ranks = self._attach()
        except _AttachFailed as exc:
            self._dead = Dead(
                self.world_size, rank, f"{story}\nno new agents attached: {exc}", None
            )
        finally:
            lost.kill()

    def close(self) -> None:
        try:
            super().close()
            if self._dead is not None:
                self._dead.stop()
        finally:
            if self._inbox is not None:
                self._inbox.listener.close()
            if self._launcher is not None:
                # a node that failed leaves the others in torchrun's exit barrier
                self._launcher.stop(_DEAD_GRACE if self._dead else STOP_GRACE)
