"""The lr schedules and gradient clippings a training step draws: cases refuse what torch
would, strategies draw only what torch builds, and the clippings do what torch's do."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.schedules import (
    LAMBDA_FACTORS,
    MOMENTUM_CYCLED,
    RESUMABLE,
    Clipping,
    Schedule,
    ScheduleCase,
    changes_lr_at,
)
from harness.cases.training import OPTIMIZERS, OptimConfig
from harness.strategies import (
    clippings,
    resumed_schedule_cases,
    resumed_sequential_cases,
    schedule_cases,
    schedules,
)
from harness.torchkit.optim import build_optimizer
from harness.torchkit.schedules import build_scheduler, clip_gradients
from specs.lr_schedules import trajectory
from suites.checks.training import schedules_on_rank


def test_a_schedule_refuses_an_unknown_scheduler_and_misplaced_parts():
    with pytest.raises(ValueError, match=r"name='CyclicLR' must be one of \('StepLR'"):
        Schedule("CyclicLR")
    step = Schedule("StepLR", (("step_size", 1),))
    with pytest.raises(ValueError, match=r"parts=.* must be \(\) unless SequentialLR"):
        Schedule("StepLR", parts=(step,))
    with pytest.raises(ValueError, match="one more than the milestones, at least two"):
        Schedule("SequentialLR", (("milestones", (1, 2)),), (step, step))


def test_a_clipping_refuses_a_bound_and_norm_options_it_cannot_take():
    with pytest.raises(ValueError, match="bound=0 must be > 0"):
        Clipping(how="norm", bound=0)
    with pytest.raises(ValueError, match="how='value' must be a norm clip where norm options"):
        Clipping(how="value", bound=0.1, norm_type=1.0)
    with pytest.raises(ValueError, match=r"how='both' must be one of \('norm', 'value'"):
        Clipping(how="both", bound=1.0)


def test_schedules_refuse_an_unknown_optimizer():
    with pytest.raises(ValueError, match=r"optimizer='LBFGS' must be one of \('SGD'"):
        schedules("LBFGS")


@settings(max_examples=150, deadline=None)
@given(data=st.data(), name=st.sampled_from(OPTIMIZERS), steps=st.integers(1, 5))
def test_every_drawn_schedule_builds_and_steps_as_often_as_asked(data, name, steps):
    schedule = data.draw(schedules(name, steps=steps))
    if schedule.name == "OneCycleLR" and name not in MOMENTUM_CYCLED:
        assert dict(schedule.options)["cycle_momentum"] is False
    param = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    optimizer = build_optimizer(OptimConfig(name, "default", 0.1), [{"params": [param]}])
    scheduled = build_scheduler(OptimConfig(name, "default", 0.1, scheduler=schedule), optimizer)
    assert scheduled is not None
    for _ in range(steps):
        param.grad = torch.ones_like(param)
        optimizer.step()
        scheduled.step()
    assert all(group["lr"] >= 0 for group in optimizer.param_groups)


def test_a_plateau_schedule_cuts_the_lr_once_its_metric_stops_improving():
    param = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    schedule = Schedule("ReduceLROnPlateau", (("factor", 0.5), ("patience", 0)))
    scheduled = build_scheduler(OptimConfig("SGD", "default", 1.0, scheduler=schedule), optimizer)
    assert scheduled is not None
    lrs = []
    for _ in range(3):
        scheduled.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == [1.0, 0.5, 0.25]


def _with_grads(values: list[list[float]]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros(len(v), dtype=torch.float64)) for v in values]
    for param, grad in zip(params, values, strict=True):
        param.grad = torch.tensor(grad, dtype=torch.float64)
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("foreach", [None, True, False])
def test_a_total_norm_handed_on_clips_as_clip_grad_norm_does(norm_type, foreach):
    values = [[3.0, -4.0], [12.0]]
    split = _with_grads(values)
    clip_gradients(
        split, Clipping(how="total_norm", bound=1.0, norm_type=norm_type, foreach=foreach)
    )
    whole = _with_grads(values)
    torch.nn.utils.clip_grad_norm_(whole, 1.0, norm_type=norm_type)
    for got, want in zip(split, whole, strict=True):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=0)  # the same kernels


def test_a_value_clipping_clamps_every_element():
    params = _with_grads([[0.5, -0.05], [-2.0]])
    clip_gradients(params, Clipping(how="value", bound=0.1))
    assert [p.grad.tolist() for p in params if p.grad is not None] == [[0.1, -0.05], [-0.1]]


@settings(max_examples=50, deadline=None)
@given(clipping=clippings((2.0, 1.0), by_value=False))
def test_clippings_without_values_never_draw_one_by_value(clipping):
    assert clipping.how != "value" and clipping.norm_type in (2.0, 1.0)


def _case(**overrides):
    fields = {
        "mesh_shape": (1,),
        "shapes": ((2,), (3,)),
        "placements": None,
        "dtype": "float64",
        "seed": 0,
        "optimizer": "SGD",
        "lrs": (0.1, 0.05),
        "schedules": (Schedule("ExponentialLR", (("gamma", 0.5),)),),
        "steps": 2,
    }
    return ScheduleCase(**{**fields, **overrides})


def test_a_schedule_case_refuses_what_its_optimizers_cannot_be_given():
    with pytest.raises(ValueError, match="a parameter for each of the 3 groups"):
        _case(lrs=(0.1, 0.05, 0.02))
    plateau = Schedule("ReduceLROnPlateau")
    with pytest.raises(ValueError, match="one per step for ReduceLROnPlateau"):
        _case(schedules=(plateau,), metrics=(1.0,))
    with pytest.raises(ValueError, match="tensor_lr=True must be False but for"):
        _case(optimizer="RMSprop", tensor_lr=True)
    cycling = Schedule("OneCycleLR", (("max_lr", 0.1), ("total_steps", 5)))
    with pytest.raises(ValueError, match=r"optimizer='Adagrad' must be one of .* to cycle"):
        _case(optimizer="Adagrad", schedules=(cycling,))
    per_group = Schedule("LambdaLR", (("lr_lambda", ("inverse_step",)),))
    with pytest.raises(ValueError, match="one value per group, 2"):
        _case(schedules=(Schedule("SequentialLR", (("milestones", (1,)),), (per_group,) * 2),))


class _OneDevice:
    """The part of a RankContext ``schedules_on_rank`` reads for plain tensors."""

    device = torch.device("cpu")


@settings(max_examples=60, deadline=None)
@given(case=schedule_cases(1))
def test_every_drawn_schedule_case_steps_as_the_spec_model_says(case):
    case = replace(case, placements=None)
    with warnings.catch_warnings():
        # torch warns of a scheduler stepped before its optimizer, or of a misused step()
        warnings.simplefilter("error")
        traces = schedules_on_rank(_OneDevice(), case)
    for schedule, trace in zip(case.schedules, traces, strict=True):
        metrics = case.metrics if schedule.name == "ReduceLROnPlateau" else ()
        want = trajectory(
            schedule, case.lrs, case.steps, metrics=metrics, lr_lambdas=LAMBDA_FACTORS
        )
        # float32 tensor lrs round at every step; the suite holds float lrs to a few ulps
        np.testing.assert_allclose(trace.lrs, want.lrs, rtol=1e-5, atol=1e-9)


def test_a_resumed_case_refuses_a_resume_outside_its_steps_or_of_a_plateau():
    with pytest.raises(ValueError, match=r"resume_after=0 must be None or in \[1, 3\)"):
        _case(steps=3, resume_after=0)
    with pytest.raises(ValueError, match=r"resume_after=3 must be None or in \[1, 3\)"):
        _case(steps=3, resume_after=3)
    plateau = Schedule("ReduceLROnPlateau")
    with pytest.raises(ValueError, match=r"schedules' names='ReduceLROnPlateau' must be one of"):
        _case(steps=3, schedules=(plateau,), metrics=(1.0,) * 3, resume_after=1)


def test_changes_lr_at_names_the_epochs_where_each_scheduler_changes_the_lr():
    step = Schedule("StepLR", (("step_size", 2),))
    multi = Schedule("MultiStepLR", (("milestones", (1, 3)),))
    constant = Schedule("ConstantLR", (("total_iters", 3),))
    assert [e for e in range(1, 7) if changes_lr_at(step, e)] == [2, 4, 6]
    assert [e for e in range(1, 7) if changes_lr_at(multi, e)] == [1, 3]
    assert [e for e in range(1, 7) if changes_lr_at(constant, e)] == [3]
    assert not any(changes_lr_at(Schedule("ExponentialLR"), e) for e in range(1, 7))


@settings(max_examples=40, deadline=None)
@given(case=resumed_schedule_cases(1))
def test_a_resumed_case_resumes_where_no_scheduler_changes_the_lr(case):
    assert case.resume_after is not None and 1 <= case.resume_after < case.steps
    assert not any(changes_lr_at(s, case.resume_after) for s in case.schedules)
    assert {s.name for s in case.schedules} <= set(RESUMABLE) - {"SequentialLR"}
    traces = schedules_on_rank(_OneDevice(), replace(case, placements=None))
    for schedule, trace in zip(case.schedules, traces, strict=True):
        want = trajectory(schedule, case.lrs, case.steps, lr_lambdas=LAMBDA_FACTORS)
        np.testing.assert_allclose(trace.lrs, want.lrs, rtol=1e-5, atol=1e-9)


@settings(max_examples=20, deadline=None)
@given(case=resumed_schedule_cases(1, at_a_change=True))
def test_a_case_resumed_at_a_change_resumes_where_its_scheduler_changes_the_lr(case):
    (schedule,) = case.schedules
    assert case.resume_after is not None and changes_lr_at(schedule, case.resume_after)


@settings(max_examples=20, deadline=None)
@given(case=resumed_sequential_cases(1))
def test_a_sequential_case_resumes_past_its_milestone(case):
    (schedule,) = case.schedules
    (milestone,) = dict(schedule.options)["milestones"]
    assert case.resume_after is not None and milestone < case.resume_after < case.steps
