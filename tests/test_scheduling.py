"""``--distconf-schedule=worlds``: each World's tests in shares of about equal cost, largest
World first."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from harness import session
from harness.config import RunConfig
from harness.plugin.scheduling import UNITS_PER_WORKER, world_of, world_shares


@pytest.mark.parametrize(
    ("nodeid", "expected"),
    [
        ("suites/test_uneven.py::test_x[threads-ws4-cpu]", ("threads-ws4-cpu", 4)),
        ("suites/test_a.py::test_y[processes-ws12-cuda]", ("processes-ws12-cuda", 12)),
        ("suites/test_a.py::test_y[3-local-ws64-cpu]", ("local-ws64-cpu", 64)),
        ("tests/test_config.py::test_defaults", None),
        ("tests/test_config.py::test_param[ws4]", None),
    ],
)
def test_world_of_reads_the_world_parameter(nodeid: str, expected: object) -> None:
    assert world_of(nodeid) == expected


def _tests(counts: dict[int, int]) -> list[str]:
    return [
        f"suites/test_a.py::test_{n}[threads-ws{size}-cpu]"
        for size, count in counts.items()
        for n in range(count)
    ]


def test_a_worlds_shares_follow_its_size_times_its_tests() -> None:
    shares = world_shares([*_tests({1: 10, 2: 10, 3: 10, 4: 10}), "tests/test_b.py::t"], 2)
    assert shares == {f"threads-ws{n}-cpu": s for n, s in ((1, 2), (2, 5), (3, 7), (4, 10))}


def test_every_world_gets_a_share_however_small() -> None:
    shares = world_shares(_tests({1: 1, 4: 500}), 2)
    assert shares == {"threads-ws1-cpu": 1, "threads-ws4-cpu": 2 * UNITS_PER_WORKER}


def _starts(out: Path) -> list[tuple[str, str]]:
    """Each World test's start: its node ID and the worker's results file."""
    return [
        (record["nodeid"], path.name)
        for path in out.glob("results.gw*.jsonl")
        for line in path.read_text().splitlines()
        if (record := json.loads(line)).get("kind") == "start" and world_of(record["nodeid"])
    ]


def test_a_worlds_tests_of_one_function_run_once_on_one_worker(tmp_path: Path) -> None:
    config = RunConfig(
        suites=("uneven",),
        world_sizes=(1, 2, 3, 4),
        profile="dev",
        seed=1,
        workers=2,
        out=tmp_path,
    )
    assert "--distconf-schedule=worlds" in session.pytest_arguments(config)
    assert session.run(config) == 0
    starts = _starts(tmp_path)
    nodeids = [nodeid for nodeid, _ in starts]
    assert len(nodeids) == len(set(nodeids)), "got a test started twice"
    units: dict[tuple[str, str], set[str]] = defaultdict(set)
    for nodeid, worker in starts:
        world = world_of(nodeid)
        assert world is not None
        units[world[0], nodeid.rsplit("[", 1)[0]].add(worker)
    assert {world for world, _ in units} == {f"threads-ws{n}-cpu" for n in (1, 2, 3, 4)}
    split = {unit: workers for unit, workers in units.items() if len(workers) != 1}
    assert not split, f"got a World's tests of one function on several workers {split}"


def test_a_run_of_one_process_keeps_the_world_size_order_it_was_given(tmp_path: Path) -> None:
    # mutate's fault runs give the sizes a fault most likely shows at first, one rank last.
    config = RunConfig(
        suites=("uneven",), world_sizes=(2, 4, 1), profile="dev", seed=1, workers=1, out=tmp_path
    )
    assert session.run(config, extra=["-k", "torch_chunk"]) == 0
    starts = [
        world_of(record["nodeid"])
        for line in (tmp_path / "results.jsonl").read_text().splitlines()
        if (record := json.loads(line)).get("kind") == "start"
    ]
    sizes = [world[1] for world in starts if world is not None]
    assert list(dict.fromkeys(sizes)) == [2, 4, 1], f"got World sizes in order {sizes}"
