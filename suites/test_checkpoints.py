"""DCP checkpoints under their options: planners, storage and state-dict options never change
what is loaded back; an async save holds the state of the moment it was called; a DCP state
dict holding an lr scheduler and a user ``Stateful`` resumes training exactly.

Every comparison is exact (rtol=atol=0): saving and loading move values and compute
nothing, and training on repeats the same arithmetic on the same ranks."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness import World, Worlds, parity
from harness.cases.checkpoints import OptionsCase, StatefulCase
from harness.parity import assert_equal_values, failure
from harness.profiles import costly
from harness.strategies import (
    async_cases,
    async_failure_cases,
    dcp_options_cases,
    state_dict_cases,
    stateful_cases,
)
from suites.checks import checkpoints as checks
from suites.checks.directories import driver_directory
from suites.checks.state_dict import assert_same_state

# Each example trains, saves and loads at two world sizes: about 2 s on threads, so the
# 8-example floor (2 per world size) costs 15 s at ci over world sizes 1-4 (processes: 100 s).
OPTIONS = costly(50)


def _assert_options_roundtrip(
    world: World, worlds: Worlds, data: st.DataObject, *, flattened_full_load: bool
) -> None:
    strategy = dcp_options_cases(
        world.world_size,
        worlds.sizes,
        broadcast=world.runner != "threads",
        plan_caching=True,
        flattened_full_load=flattened_full_load,
    )
    case = data.draw(strategy, label="case")
    parity.attach(case.call())
    loading = worlds.get(math.prod(case.reshard.load.train.mesh_shape))
    with driver_directory("distconf-ckpt-") as root:
        saved = world.run(checks.options_save_on_rank, case, root)
        for rank, seen in enumerate(saved):
            if case.refused:
                # FileSystemWriter(overwrite=False) documents "whether to allow overwriting
                # existing checkpoints": a directory holding one is refused
                if seen.refusal is None or "Checkpoint already exists" not in seen.refusal:
                    raise failure(
                        f"rank {rank}: got {seen.refusal!r}, should refuse to write over an "
                        "earlier checkpoint with 'Checkpoint already exists' (overwrite=False)"
                    )
            else:
                what = f"what dcp.save over an earlier checkpoint raised on rank {rank}"
                assert_equal_values(seen.refusal, None, what=what)
            assert_equal_values(seen.error, None, what=f"what dcp.save raised on rank {rank}")
        loaded = loading.run(checks.options_load_on_rank, case, root)
    state = saved[0].state
    for rank, seen in enumerate(saved):
        assert_same_state(seen.state, state, what=f"the state gathered on saving rank {rank}")
    for rank, (got, _) in enumerate(loaded):
        what = f"the state loaded on rank {rank} of {loading.world_size}"
        assert_same_state(got, state, what=what)
    _assert_one_rank_values(case, [seen.own for seen in saved], [own for _, own in loaded])


def _assert_one_rank_values(
    case: OptionsCase, saved: list[checks.RankValues], loaded: list[checks.RankValues]
) -> None:
    """Plain values each rank saved under a key every rank shares are saved once: every
    loading rank reads one saving rank's, rank 0's under dedup_save_to_lowest_rank ("save
    all replicated items on the lowest rank", its docs), exactly."""
    lowest = dict(case.options.save_planner).get("dedup_save_to_lowest_rank", False)
    for rank, got in enumerate(loaded):
        what = f"the per-rank losses and name loaded on rank {rank}"
        if lowest:
            assert_equal_values(got, saved[0], what=f"{what} (the lowest rank's)")
        elif got not in saved:
            raise failure(f"{what}: got {got!r}, should be one saving rank's of {saved!r}")
        assert_equal_values(got, loaded[0], what=f"{what} (against rank 0's)")


@pytest.mark.spec("state_dict.checkpoint.options_roundtrip")
@OPTIONS
@given(data=st.data())
def test_checkpoint_options_never_change_what_is_loaded(
    world: World, worlds: Worlds, data: st.DataObject
) -> None:
    _assert_options_roundtrip(world, worlds, data, flattened_full_load=False)


@pytest.mark.spec("state_dict.checkpoint.flattened_full_load")
@OPTIONS
@given(data=st.data())
def test_a_flattened_optimizer_state_loads_as_a_full_state_dict(
    world: World, worlds: Worlds, data: st.DataObject
) -> None:
    _assert_options_roundtrip(world, worlds, data, flattened_full_load=True)


# One world, one save and load, no second World: about 12 times a placement example.
UNFLATTENED = costly(12)


@pytest.mark.spec("state_dict.checkpoint.unflattened_nested")
@UNFLATTENED
@given(data=st.data())
def test_a_nested_state_dict_saved_unflattened_loads_back(
    world: World, data: st.DataObject
) -> None:
    case = data.draw(state_dict_cases(world.world_size), label="case")
    parity.attach(f"{case.call()}; DefaultSavePlanner(flatten_state_dict=False) both ways")
    with driver_directory("distconf-ckpt-") as root:
        states = world.run(checks.unflattened_on_rank, case, root)
    for rank, (saved, loaded) in enumerate(states):
        assert_same_state(loaded, saved, what=f"the state loaded on rank {rank}")


# Trains, saves while training on, loads, and trains a second model straight through.
ASYNC = costly(20)
ASYNC_ON_THREADS = (
    "dcp.async_save needs a process group with a CPU backend (it asserts 'A CPU backend must "
    "be enabled for async save'); the threaded process group registers no device types, and "
    "its background thread would run collectives outside any rank thread's world: the "
    "processes runner (gloo) serves it"
)


@pytest.mark.spec("state_dict.checkpoint.async_snapshot")
@pytest.mark.runner("processes", reason=ASYNC_ON_THREADS)
@ASYNC
@given(data=st.data())
def test_async_save_holds_the_state_at_the_call(world: World, data: st.DataObject) -> None:
    case = data.draw(async_cases(world.world_size, accelerator=world.device != "cpu"), label="case")
    parity.attach(case.call())
    with driver_directory("distconf-ckpt-") as root:
        states = world.run(checks.async_on_rank, case, root)
    for rank, seen in enumerate(states):
        what = f"the checkpoint async_save wrote, loaded on rank {rank}"
        assert_same_state(seen.loaded, seen.at_call, what=f"{what} (the state at the call)")
        what = f"training on while async_save ran, rank {rank}"
        assert_same_state(seen.after, seen.straight, what=f"{what} (training without a save)")


# Trains, saves, trains, fails an async save, loads: cheaper than async_snapshot.
ASYNC_FAILURE = costly(15)


@pytest.mark.spec("state_dict.checkpoint.async_failure_reported")
@pytest.mark.runner("processes", reason=ASYNC_ON_THREADS)
@ASYNC_FAILURE
@given(data=st.data())
def test_a_failed_async_save_raises_everywhere(world: World, data: st.DataObject) -> None:
    case = data.draw(async_failure_cases(world.world_size), label="case")
    parity.attach(case.call())
    with driver_directory("distconf-ckpt-") as root:
        seen = world.run(checks.async_failure_on_rank, case, root)
    # async_save's docs: its future "holds the result" of the save; a save that fails must
    # raise from it (or at the call), never resolve as if the checkpoint were written
    words = "Checkpoint already exists" if case.failure == "overwrite" else "injected"
    for rank, failed in enumerate(seen):
        if failed.raised is None or words not in failed.raised:
            raise failure(
                f"what the failing async save raised on rank {rank}: got {failed.raised!r}, "
                f"should be an error saying {words!r}"
            )
        what = f"the earlier checkpoint loaded after the failed async save, rank {rank}"
        assert_same_state(failed.loaded, failed.earlier, what=what)


# Two trainings and a save and load an example: the 8-example floor takes 5-6 s at ci over
# world sizes 1-4 (threads and processes alike).
STATEFUL = costly(50)


def _assert_resumed_exactly(world: World, case: StatefulCase) -> None:
    with driver_directory("distconf-ckpt-") as root:
        resumed = world.run(checks.resumed_on_rank, case, root)
    straight = world.run(checks.uninterrupted_on_rank, case)
    for rank, (got, want) in enumerate(zip(resumed, straight, strict=True)):
        # dcp.load's docs: it loads in place, into the tensors and Stateful objects given
        what = f"the state dict's entries dcp.load replaced instead of loading into, rank {rank}"
        assert_equal_values(got.replaced, (), what=what)
        assert_equal_values(got.lrs, want.lrs, what=f"each group's lr after each step, rank {rank}")
        what = f"the data position's state on rank {rank}"
        assert_equal_values(got.position, want.position, what=what)
        what = f"the resumed model and optimizer on rank {rank}"
        assert_same_state(got.state, want.state, what=f"{what} against training straight through")


@pytest.mark.spec("state_dict.checkpoint.stateful")
@STATEFUL
@given(data=st.data())
def test_scheduler_and_stateful_resume_exactly(world: World, data: st.DataObject) -> None:
    case = data.draw(stateful_cases(world.world_size, empty="last"), label="case")
    parity.attach(case.call())
    _assert_resumed_exactly(world, case)


# The same resume with an empty parameter group before the others (fails at its first
# example on torch 2.13: 3-4 s at ci over world sizes 1-4).
EMPTY_GROUP = costly(50)


@pytest.mark.spec("state_dict.checkpoint.empty_group")
@EMPTY_GROUP
@given(data=st.data())
def test_an_empty_parameter_group_resumes_exactly(world: World, data: st.DataObject) -> None:
    case = data.draw(stateful_cases(world.world_size, empty="before"), label="case")
    parity.attach(case.call())
    _assert_resumed_exactly(world, case)
