"""``--distconf-schedule=worlds``: how xdist hands a run's tests to its workers.

A World is cheap to use and dear to start (seconds of process-group set-up on the process
runner), and the cost of a test grows with its world size. So each World's tests go to a
worker as units of work, a World split into shares of about equal cost (``world_shares``),
and the units go out largest World first: the long units start while there is still room
to fill the gaps with the short ones. ``harness run`` asks for it whenever it starts more
than one worker.
"""

from __future__ import annotations

import re
import zlib
from collections import Counter
from collections.abc import Iterable
from typing import Any

import pytest

from harness.plugin.worlds import world_key

_WORLD_PARAMETER = re.compile(r"\[(?:.*-)?(?P<world>[a-z0-9_]+-ws(?P<size>\d+)-[a-z0-9_:]+)\]$")
"""A World test's node ID ends in its ``world`` parameter: ``[threads-ws4-cpu]``."""


def world_of(nodeid: str) -> tuple[str, int] | None:
    """The World part of a node ID and its size, or None for a test without a World."""
    match = _WORLD_PARAMETER.search(nodeid)
    return (match["world"], int(match["size"])) if match else None


UNITS_PER_WORKER = 12
"""About how many units of work each worker gets: enough that the last unit to finish is a
small part of a worker's time. A worker starts a World once, whatever the number of its
shares it runs, so more units cost no more World starts than workers times Worlds."""


def world_shares(nodeids: Iterable[str], workers: int) -> dict[str, int]:
    """How many units each World's tests are split into: in proportion to the World's cost,
    its size times its number of tests (rank threads take turns on one interpreter, so a
    test costs about its world size), at least one each, ``UNITS_PER_WORKER`` a worker in
    all. At the ci profile, one unit per World left one of two workers idle for a fifth
    of the run; replayed on that run's test durations, 4 units a worker would leave the two
    finishing 137 s apart, 12 within 18 s."""
    tests = Counter(world for world in map(world_of, nodeids) if world is not None)
    cost = {world: size * count for (world, size), count in tests.items()}
    unit = sum(cost.values()) / max(1, UNITS_PER_WORKER * workers)
    return {world: max(1, round(c / unit)) for world, c in cost.items()}


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
            self._shares: dict[str, int] | None = None

        def _split_scope(self, nodeid: str) -> str:
            world = world_of(nodeid)
            if world is None:
                return nodeid  # a test without a World is a unit of its own, as under "load"
            if self._shares is None:
                self._shares = world_shares(self.collection, len(self.nodes))
            test = nodeid.rsplit("[", 1)[0]
            return f"{world[0]}#{zlib.crc32(test.encode()) % self._shares[world[0]]}"

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
