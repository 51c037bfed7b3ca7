"""The pieces behind the checkpoints suite: its cases refuse bad values naming them, its
strategies draw valid cases (the options each property leaves out never drawn), and the
data position a checkpoint holds as a user ``Stateful``."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

from harness.cases.checkpoints import (
    AsyncCase,
    AsyncFailureCase,
    CheckpointOptions,
    OptionsCase,
    StatefulCase,
)
from harness.errors import InvalidArgument
from harness.strategies.checkpoints import (
    async_cases,
    async_failure_cases,
    checkpoint_options,
    dcp_options_cases,
    stateful_cases,
)
from harness.torchkit.checkpoints import DataPosition

SIZES = st.integers(1, 4)
FAST = settings(max_examples=15, deadline=None)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"load_options": (("flatten_optimizer_state_dict", True),)}, "load_options="),
        ({"save_options": (("broadcast_from_rank0", True),)}, "save_options="),
        (
            {"load_options": (("full_state_dict", True), ("cpu_offload", True))},
            "load_options=",
        ),
        ({"writer": (("thread_count", "2"),)}, "writer thread_count="),
    ],
)
def test_checkpoint_options_refuse_what_torch_cannot_take(fields: dict, named: str) -> None:
    with pytest.raises(InvalidArgument, match=named):
        CheckpointOptions(**fields)


@FAST
@given(data=st.data())
def test_cases_refuse_bad_values_naming_them(data: st.DataObject) -> None:
    options = data.draw(dcp_options_cases(2, (1, 2), broadcast=True, plan_caching=False))
    with pytest.raises(InvalidArgument, match="rewrite='elsewhere'"):
        replace(options, rewrite="elsewhere")
    with pytest.raises(InvalidArgument, match="rewrite='plan_cached'"):
        replace(options, rewrite="plan_cached")
    saved = data.draw(async_cases(2))
    with pytest.raises(InvalidArgument, match="after=0"):
        replace(saved, after=0)
    with pytest.raises(InvalidArgument, match="checkpointer='process'"):
        replace(saved, checkpointer="process")
    with pytest.raises(InvalidArgument, match="staging option='use_magic'"):
        replace(saved, staging=(("use_magic", True),))
    failing = data.draw(async_failure_cases(2))
    with pytest.raises(InvalidArgument, match="failure='disk_full'"):
        replace(failing, failure="disk_full")
    with pytest.raises(InvalidArgument, match="failing_rank=2"):
        replace(failing, failing_rank=2)
    resumed = data.draw(stateful_cases(2))
    named = resumed.groups[0][0]
    with pytest.raises(InvalidArgument, match="groups="):
        replace(resumed, groups=(), lrs=())
    with pytest.raises(InvalidArgument, match="groups="):
        replace(resumed, groups=((), (), *resumed.groups), lrs=(0.1, 0.1, *resumed.lrs))
    with pytest.raises(InvalidArgument, match="groups="):
        replace(resumed, groups=((),), lrs=(0.1,))
    with pytest.raises(InvalidArgument, match="lrs="):
        replace(resumed, lrs=(*resumed.lrs, 0.1))
    with pytest.raises(InvalidArgument, match="frozen="):
        replace(resumed, frozen=(named,))
    with pytest.raises(InvalidArgument, match="save_at="):
        replace(resumed, save_at=resumed.case.train.steps)
    with pytest.raises(InvalidArgument, match="empty='first'"):
        stateful_cases(2, empty="first")


@FAST
@given(data=st.data(), size=SIZES)
def test_options_strategies_leave_out_what_their_property_leaves_out(
    data: st.DataObject, size: int
) -> None:
    broadcast, caching = data.draw(st.booleans()), data.draw(st.booleans())
    case = data.draw(
        dcp_options_cases(size, (1, 2, 3, 4), broadcast=broadcast, plan_caching=caching)
    )
    assert isinstance(case, OptionsCase)
    saving, loading = dict(case.options.save_planner), dict(case.options.load_options)
    assert caching or "enable_plan_caching" not in saving
    assert broadcast or "broadcast_from_rank0" not in loading
    assert not (loading.get("full_state_dict") and loading.get("flatten_optimizer_state_dict"))
    assert "dedup_replicated_tensors" not in saving
    flat = data.draw(
        dcp_options_cases(
            size, (size,), broadcast=broadcast, plan_caching=caching, flattened_full_load=True
        )
    )
    loading = dict(flat.options.load_options)
    assert loading["full_state_dict"] and loading["flatten_optimizer_state_dict"]
    assert flat.rewrite == "empty"
    assert isinstance(data.draw(checkpoint_options()), CheckpointOptions)


@FAST
@given(data=st.data(), size=SIZES)
def test_async_and_stateful_strategies_draw_valid_cases(data: st.DataObject, size: int) -> None:
    accelerator = data.draw(st.booleans())
    saved = data.draw(async_cases(size, accelerator=accelerator))
    assert isinstance(saved, AsyncCase)
    names = {name for name, _ in saved.staging or ()}
    assert accelerator or "use_non_blocking_copy" not in names
    for empty in ("none", "last", "before"):
        case = data.draw(stateful_cases(size, empty=empty))
        assert isinstance(case, StatefulCase)
        assert case.case.train.layout in ("fsdp", "hsdp")
        assert 1 <= case.save_at < case.case.train.steps
        hollow = [i for i, group in enumerate(case.groups) if not group]
        if empty == "none":
            assert hollow == []
        elif empty == "last":
            assert hollow in ([], [len(case.groups) - 1])
        else:
            assert len(hollow) == 1 and hollow[0] < len(case.groups) - 1


def test_async_strategies_start_from_the_writer_as_stager_and_a_failure_of_each_kind() -> None:
    # a derandomized profile's first example is the simplest draw: the FileSystemWriter
    # staging itself (no async_stager), where a stager staging by reference shows
    simplest = find(async_cases(2), lambda case: True)
    assert simplest.storage_writer and simplest.staging is None
    for failure in ("overwrite", "write_data"):
        found = find(async_failure_cases(3), lambda case, f=failure: case.failure == f)
        assert isinstance(found, AsyncFailureCase)
        assert 0 <= found.failing_rank < 3


def test_data_position_counts_steps_and_loads_back() -> None:
    position = DataPosition()
    assert [position.next_step() for _ in range(3)] == [0, 1, 2]
    assert position.state_dict() == {"step": 3, "handed_out": 3}
    resumed = DataPosition()
    resumed.load_state_dict(position.state_dict())
    assert resumed.next_step() == 3
    assert resumed.state_dict() == {"step": 4, "handed_out": 4}
