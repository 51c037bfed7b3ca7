"""Per-call cost of ``world.run`` on persistent Worlds, against spawning ranks per check.

The baseline does what upstream's ``MultiProcessTestCase`` does for every test: spawn N
processes, each importing torch and joining a gloo group on a FileStore, run the check once,
destroy the group and exit. Both are measured in the same run, on the same bodies.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from hypothesis import given, settings

from harness.cases.placements import DistributeCase
from harness.errors import check_one_of
from harness.strategies import distribute_cases
from harness.torchkit.context import RankContext
from harness.torchkit.dtensor import distribute, view_of


def trivial(ctx: RankContext) -> None:
    return None


def placement(ctx: RankContext, case: DistributeCase) -> None:
    """The rank side of the distribute property (suites/test_placements.py) for one case:
    what ``suites.checks.dtensor.distribute_on_rank`` does, written here because nothing
    under ``harness`` imports ``suites``."""
    view_of(distribute(ctx, case), ctx)


def sample_cases(world_size: int, count: int) -> list[DistributeCase]:
    """``count`` distribute cases, the same in every run (derandomized hypothesis)."""
    cases: list[DistributeCase] = []

    @settings(max_examples=count, derandomize=True, database=None, deadline=None)
    @given(distribute_cases(world_size))
    def collect(case: DistributeCase) -> None:
        cases.append(case)

    collect()
    return cases[:count]


def time_calls(
    runner: str, world_size: int, body: str, calls: int, *, lacks: frozenset[str] = frozenset()
) -> float:
    """Mean milliseconds per ``world.run`` on a warm World (every case timed has run once), on
    the cases a World lacking ``lacks`` serves (the same cases on every runner compared)."""
    from harness import open_world

    fn, argument_lists = _body(body, world_size)
    served = [args for args in argument_lists if all(_serves(a, lacks) for a in args)]
    argument_lists = served[:calls]  # the calls rotate through these: warm only what is timed
    torchrun = None
    if runner == "torchrun":  # two local "nodes", torchrun started here
        from harness.runners.torchrun.world import TorchrunOptions

        nodes = 2 if world_size % 2 == 0 else 1
        torchrun = TorchrunOptions(
            world_size=world_size, nnodes=nodes, nproc_per_node=world_size // nodes
        )
    with open_world(runner, world_size=world_size, torchrun=torchrun) as world:
        for args in argument_lists:
            world.run(fn, *args)  # warm: ranks started, every mesh built
        started = time.perf_counter()
        for call in range(calls):
            world.run(fn, *argument_lists[call % len(argument_lists)])
        return 1000 * (time.perf_counter() - started) / calls


def time_spawn_per_check(world_size: int, body: str, trials: int) -> float:
    """Mean milliseconds to spawn ranks, join a group, run ``body`` once, and tear down."""
    fn, argument_lists = _body(body, world_size)
    context = multiprocessing.get_context("spawn")
    total = 0.0
    for trial in range(trials):
        args = argument_lists[trial % len(argument_lists)]
        with tempfile.TemporaryDirectory() as directory:
            store = os.path.join(directory, "store")
            started = time.perf_counter()
            ranks = [
                context.Process(target=_spawned_rank, args=(r, world_size, store, fn, args))
                for r in range(world_size)
            ]
            for process in ranks:
                process.start()
            for process in ranks:
                process.join(300)
            total += time.perf_counter() - started
            codes = [process.exitcode for process in ranks]
            if codes != [0] * world_size:
                raise RuntimeError(f"spawn-per-check baseline failed: exit codes {codes}")
    return 1000 * total / trials


def _spawned_rank(
    rank: int, world_size: int, store: str, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import FileStore

    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, store=FileStore(store, world_size)
    )
    fn(RankContext(rank, world_size, torch.device("cpu"), "spawn-per-check"), *args)
    dist.barrier()
    dist.destroy_process_group()


def _serves(case: object, lacks: frozenset[str]) -> bool:
    """Whether a World lacking ``lacks`` can take ``case`` (``World.lacks``: a mesh from
    ``DeviceMesh.from_group``, a source rank other than 0)."""
    if not isinstance(case, DistributeCase):
        return True
    if "mesh.from_group" in lacks and case.mesh.how == "from_group":
        return False
    return "scatter.group_src" not in lacks or case.src_data_rank in (0, None)


def _body(name: str, world_size: int) -> tuple[Callable[..., Any], list[tuple[Any, ...]]]:
    """The rank function and the argument tuples its calls rotate through."""
    check_one_of("body", name, ("trivial", "placement"))
    if name == "trivial":
        return trivial, [()]
    return placement, [(case,) for case in sample_cases(world_size, 50)]
