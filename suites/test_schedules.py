"""Learning-rate schedules: torch.optim.lr_scheduler on every rank against the arithmetic its
documentation states (specs/lr_schedules.py). The parity properties step the same scheduler
on one device and sharded, so a scheduler that computes the wrong lr moves both sides alike;
here every lr is held to the spec model. The optimizer options torch refuses on the CPU are
checked here too (test_optim_parity.py is at its size limit)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness import World, parity
from harness.cases.schedules import LAMBDA_FACTORS, ScheduleCase
from harness.parity import assert_close, assert_equal_values
from harness.profiles import costly, property_settings
from harness.strategies import (
    DTENSOR_UNSUPPORTED,
    resumed_schedule_cases,
    resumed_sequential_cases,
    schedule_cases,
    step_cases,
)
from specs.lr_schedules import Trajectory, trajectory
from suites.checks.optim_refusals import refused_step_on_rank
from suites.checks.training import LrTrace, schedules_on_rank

PROPERTY = property_settings()

# Float lrs: torch's chainable schedulers multiply the last lr by a factor each step where the
# model evaluates the closed form once: a rounding a step (measured: within 4 ulps, 8.5e-16
# relative, over 3,000 cases of up to 8 steps). The atol is an ulp of the largest lr drawn
# (0.2), for a value the closed form cancels to near zero. Tensor lrs are float32 (the
# default dtype of torch.tensor(lr)): each step rounds the lr to float32 (measured: within
# 3.2e-7 relative).
LR_TOLERANCE = {False: (1e-14, 1e-17), True: (2e-6, 1e-9)}  # (rtol, atol) by tensor_lr
WHY = "torch multiplies a factor per step, the model takes the closed form"


@pytest.mark.spec("optim.schedule.matches_spec")
# 31 ms an example at world size 4; mutate's lr faults met at the 5th, 9th and 18th
@costly(2, needs=18)
@given(data=st.data())
def test_lr_schedules_match_the_spec_model(world: World, data: st.DataObject) -> None:
    case = data.draw(schedule_cases(world.world_size), label="case")
    parity.attach(case.call())
    expected = _model_trajectories(case)
    _assert_traces_follow(world.run(schedules_on_rank, case), expected, case)


# A resumed run's lrs are the uninterrupted run's: the same model trajectory, same tolerance.
@pytest.mark.spec("optim.schedule.resumed_with_last_epoch")
@costly(5)
@given(data=st.data())
def test_schedulers_resumed_with_last_epoch_go_on_as_before(
    world: World, data: st.DataObject
) -> None:
    case = data.draw(resumed_schedule_cases(world.world_size), label="case")
    parity.attach(case.call())
    expected = _model_trajectories(case)
    _assert_traces_follow(world.run(schedules_on_rank, case), expected, case)


@pytest.mark.spec("optim.schedule.resumed_at_a_change")
@costly(4)
@given(data=st.data())
def test_schedulers_resumed_where_they_change_the_lr(world: World, data: st.DataObject) -> None:
    case = data.draw(resumed_schedule_cases(world.world_size, at_a_change=True), label="case")
    parity.attach(case.call())
    expected = _model_trajectories(case)
    _assert_traces_follow(world.run(schedules_on_rank, case), expected, case)


@pytest.mark.spec("optim.schedule.sequential_resumed_with_last_epoch")
@costly(4)
@given(data=st.data())
def test_sequential_schedulers_resumed_past_a_milestone(world: World, data: st.DataObject) -> None:
    case = data.draw(resumed_sequential_cases(world.world_size), label="case")
    parity.attach(case.call())
    expected = _model_trajectories(case)
    _assert_traces_follow(world.run(schedules_on_rank, case), expected, case)


def _model_trajectories(case: ScheduleCase) -> list[Trajectory]:
    """Each scheduler's lrs and momenta as specs.lr_schedules models them, uninterrupted."""
    parity.note_reference("plain Python: specs.lr_schedules (lr_scheduler's documented arithmetic)")
    return [
        trajectory(
            schedule,
            case.lrs,
            case.steps,
            metrics=case.metrics if schedule.name == "ReduceLROnPlateau" else (),
            lr_lambdas=LAMBDA_FACTORS,
        )
        for schedule in case.schedules
    ]


def _assert_traces_follow(
    traced: list[list[LrTrace]], expected: list[Trajectory], case: ScheduleCase
) -> None:
    """Every rank's lrs and momenta, scheduler by scheduler, are the model's."""
    __tracebackhide__ = True
    rtol, atol = LR_TOLERANCE[case.tensor_lr]
    dtype = "float32" if case.tensor_lr else "float64"
    for rank, traces in enumerate(traced):
        for index, (trace, want) in enumerate(zip(traces, expected, strict=True)):
            scheduler = f"scheduler {index} ({case.schedules[index].describe()}) on rank {rank}"
            assert_close(
                np.array(trace.lrs),
                np.array(want.lrs),
                rtol=rtol,
                atol=atol,
                dtype=dtype,
                what=f"lr [step, group] of {scheduler}",
                why=WHY,
                record_as=f"lr/{dtype}",
            )
            if want.momenta is None:
                # no scheduler but a cycling OneCycleLR touches the momentum
                for step, momenta in enumerate(trace.momenta):
                    what = f"momentum of each group after step {step} of {scheduler} (as built)"
                    assert_equal_values(momenta, trace.unscheduled, what=what)
                continue
            # OneCycleLR sets the momentum from the closed form of its phase: the same
            # operations as the model, in float64 (measured: equal to the bit)
            assert_close(
                np.array(trace.momenta, dtype=np.float64),
                np.array(want.momenta),
                rtol=LR_TOLERANCE[False][0],
                atol=0.0,
                dtype="float64",
                what=f"momentum [step, group] of {scheduler}",
                why="float64 rounding of the anneal",
            )


# What torch 2.13's optimizers assert at their first step where capturable=True and a
# parameter is on the CPU (the docs: "Tensors are only capturable when on supported
# accelerators"; the fused kernels serve it on the CPU and are not drawn here).
CAPTURABLE_REFUSAL = ("AssertionError: If capturable=True, params", "must be on supported devices")


@pytest.mark.spec("optim.flags.capturable_cpu_refused")
@PROPERTY  # 21 ms an example at world size 2: the first step raises
@given(data=st.data())
def test_capturable_steps_on_the_cpu_are_refused(world: World, data: st.DataObject) -> None:
    if world.device != "cpu":
        pytest.skip(f"capturable serves {world.device} parameters (optim.flags.parity draws it)")
    case = data.draw(
        step_cases(world.world_size, dtensor_unsupported=DTENSOR_UNSUPPORTED, capturable=True),
        label="case",
    )
    parity.attach(case.call())
    parity.note_reference("torch.optim docs: capturable needs parameters on an accelerator")
    for rank, error in enumerate(world.run(refused_step_on_rank, case)):
        refused = error or "no error"
        assert all(part in refused for part in CAPTURABLE_REFUSAL), (
            f"rank {rank}: got {refused}, should be the AssertionError "
            f"{' ... '.join(CAPTURABLE_REFUSAL)!r} [{case.call()}]"
        )
