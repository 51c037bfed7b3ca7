"""State dicts taken inside a training step, resumed from as if after a crash: a module graph
(shared modules, tied parameters and buffers) under ``fully_shard`` on a 1-D or HSDP mesh,
trained by a stateful optimizer; its model and optimizer state dict taken at a drawn point
of a step (``specs.resume.MID_STEP_POINTS``), in memory or through DCP; a fresh model and
optimizer loaded from it redo that step from its start. Upstream's state-dict tests take
state dicts between steps, after ``zero_grad`` (test/distributed/checkpoint/
test_state_dict.py: "We need to ensure gradients don't exist, this the invarient of using
DSD"); these take them at every point of a step.

The reference is the same training never interrupted, on the same World. Every comparison
is exact (rtol=atol=0): taking a state dict computes nothing, loading one copies values,
and the resumed run repeats the uninterrupted run's arithmetic on the same values, ranks
and batches (a state dict holds no gradients or activations: the step is redone from its
forward, which gives the same gradients)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness import World, parity
from harness.cases.state_dict import MidStepCase
from harness.parity import assert_array_equal, assert_equal_values
from harness.profiles import costly
from harness.strategies import mid_step_cases, tied_after_forward_cases
from specs import resume
from suites.checks import state_dict_steps as steps
from suites.checks.directories import driver_directory
from suites.checks.state_dict import assert_same_state

# Each example builds and trains a module graph three times (uninterrupted, taking the state
# dict, resumed), some through a DCP checkpoint: on 2 shared cores, a mean of 0.03 / 0.10 /
# 0.21 / 0.31 s on 1 / 2 / 3 / 4 rank threads. A quarter of the profile's examples (25 per
# world size under ci, about 20 s in all) reaches every point of every step, with every
# optimizer (stateless SGD and a tensor lr among them), several times.
PROPERTY = costly(4, needs=7)  # init_optim_state_zeroes_tensor_lr: within 7 examples


def _check_mid_step(world: World, case: MidStepCase) -> None:
    parity.attach(case.call())
    reference = world.run(steps.uninterrupted_on_rank, case)
    with driver_directory("distconf-mid-step-") as root:
        interrupted = world.run(steps.interrupted_on_rank, case, root)
    first = resume.resume_step(case.at_step, case.point)
    for rank, ((continued, resumed), want) in enumerate(zip(interrupted, reference, strict=True)):
        for what, got, losses in (
            (f"the run that took the state dict, rank {rank}", continued, want.losses),
            (f"the run resumed at step {first}, rank {rank}", resumed, want.losses[first:]),
        ):
            # exact: the same arithmetic on the same values (see the module docstring)
            assert_equal_values(got.losses, losses, what=f"losses of {what}")
            assert_same_state(got.state, want.state, what=what)
            assert_equal_values(list(got.buffers), list(want.buffers), what=f"buffers of {what}")
            for name, value in want.buffers.items():
                assert_array_equal(got.buffers[name], value, what=f"buffer {name} of {what}")


@pytest.mark.spec("state_dict.resume.mid_step")
@costly(7)  # 212 ms an example at world size 4
@given(data=st.data())
def test_resuming_from_a_state_dict_taken_inside_a_step(world: World, data: st.DataObject) -> None:
    _check_mid_step(world, data.draw(mid_step_cases(world.world_size), label="case"))


@pytest.mark.spec("state_dict.resume.mid_step_empty_optimizer_dcp")
@PROPERTY
@given(data=st.data())
def test_dcp_checkpoint_between_the_first_backward_and_step_resumes(
    world: World, data: st.DataObject
) -> None:
    case = data.draw(mid_step_cases(world.world_size, first_step_dcp=True), label="case")
    _check_mid_step(world, case)


@pytest.mark.spec("state_dict.sharded.tied_after_forward")
@PROPERTY
@given(data=st.data())
def test_a_tied_parameter_left_unsharded_is_in_the_state_dict_sharded(
    world: World, data: st.DataObject
) -> None:
    case = data.draw(tied_after_forward_cases(world.world_size), label="case")
    parity.attach(case.call())
    for rank, by_order in enumerate(world.run(steps.tied_after_forward_on_rank, case)):
        for order, (taken, params) in by_order.items():
            where = f"on rank {rank}, fully_shard([{', '.join(order)}])"
            assert_equal_values(sorted(taken), sorted(params), what=f"names {where}")
            for name, param in params.items():
                got, what = taken[name], f"state dict entry {name!r} {where}"
                # (class, mesh, placements, storage) first: the values of a tensor whose
                # storage was freed are never read
                assert_equal_values(got.described(), param.described(), what=what)
                if got.local is not None and param.local is not None:
                    # exact: taking a state dict copies nothing
                    assert_array_equal(got.local, param.local, what=f"local values of {what}")
