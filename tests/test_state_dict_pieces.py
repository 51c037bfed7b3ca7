"""The pieces behind the state-dict suite: the resume model (specs.resume), the state-dict
cases and their strategies."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.schedules import Schedule
from harness.cases.state_dict import ResumeCase, StateDictCase
from harness.cases.training import TP_LAYOUTS, OptimConfig, ParityCase
from harness.strategies.state_dict import (
    layout_meshes,
    reshard_cases,
    resume_cases,
    state_dict_cases,
    strided_meshes,
    uneven_strided_cases,
)
from specs.resume import Phase, Resolved, plan, segments, step_after

SIZES = st.integers(1, 4)


def test_plan_loses_the_steps_after_the_checkpoint_a_reload_loads():
    actions = (
        ("train", 2),
        ("checkpoint", 0),
        ("train", 1),
        ("resize", 3),
        ("train", 1),
        ("reload", 0),
        ("train", 2),
    )
    phases, history = plan(2, actions)
    assert phases == (
        Phase(
            2,
            None,
            0,
            (
                Resolved("train", None, (0, 2)),
                Resolved("checkpoint", 0, (2, 2)),
                Resolved("train", None, (2, 3)),
            ),
        ),
        Phase(
            3,
            0,
            2,
            (
                Resolved("train", None, (2, 3)),
                Resolved("reload", 0, (2, 2)),
                Resolved("train", None, (2, 4)),
            ),
        ),
    )
    assert history == (2, 2, 3, 3)
    assert segments(history, 3) == ((2, 0, 2), (3, 2, 4))


def test_a_reload_before_any_checkpoint_starts_from_the_initial_state():
    phases, history = plan(1, (("train", 2), ("resize", 4), ("train", 1), ("reload", 0)))
    assert phases[1] == Phase(
        4, None, 0, (Resolved("train", None, (0, 1)), Resolved("reload", None, (0, 0)))
    )
    assert history == ()
    assert segments(history, 4) == ((4, 0, 0),)


@pytest.mark.parametrize(
    ("start", "actions", "message"),
    [
        (0, (), "start=0 must be a positive int"),
        (2, (("jump", 1),), r"actions\[0\]\[0\]='jump' must be one of"),
        (2, (("train", 0),), r"actions\[0\]\[1\]=0 must be a positive int"),
        (2, (("train", 1), ("resize", True)), r"actions\[1\]\[1\]=True must be a positive int"),
    ],
)
def test_plan_rejects_bad_actions(start, actions, message):
    with pytest.raises(ValueError, match=message):
        plan(start, actions)


def test_segments_reject_a_bad_world_size():
    with pytest.raises(ValueError, match=r"history\[1\]=0 must be a positive int"):
        segments((2, 0), 2)


@st.composite
def _actions(draw: st.DrawFn) -> tuple[tuple[str, int], ...]:
    kinds = st.sampled_from(("train", "checkpoint", "reload", "resize"))
    count = draw(st.integers(0, 8))
    return tuple(
        (k, draw(SIZES) if k in ("train", "resize") else 0)
        for k in [draw(kinds) for _ in range(count)]
    )


@settings(max_examples=300)
@given(start=SIZES, actions=_actions())
def test_plan_phases_chain_and_the_history_is_the_final_step_count(start, actions):
    phases, history = plan(start, actions)
    assert len(phases) == 1 + sum(kind == "resize" for kind, _ in actions)
    assert len(history) == step_after(start, actions)
    for phase in phases:
        step = phase.first_step
        for action in phase.actions:
            if action.kind == "train":
                assert action.steps[0] == step
            step = action.steps[1]
    covered = [
        size
        for size, first, stop in segments(history, phases[-1].world_size)
        for _ in range(first, stop)
    ]
    assert covered == list(history)


def _case(layout: str = "fsdp", **changes: object) -> StateDictCase:
    train = ParityCase(
        layout, (2,), (3, 4), True, 1, "float64", OptimConfig("Adam", "default", 0.1), 1, None, 0
    )
    return replace(StateDictCase(train), **changes)  # type: ignore[arg-type]


def test_state_dict_case_refuses_other_layouts_and_schedulers():
    with pytest.raises(ValueError, match=r"train.layout='ddp' must be one of"):
        _case("ddp")
    step_lr = Schedule("StepLR", (("gamma", 0.5), ("step_size", 1)))
    scheduled = OptimConfig("SGD", "default", 0.1, scheduler=step_lr)
    with pytest.raises(ValueError, match=r"train.optim.scheduler=Schedule\(name='StepLR'"):
        StateDictCase(replace(_case().train, optim=scheduled))


def test_resume_case_names_a_world_size_without_layout():
    case = ResumeCase(_case(), 2, (("resize", 3),), ((2, "fsdp", (2,)),))
    assert case.at(2).train.mesh_shape == (2,)
    with pytest.raises(ValueError, match=r"world_size=3 must be one of the sizes of layouts="):
        case.at(3)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), world_size=SIZES)
def test_state_dict_cases_are_valid_by_construction(data, world_size):
    case = data.draw(state_dict_cases(world_size, steps=(0, 3), reshard=True, largest_dim=True))
    train = case.train
    assert math.prod(train.mesh_shape) == world_size and 0 <= train.steps <= 3
    assert train.optim.scheduler is None and (train.optim.name, train.optim.impl) != (
        "SGD",
        "fused",
    )
    if train.optim.name == "SGD":
        assert dict(train.optim.options)["momentum"] > 0  # every optimizer keeps state
    rafs = case.reshard_after_forward
    if not (rafs is None or isinstance(rafs, bool)):
        assert case.shard_size % rafs == 0
    assert not (case.shard_largest_dim and train.layout in TP_LAYOUTS)
    assert not (world_size == 1 and train.layout in TP_LAYOUTS)
    assert not case.offload and not case.pin_memory


@settings(max_examples=100, deadline=None)
@given(data=st.data(), world_size=SIZES)
def test_even_strided_cases_give_every_rank_an_equal_piece(data, world_size):
    case = data.draw(state_dict_cases(world_size, layouts=TP_LAYOUTS, even_strided=True))
    train = case.train
    if train.layout in TP_LAYOUTS:  # world size 1 falls back to fsdp
        assert train.dims[1] % (case.shard_size * train.mesh_shape[-1]) == 0


@settings(max_examples=100, deadline=None)
@given(data=st.data(), world_size=st.sampled_from((4, 6, 8)))
def test_uneven_strided_cases_shard_tp_pieces_unevenly(data, world_size):
    case = data.draw(uneven_strided_cases(world_size))
    train = case.train
    tp = train.mesh_shape[-1]
    assert train.mesh_shape in strided_meshes(world_size, train.layout)
    assert case.shard_size > 1 and tp > 1 and math.prod(train.mesh_shape) == world_size
    assert train.dims[1] % tp == 0 and train.dims[1] % (case.shard_size * tp) != 0


def test_strided_meshes_need_shard_and_tp_axes_of_two():
    assert strided_meshes(4, "fsdp_tp") == ((2, 2),)
    assert strided_meshes(4, "hsdp_tp") == ((1, 2, 2),)
    assert strided_meshes(8, "hsdp_tp") == ((1, 2, 4), (1, 4, 2), (2, 2, 2))
    assert strided_meshes(3, "fsdp_tp") == strided_meshes(2, "hsdp_tp") == ()


@settings(max_examples=150, deadline=None)
@given(data=st.data(), world_size=SIZES)
def test_reshard_cases_load_at_a_session_size_under_a_usable_layout(data, world_size):
    case = data.draw(reshard_cases(world_size, (1, 3, 4)))
    load = case.load.train
    assert math.prod(load.mesh_shape) in (1, 3, 4)
    assert load.mesh_shape in layout_meshes(math.prod(load.mesh_shape), load.layout, load.dims)
    assert load.seed != case.save.train.seed and load.dims == case.save.train.dims
    assert case.save.train.steps >= 1


@settings(max_examples=150, deadline=None)
@given(data=st.data(), world_size=SIZES)
def test_resume_cases_checkpoint_only_after_training(data, world_size):
    case = data.draw(resume_cases(world_size, (1, 2, 4)))
    for index, (kind, arg) in enumerate(case.actions):
        if kind == "checkpoint":
            assert step_after(world_size, case.actions[:index]) > 0
        if kind == "resize":
            assert arg in (1, 2, 4)
            assert case.at(arg).train.layout in ("fsdp", "hsdp")
    assert case.at(world_size) == case.base


def test_layout_meshes_follow_the_layout():
    assert layout_meshes(4, "fsdp", (3, 4)) == ((4,),)
    assert layout_meshes(4, "hsdp", (3, 4)) == ((1, 4), (2, 2), (4, 1))
    assert layout_meshes(4, "fsdp_tp", (3, 6, 2)) == ((2, 2), (4, 1))
    assert layout_meshes(4, "fsdp_tp", (3, 4)) == ()
    assert layout_meshes(4, "hsdp_tp", (3, 6, 2)) == (
        (1, 2, 2),
        (1, 4, 1),
        (2, 1, 2),
        (2, 2, 1),
        (4, 1, 1),
    )


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: state_dict_cases(2, layouts=("ddp",)), r"layouts=\('ddp',\) must be"),
        (lambda: state_dict_cases(2, steps=(2, 1)), r"steps=\(2, 1\) must be"),
        (lambda: state_dict_cases(2, pin_memory=()), r"pin_memory=\(\) must be"),
        (lambda: state_dict_cases(0), "world_size=0"),
        (
            lambda: reshard_cases(2, ()),
            r"load_sizes=\(\) must be a non-empty sequence of world sizes",
        ),
        (lambda: resume_cases(2, (2,), max_actions=0), "max_actions=0"),
        (lambda: layout_meshes(2, "zero", (1, 2)), "layout='zero' must be one of"),
        (lambda: strided_meshes(4, "hsdp"), "layout='hsdp' must be one of"),
        (
            lambda: uneven_strided_cases(3),
            "world_size=3 must be a size with a TP mesh whose shard and TP axes",
        ),
    ],
)
def test_strategies_reject_bad_arguments(build, message):
    with pytest.raises(ValueError, match=message):
        build()
