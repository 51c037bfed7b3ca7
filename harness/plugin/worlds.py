"""The Worlds tests run on: a ``world`` parameter per allowed world size, the session's
cache of Worlds, and a health check before a test reuses one."""

from __future__ import annotations

import pytest

from harness.config import RunConfig
from harness.plugin import gpus, options
from harness.runners import SERVES, World, WorldCache, WorldKey, Worlds
from harness.runners.base import answers_to

FIXTURE_MODULE = "harness.plugin"
"""Where the ``world`` fixture is defined: a project's own ``world`` fixture is left alone."""


def world_key(item: pytest.Item) -> WorldKey | None:
    """The World a test runs on (its ``world`` parameter), if it asks for one."""
    key = getattr(getattr(item, "callspec", None), "params", {}).get("world")
    return key if isinstance(key, WorldKey) else None


def uses_other_worlds(item: pytest.Item) -> bool:
    """The test also asks for Worlds of other sizes (the ``worlds`` fixture)."""
    return "worlds" in getattr(item, "fixturenames", ())


def _sizes_for(marker: pytest.Mark | None, configured: tuple[int, ...]) -> tuple[int, ...]:
    if marker is None:
        return configured
    allowed, low, high = marker.args, marker.kwargs.get("min"), marker.kwargs.get("max")
    return tuple(
        size
        for size in configured
        if (not allowed or size in allowed)
        and (low is None or size >= low)
        and (high is None or size <= high)
    )


def _runner_skip(marker: pytest.Mark | None, runner: str) -> str | None:
    """Why this runner cannot serve the test (``@pytest.mark.runner("processes", reason=)``)."""
    if marker is None or answers_to(runner, marker.args):
        return None
    why = marker.kwargs.get("reason", "")
    return f"needs the {' or '.join(marker.args)} runner{': ' + why if why else ''}"


def _suite_skip(metafunc: pytest.Metafunc, runner: str) -> str | None:
    """Why this runner cannot serve the test's suite (``runners.SERVES``): the local runner
    simulates every rank in one thread, which serves DTensor-level checks only. A test
    outside the suites directory is its project's to mark."""
    served = SERVES.get(runner)
    path = metafunc.definition.path.resolve()
    suite = path.stem.removeprefix("test_")
    in_suites = path.is_relative_to(options.suites_dir(metafunc.config))
    if served is None or suite in served or not in_suites:
        return None
    return (
        f"the {runner} runner serves the {', '.join(sorted(served))} suites only: it simulates "
        f"every rank in one thread (torch's LocalTensorMode), and the {suite} suite needs "
        "real per-rank process groups (FSDP hooks, DCP, state dicts, optimizers)"
    )


def _uses_our_world(metafunc: pytest.Metafunc) -> bool:
    """The test asks for ``world`` and gets this plugin's fixture, not a project's own."""
    if "world" not in metafunc.fixturenames:
        return False
    definitions = getattr(metafunc, "_arg2fixturedefs", {}).get("world")
    return not definitions or getattr(definitions[-1].func, "__module__", None) == FIXTURE_MODULE


def _skips(reason: str | None) -> list[pytest.MarkDecorator]:
    return [pytest.mark.skip(reason=reason)] if reason else []


class SessionWorlds:
    """The session's Worlds, one per runner × world size × device, built on first use and
    kept until the session ends (creating process groups is the expensive part)."""

    def __init__(self, run: RunConfig) -> None:
        self.run = run
        self._cache: WorldCache | None = None
        self._closed: list[World] = []

    @property
    def cache(self) -> WorldCache:
        if self._cache is None:
            self._cache = WorldCache(
                timeout=self.run.rank_timeout,
                strict_collectives=self.run.strict_collectives,
                backend=self.run.backend,
                backend_plugins=self.run.backend_plugins,
                torchrun=self.run.torchrun,
            )
        return self._cache

    def parametrize(self, metafunc: pytest.Metafunc) -> None:
        """One ``world`` parameter per configured world size the test's marker allows; a test
        no size or runner serves gets one, skipped with the reason."""
        if not _uses_our_world(metafunc):
            return
        run, definition = self.run, metafunc.definition
        sizes_marker = definition.get_closest_marker("world_size")
        sizes = _sizes_for(sizes_marker, run.world_sizes)
        skip = _suite_skip(metafunc, run.runner) or _runner_skip(
            definition.get_closest_marker("runner"), run.runner
        )
        if not sizes:
            assert sizes_marker is not None
            skip = skip or (
                f"needs a world size allowed by "
                f"{sizes_marker.args or ''}{sizes_marker.kwargs or ''}; "
                f"--world-sizes gave {run.world_sizes_text}"
            )
            sizes = run.world_sizes[:1]
        params = [
            pytest.param(key, id=key.id, marks=_skips(skip or self._size_skip(key.world_size)))
            for key in (WorldKey(run.runner, size, run.device) for size in sizes)
        ]
        metafunc.parametrize("world", params, indirect=True, scope="session")

    def _size_skip(self, world_size: int) -> str | None:
        """Why a test at ``world_size`` cannot run: the torchrun World's size is fixed."""
        torchrun = self.run.torchrun
        if torchrun is None or world_size == torchrun.world_size:
            return None
        return (
            f"the torchrun World has {torchrun.world_size} ranks, fixed for the session; a "
            f"test at world size {world_size} would need a World of its own (run it on the "
            "threads or processes runner)"
        )

    def world(self, config: pytest.Config, key: WorldKey) -> World:
        """The started World of ``key`` (a World that cannot start is the fixture's error)."""
        if key.device != "cpu" and key.runner != "torchrun":  # torchrun's are on its nodes
            needed = gpus.gpus_for_world(key.runner, key.world_size)
            what = f"a {key.runner} World of {key.world_size} on {key.device}"
            gpus.require_gpus(config, needed, what)
        world = self.cache.get(key.runner, key.world_size, key.device)
        world.start()
        return world

    def worlds(self, config: pytest.Config) -> Worlds:
        """The session's Worlds by size (on an accelerator, the sizes this process has
        devices for)."""
        run = self.run
        sizes = run.session_world_sizes
        if run.torchrun is None and run.device != "cpu":
            held = gpus.gpus_held()
            sizes = tuple(s for s in sizes if gpus.gpus_for_world(run.runner, s) <= held)
            if not sizes:
                gpus.require_gpus(
                    config, min(run.world_sizes), f"{run.runner} Worlds on {run.device}"
                )
        return Worlds(self.cache, run.runner, run.device, sizes)

    def check_before(self, item: pytest.Item) -> None:
        """Before a test reuses a World, check it answers a barrier (it rebuilds itself if
        not); a test that moves between sizes gets every built World of its runner checked."""
        if self._cache is None:
            return
        key = world_key(item)
        if key is not None:
            self._cache.get(key.runner, key.world_size, key.device).check_health()
        if uses_other_worlds(item):
            self._cache.check_health(self.run.runner, self.run.device)

    def end_fields(self) -> dict[str, int]:
        """What the session's end record says of its Worlds: on the torchrun runner, the
        connections its listener refused (``refused_connections``), those while it closed
        among them."""
        if self.run.torchrun is None:
            return {}
        worlds = self._closed or self._built()
        return {"refused_connections": sum(getattr(w, "refused_connections", 0) for w in worlds)}

    def _built(self) -> list[World]:
        if self._cache is None:
            return []
        return self._cache.existing(self.run.runner, self.run.device)

    def close(self) -> None:
        if self._cache is not None:
            self._closed = self._built()
            self._cache.close()
