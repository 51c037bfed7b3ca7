"""The pieces behind the state_dict_steps suite: the mid-step part of the resume model
(specs.resume), MidStepCase and mid_step_cases, TiedAfterForwardCase and its strategy."""

from __future__ import annotations

import math
import pickle
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.modules import GraphCase
from harness.cases.state_dict import MidStepCase, TiedAfterForwardCase
from harness.errors import InvalidArgument
from harness.strategies import mid_step_cases, tied_after_forward_cases
from specs.modules import ModuleGraph, Node, Wrap
from specs.resume import (
    MID_STEP_POINTS,
    gradients_held,
    initialises_optimizer,
    optimizer_is_empty,
    resume_step,
)

LINEAR = ModuleGraph((Node("linear"),), (), (Wrap("fully_shard", (0,)),))


def _case(**changes: object) -> MidStepCase:
    case = MidStepCase(
        GraphCase(LINEAR, 2, 0, steps=2),
        "Adam",
        0.0,
        (2,),
        None,
        True,
        1,
        "after_forward",
        "dcp",
    )
    return replace(case, **changes)  # type: ignore[arg-type]


def _tied(**changes: object) -> TiedAfterForwardCase:
    case = TiedAfterForwardCase((4,), 2, 2, "state_dict", 0)
    return replace(case, **changes)  # type: ignore[arg-type]


def test_every_point_resumes_at_its_own_step():
    for step in range(3):
        assert {resume_step(step, point) for point in MID_STEP_POINTS} == {step}


def test_only_step_zero_before_its_backward_initialises_the_optimizer():
    found = {
        (step, point)
        for step in range(3)
        for point in MID_STEP_POINTS
        if initialises_optimizer(step, point)
    }
    assert found == {(0, "between_steps"), (0, "after_zero_grad"), (0, "after_forward")}
    assert optimizer_is_empty(0, "after_backward") and not optimizer_is_empty(1, "between_steps")


def test_gradients_are_held_as_zero_grad_leaves_them():
    assert gradients_held(0, "after_backward") and not gradients_held(0, "between_steps")
    assert gradients_held(1, "between_steps") and not gradients_held(1, "after_zero_grad")
    assert gradients_held(1, "after_forward", set_to_none=False)
    assert not gradients_held(0, "after_forward", set_to_none=False)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: resume_step(-1, "after_forward"), "step=-1 must be an int >= 0"),
        (lambda: resume_step(0, "after_step"), "point='after_step' must be one of"),
        (lambda: _case(optimizer="Adagrad"), "optimizer='Adagrad' must be one of"),
        (lambda: _case(via="disk"), "via='disk' must be one of"),
        (lambda: _case(at_step=2), "at_step=2 must be below graph.steps"),
        (lambda: _case(mesh_shape=(1, 1, 2)), r"mesh_shape=\(1, 1, 2\) must be 1-D or 2-D"),
        (lambda: _case(probe_points=("after_step",)), r"probe_points=\('after_step',\)"),
        (lambda: _tied(reshard_after_forward=True), "reshard_after_forward=True must be False"),
        (lambda: _tied(reshard_after_forward=3), "reshard_after_forward=3 must be False"),
        (lambda: _tied(via="disk"), "via='disk' must be one of"),
        (lambda: mid_step_cases(0), "world_size=0"),
        (lambda: tied_after_forward_cases(0), "world_size=0"),
        (lambda: mid_step_cases(2, first_step_dcp=1), "first_step_dcp=1 must be a bool"),
    ],
)
def test_bad_values_are_refused(call, message):
    with pytest.raises(InvalidArgument, match=message):
        call()


@settings(max_examples=150, deadline=None)
@given(data=st.data(), world_size=st.integers(1, 4))
def test_mid_step_cases_leave_out_the_known_deviations(data, world_size):
    case = data.draw(mid_step_cases(world_size))
    assert math.prod(case.mesh_shape) == world_size and len(case.mesh_shape) in (1, 2)
    raf = case.reshard_after_forward
    if not isinstance(raf, bool | None):
        assert 1 < raf < case.mesh_shape[-1] and case.mesh_shape[-1] % raf == 0
    assert 2 <= case.graph.steps <= 3 and case.at_step < case.graph.steps
    if not case.stateless:  # SGD without momentum: its zero-lr initialisation changes nothing
        assert not initialises_optimizer(case.at_step, case.point)
        assert case.via == "memory" or not optimizer_is_empty(case.at_step, case.point)
    momentum = dict(case.optimizer_options).get("momentum")
    assert momentum in ((0.0, 0.9) if case.optimizer == "SGD" else (None,))
    if case.graph.graph.ties and case.reshard_after_forward not in (None, True):
        assert case.point != "after_forward" and "after_forward" not in case.probe_points
    assert case.probe_points in ((), tuple(p for p in MID_STEP_POINTS if p in case.probe_points))
    assert pickle.loads(pickle.dumps(case)) == case
    assert f"step {case.at_step} {case.point}, via {case.via}" in case.call()


@settings(max_examples=30, deadline=None)
@given(data=st.data(), world_size=st.integers(1, 4))
def test_first_step_dcp_cases_are_the_deviation_only(data, world_size):
    case = data.draw(mid_step_cases(world_size, first_step_dcp=True))
    assert (case.at_step, case.point, case.via) == (0, "after_backward", "dcp")


@settings(max_examples=60, deadline=None)
@given(data=st.data(), world_size=st.integers(1, 4))
def test_tied_after_forward_cases_keep_the_parameters_unsharded_after_the_forward(data, world_size):
    case = data.draw(tied_after_forward_cases(world_size))
    assert math.prod(case.mesh_shape) == world_size and len(case.mesh_shape) in (1, 2)
    raf = case.reshard_after_forward
    assert raf is False or (1 < raf < case.mesh_shape[-1] and case.mesh_shape[-1] % raf == 0)
    assert pickle.loads(pickle.dumps(case)) == case
    assert "[first, second] or [second, first]" in case.call()
