"""Runners: how ranks are made. Each serves the ``World`` protocol of ``base``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

from harness.errors import (
    WorldStartError,
    check_int,
    check_one_of,
    check_seconds,
    require,
)
from harness.runners.base import DEFAULT_TIMEOUT, AllRanksSkipped, RankFailure, RankOutcome, World
from harness.runners.capacity import check_capacity

if TYPE_CHECKING:
    from harness.runners.torchrun.world import TorchrunOptions

RUNNERS = ("threads", "processes", "torchrun", "local")
"""The runners; the first is the default."""

SERVES: dict[str, frozenset[str]] = {"local": frozenset({"placements", "uneven", "ops"})}
"""The suites a runner serves, for the runners that serve only some (the others skip)."""


class WorldKey(NamedTuple):
    """Which World: runner × world size × device."""

    runner: str
    world_size: int
    device: str

    @property
    def id(self) -> str:
        return f"{self.runner}-ws{self.world_size}-{self.device}"


DEFAULT_DEVICE = "cpu"

__all__ = [
    "DEFAULT_DEVICE",
    "DEFAULT_TIMEOUT",
    "RUNNERS",
    "SERVES",
    "AllRanksSkipped",
    "RankFailure",
    "RankOutcome",
    "World",
    "WorldCache",
    "WorldKey",
    "WorldStartError",
    "Worlds",
    "check_capacity",
    "make_world",
    "open_world",
]


def make_world(
    runner: str,
    world_size: int,
    device: str = DEFAULT_DEVICE,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    strict_collectives: bool = False,
    backend: str | None = None,
    backend_plugins: tuple[str, ...] = (),
    torchrun: TorchrunOptions | None = None,
) -> World:
    """A new World; the caller closes it.

    ``strict_collectives`` makes the process runner check that every rank issues the same
    collective (``TORCH_DISTRIBUTED_DEBUG=DETAIL``); the thread runner always checks.
    ``backend`` is the process runner's process-group backend (default: the device's, gloo
    on CPU); the thread runner's ranks always use torch's threaded group, the local runner's
    simulation torch's fake group. ``backend_plugins``
    are modules imported here and in every rank before a group is made (they may register a
    backend or a device). ``torchrun``: where the torchrun runner listens and what it starts
    (its World's size is fixed by it).
    """
    check_one_of("runner", runner, RUNNERS)
    check_int("world_size", world_size)
    require(isinstance(device, str), "device", device, "a device type such as 'cpu' or 'cuda'")
    check_seconds("timeout", timeout)
    chosen = check_capacity(
        runner,
        device,
        (world_size,),
        name="world_size",
        backend=backend,
        backend_plugins=backend_plugins,
    )
    if runner == "torchrun":
        require(
            torchrun is not None,
            "torchrun",
            torchrun,
            "TorchrunOptions for the torchrun runner (where it listens, what it starts)",
        )
        assert torchrun is not None
        from harness.runners.torchrun.world import TorchrunWorld

        return TorchrunWorld(
            world_size,
            device,
            options=torchrun,
            timeout=timeout,
            strict_collectives=strict_collectives,
            backend=chosen,
            backend_plugins=backend_plugins,
        )
    if runner == "processes":
        from harness.runners.processes import ProcessWorld

        return ProcessWorld(
            world_size,
            device,
            timeout=timeout,
            strict_collectives=strict_collectives,
            backend=chosen,
            backend_plugins=backend_plugins,
        )
    if runner == "local":
        from harness.runners.local import LocalWorld

        return LocalWorld(world_size, device, timeout=timeout)
    from harness.runners.threads import ThreadWorld

    return ThreadWorld(world_size, device, timeout=timeout)


@contextlib.contextmanager
def open_world(
    runner: str = RUNNERS[0],
    world_size: int = 2,
    device: str = DEFAULT_DEVICE,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    strict_collectives: bool = False,
    backend: str | None = None,
    backend_plugins: tuple[str, ...] = (),
    torchrun: TorchrunOptions | None = None,
) -> Iterator[World]:
    """A World for the ``with`` block; ``world.run(fn, *args)`` runs ``fn(ctx, *args)`` per
    rank (the arguments: ``make_world``'s)."""
    world = make_world(
        runner,
        world_size,
        device,
        timeout=timeout,
        strict_collectives=strict_collectives,
        backend=backend,
        backend_plugins=backend_plugins,
        torchrun=torchrun,
    )
    try:
        yield world
    finally:
        world.close()


class WorldCache:
    """Worlds kept for a session, one per runner × world size × device."""

    def __init__(
        self,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        strict_collectives: bool = False,
        backend: str | None = None,
        backend_plugins: tuple[str, ...] = (),
        torchrun: TorchrunOptions | None = None,
    ) -> None:
        self.timeout, self.strict_collectives = timeout, strict_collectives
        self.backend, self.backend_plugins = backend, backend_plugins
        self.torchrun = torchrun
        self._worlds: dict[WorldKey, World] = {}

    def get(self, runner: str, world_size: int, device: str) -> World:
        key = WorldKey(runner, world_size, device)
        if key not in self._worlds:
            self._worlds[key] = make_world(
                runner,
                world_size,
                device,
                timeout=self.timeout,
                strict_collectives=self.strict_collectives,
                backend=self.backend,
                backend_plugins=self.backend_plugins,
                torchrun=self.torchrun,
            )
        return self._worlds[key]

    def existing(self, runner: str, device: str) -> list[World]:
        """The Worlds built so far for ``runner`` and ``device``, smallest first."""
        keys = sorted(k for k in self._worlds if (k.runner, k.device) == (runner, device))
        return [self._worlds[k] for k in keys]

    def check_health(self, runner: str, device: str) -> None:
        """Check every World of ``runner`` and ``device`` built so far (World.check_health)."""
        for world in self.existing(runner, device):
            world.check_health()

    def close(self) -> None:
        worlds, self._worlds = list(self._worlds.values()), {}
        for world in worlds:
            world.close()


class Worlds:
    """The session's Worlds of one runner and device, by world size.

    For checks that move between world sizes (save a checkpoint at N ranks, load it at M):
    besides its own ``world``, such a test asks this for a World of another size. Only the
    session's sizes are served, so a run at ``--world-sizes 2`` never starts other Worlds.
    """

    def __init__(self, cache: WorldCache, runner: str, device: str, sizes: tuple[int, ...]) -> None:
        require(bool(sizes), "sizes", sizes, "a non-empty tuple of world sizes")
        self.runner, self.device, self.sizes = runner, device, tuple(sizes)
        self._cache = cache

    def get(self, world_size: int) -> World:
        """The session's World of ``world_size`` ranks (started), shared with the ``world``
        fixture of tests at that size."""
        require(
            world_size in self.sizes,
            "world_size",
            world_size,
            f"one of this session's world sizes {self.sizes}",
        )
        world = self._cache.get(self.runner, world_size, self.device)
        world.start()
        return world

    def check_health(self) -> None:
        """Check every World of this runner and device built so far (see World.check_health)."""
        self._cache.check_health(self.runner, self.device)
