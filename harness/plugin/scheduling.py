"""``--distconf-schedule=worlds``: how xdist hands a run's tests to its workers.

A World is cheap to use and dear to start (seconds of process-group set-up on the process
runner), and the cost of a test grows with its world size. So each World's tests go to one
worker as one unit of work, split into as many units as it takes to keep every worker busy,
and the units go out largest World first: the long units start while there is still room
to fill the gaps with the short ones. ``harness run`` asks for it whenever it starts more
than one worker.
"""

from __future__ import annotations

import math
import re
import zlib
from typing import Any

import pytest

from harness.plugin.worlds import world_key

_WORLD_PARAMETER = re.compile(r"\[(?:.*-)?(?P<world>[a-z0-9_]+-ws(?P<size>\d+)-[a-z0-9_:]+)\]$")
"""A World test's node ID ends in its ``world`` parameter: ``[threads-ws4-cpu]``."""


def world_of(nodeid: str) -> tuple[str, int] | None:
    """The World part of a node ID and its size, or None for a test without a World."""
    match = _WORLD_PARAMETER.search(nodeid)
    return (match["world"], int(match["size"])) if match else None


def largest_worlds_first(items: list[pytest.Item]) -> None:
    """Order the tests by their World's size, largest first, keeping pytest's order within
    a World (the World stays warm from one test to the next)."""
    position = {id(item): i for i, item in enumerate(items)}

    def size(item: pytest.Item) -> int:
        key = world_key(item)
        return key.world_size if key is not None else 0

    items.sort(key=lambda item: (-size(item), position[id(item)]))


def _first_pending(workload: dict[str, dict[str, bool]]) -> tuple[str, str] | None:
    """The unit and node ID of the first test a worker was given and did not complete."""
    for scope, unit in workload.items():
        for nodeid, completed in unit.items():
            if not completed:
                return scope, nodeid
    return None


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scheduler for ``--distconf-schedule=worlds`` (imported only in a controller)."""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class WorldScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist is untyped
        """xdist's scope scheduling with a World (or a share of one) as the scope."""

        def __init__(self, config: pytest.Config, log: Any) -> None:
            super().__init__(config, log)
            # The units go out in collection order (largest World first), not by test count.
            config.option.loadscopereorder = False
            self._shares: int | None = None

        def _split_scope(self, nodeid: str) -> str:
            world = world_of(nodeid)
            if world is None:
                return nodeid  # a test without a World is a unit of its own, as under "load"
            if self._shares is None:
                worlds = {w for w in map(world_of, self.collection) if w is not None}
                self._shares = max(1, math.ceil(2 * len(self.nodes) / max(1, len(worlds))))
            test = nodeid.rsplit("[", 1)[0]
            return f"{world[0]}#{zlib.crc32(test.encode()) % self._shares}"

        def remove_node(self, node: Any) -> str | None:
            # xdist's scope scheduling puts a crashed worker's whole unit back, the test that
            # crashed it included: each replacement worker ran it and crashed again, until
            # xdist ran out of restarts. Marked done here, the crash is reported once.
            workload: dict[str, dict[str, bool]] = self.assigned_work.get(node, {})
            crashed = _first_pending(workload)
            if crashed is None:
                return super().remove_node(node)  # type: ignore[no-any-return]
            scope, nodeid = crashed
            workload[scope][nodeid] = True
            self.assigned_work[node] = {s: u for s, u in workload.items() if not all(u.values())}
            super().remove_node(node)
            return nodeid

    return WorldScheduling(config, log)
