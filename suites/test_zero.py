"""ZeroRedundancyOptimizer: every check of upstream's test_zero_redundancy_optimizer.py, as
properties where they generalise (which upstream test each covers: the specs' provenance).
Step parity, lr schedulers and foreach/fused optimizers are in test_optim_parity.py
(optim.zero.parity)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness import World, parity
from harness.cases.training import OptimConfig, OverlapCase, ParityCase, PartitionCase
from harness.cases.zero import FrozenGroupsCase
from harness.parity import assert_close, assert_equal_values, failure
from harness.profiles import costly, property_settings
from harness.strategies import (
    fitting_overlap_cases,
    frozen_groups_cases,
    join_cases,
    optim_configs,
    overlap_cases,
    params_cases,
    parity_cases,
    partition_cases,
)
from specs.zero import partition
from suites.checks import zero as checks
from suites.checks import zero_training as training

PROPERTY = property_settings()

# ZeRO's local optimizer steps a subset of the parameters with the same element-wise
# arithmetic as the reference; only foreach/fused kernels may put an element in another
# vector lane, a difference of an ulp (float64 here).
RTOL, ATOL = 1e-12, 1e-14
WHY = "vectorised optimizer kernels may round an element differently by an ulp"


def _assert_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    __tracebackhide__ = True
    assert_close(got, want, rtol=RTOL, atol=ATOL, dtype="float64", what=what, why=WHY)


def _assert_params(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    __tracebackhide__ = True
    assert_equal_values(len(got), len(want), what=f"number of parameters of {what}")
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        _assert_close(g, w, f"parameter {index} of {what}")


@pytest.mark.spec("zero.state_dict.roundtrip")
@costly(2)  # 45 ms an example at world size 4
@given(data=st.data())
def test_state_dict_consolidates_reloads_and_trains_on(world: World, data: st.DataObject) -> None:
    case = data.draw(params_cases(world.world_size, momentum=True), label="case")
    parity.attach(case.call())
    state, final = checks.reference_state(case)
    views = world.run(checks.zero_state_dict_on_rank, case)
    for rank, view in enumerate(views):
        if rank != case.recipient:
            message = view.error or ""
            if "has not been consolidated" not in message:
                raise failure(
                    f"state_dict() on rank {rank}: got {message!r}, should raise RuntimeError "
                    f"'... has not been consolidated ...'"
                )
        assert_equal_values(view.lr_after_load, case.optim.lr, what=f"lr after load on rank {rank}")
        _assert_params(view.params, final, f"rank {rank} after reloading and training on")
    held = views[case.recipient]
    assert held.groups is not None, "the recipient returns its state dict"
    assert held.state is not None, "the recipient returns its state dict"
    expected = {k: v for k, v in state["param_groups"][0].items() if k != "params"}
    got = {k: v for k, v in held.groups[0].items() if k != "params" and k in expected}
    assert_equal_values(got, expected, what="hyper-parameters in the state dict")
    assert_equal_values(held.groups_in_sync, True, what="state dict in sync with param_groups")
    assert_equal_values(sorted(held.state), sorted(state["state"]), what="parameters with state")
    for index, entry in state["state"].items():
        buffer, expected_buffer = held.state[index]["momentum_buffer"], entry["momentum_buffer"]
        _assert_close(buffer, expected_buffer, f"momentum buffer of parameter {index}")


@pytest.mark.spec("zero.load_state_dict.keeps_argument")
@pytest.mark.world_size(min=2)
@PROPERTY
@given(data=st.data())
def test_load_state_dict_leaves_its_argument_alone(world: World, data: st.DataObject) -> None:
    case = data.draw(params_cases(world.world_size, momentum=True), label="case")
    parity.attach(case.call())
    for rank, (before, after) in enumerate(world.run(checks.load_keeps_argument_on_rank, case)):
        for index, entry in before["state"].items():
            got = after["state"][index]
            if got is None or sorted(got) != sorted(entry):
                raise failure(
                    f"state of parameter {index} on rank {rank} after load_state_dict: got "
                    f"{got!r}, should be the loaded entry with keys {sorted(entry)}"
                )


@pytest.mark.spec("zero.step.interface")
@pytest.mark.parametrize("variant", sorted(checks.STEP_VARIANTS))
@PROPERTY
@given(data=st.data())
def test_step_passes_through_unusual_optimizers(
    world: World, data: st.DataObject, variant: str
) -> None:
    case = data.draw(params_cases(world.world_size), label="case")
    case = type(case)(**{**case.__dict__, "optim": data.draw(_plain_sgd(), label="optim")})
    parity.attach(case.call())
    final = checks.reference_steps(case)
    results = world.run(checks.zero_step_variant_on_rank, case, variant)
    for rank, result in enumerate(results):
        if variant == "kwarg":
            assert_equal_values(
                result["kwarg"], [5] * case.steps, what=f"kwarg list on rank {rank}"
            )
        if variant == "new_key":
            assert_equal_values(
                result["new_key"], 0.1, what=f"param_groups[0]['new_key'] on rank {rank}"
            )
        _assert_params(result["params"], final, f"rank {rank}")


def _plain_sgd() -> st.SearchStrategy[OptimConfig]:
    # The SGD subclasses take SGD's own keyword arguments, with the default implementation.
    return optim_configs(names=("SGD",), impls=("default",), groups=False)


@pytest.mark.spec("zero.step.closure")
@pytest.mark.parametrize("bucket_view", [False, True])
@costly(2)  # 24 ms an example at world size 4
@given(data=st.data())
def test_step_with_closure_returns_its_loss(
    world: World, data: st.DataObject, bucket_view: bool
) -> None:
    case = data.draw(params_cases(world.world_size), label="case")
    parity.attach(case.call())
    losses, final = checks.reference_closure(case)
    for rank, (got_losses, params) in enumerate(
        world.run(checks.zero_closure_on_rank, case, bucket_view)
    ):
        what = f"losses returned by step(closure) on rank {rank}"
        _assert_close(np.array(got_losses), np.array(losses), what)
        _assert_params(params, final, f"rank {rank}")


@pytest.mark.spec("zero.zero_grad.to_none")
@PROPERTY
@given(data=st.data())
def test_zero_grad_sets_every_gradient_to_none(world: World, data: st.DataObject) -> None:
    case = data.draw(params_cases(world.world_size), label="case")
    parity.attach(case.call())
    expected = [(True, False)] * len(case.shapes)
    for rank, seen in enumerate(world.run(checks.zero_grad_on_rank, case)):
        assert_equal_values(seen, expected, what=f"(grad before, grad after) on rank {rank}")


CONSTRUCTOR_OUTCOMES = {
    "empty list": "ValueError",
    "a tensor": "TypeError",
    "a float": "TypeError",
    "a list with an int": "TypeError",
    "parameter groups": "ok: 2 group(s), local 2",
    "a generator": "ok: 1 group(s), local 1",
    "a list": "ok: 1 group(s), local 1",
    "a sparse tensor": "ValueError",
    "float32 and float64": "ValueError",
    "dense then sparse": "ValueError",
}


@pytest.mark.spec("zero.constructor.validation")
@PROPERTY
@given(dims=st.lists(st.integers(1, 9), min_size=2, max_size=4).map(tuple))
def test_constructor_accepts_and_rejects_the_right_inputs(
    world: World, dims: tuple[int, ...]
) -> None:
    for rank, outcomes in enumerate(world.run(checks.constructor_outcomes_on_rank, dims)):
        assert_equal_values(
            outcomes, CONSTRUCTOR_OUTCOMES, what=f"constructor outcomes on rank {rank}"
        )


@pytest.mark.spec("zero.partition.sorted_greedy")
@PROPERTY
@given(case=partition_cases())
def test_partition_is_sorted_greedy(world: World, case: object) -> None:
    assert isinstance(case, PartitionCase)
    parity.attach(repr(case))
    expected = [
        [sorted(group) for group in owned]
        for owned in partition(case.all_groups(), world.world_size)
    ]
    groups = len(case.all_groups())
    for rank, result in enumerate(world.run(checks.partition_on_rank, case)):
        assert_equal_values(
            result["owned"],
            expected[rank],
            what=f"parameters owned by rank {rank}",
        )
        assert_equal_values(
            (result["groups"], result["local_groups"]),
            (groups, groups),
            what=f"(ZeRO groups, local optimizer groups) on rank {rank}",
        )


@pytest.mark.spec("zero.param_groups.added_later")
@costly(2)  # 19 ms an example at world size 4
@given(data=st.data())
def test_groups_up_front_added_later_and_local_agree(world: World, data: st.DataObject) -> None:
    case = _with_two_groups(
        data.draw(parity_cases(world.world_size, layout="zero"), label="case"), data
    )
    parity.attach(case.call())
    for rank, history in enumerate(world.run(training.groups_three_ways_on_rank, case)):
        for step, (upfront, added, local) in enumerate(history):
            _assert_params(added, upfront, f"ZeRO with an added group, step {step}, rank {rank}")
            _assert_params(local, upfront, f"the local optimizer, step {step}, rank {rank}")


def _with_two_groups(case: ParityCase, data: st.DataObject) -> ParityCase:
    optim = case.optim
    second = optim.second_group or (("lr", optim.lr / 2), ("weight_decay", 0.05))
    dims = case.dims if len(case.dims) > 2 else (*case.dims, data.draw(st.integers(1, 5)))
    return ParityCase(
        **{
            **case.__dict__,
            "dims": dims,
            "dtype": "float64",
            "optim": type(optim)(optim.name, optim.impl, optim.lr, optim.options, second),
        }
    )


@pytest.mark.spec("zero.process_group.subgroup")
@pytest.mark.world_size(min=2)
@costly(2)  # 29 ms an example at world size 4
@given(data=st.data())
def test_zero_on_a_subgroup_trains_its_members(world: World, data: st.DataObject) -> None:
    case = data.draw(parity_cases(world.world_size, layout="zero"), label="case")
    case = ParityCase(**{**case.__dict__, "dtype": "float64"})
    parity.attach(case.call())
    expected = training.local_reference(case)
    for rank, params in enumerate(world.run(training.subgroup_on_rank, case)):
        if rank % 2:
            assert_equal_values(params, None, what=f"result of rank {rank}, outside the group")
        else:
            assert params is not None
            _assert_params(params, expected, f"subgroup member rank {rank}")


@pytest.mark.spec("zero.ddp.local_optimizer_parity")
@costly(2)  # 41 ms an example at world size 4
@given(data=st.data())
def test_ddp_zero_matches_ddp_local_optimizer(world: World, data: st.DataObject) -> None:
    case = data.draw(parity_cases(world.world_size, layout="zero"), label="case")
    # At least two layers: the first weight's requires_grad toggles, something must train.
    dims = case.dims if len(case.dims) > 2 else (*case.dims, data.draw(st.integers(1, 5)))
    case = ParityCase(**{**case.__dict__, "dims": dims, "dtype": "float64"})
    parity.attach(case.call())
    for rank, steps in enumerate(world.run(training.ddp_cross_load_on_rank, case)):
        for index, step in enumerate(steps):
            what = f"step {index} on rank {rank}"
            zero_loss, local_loss = np.array(step["losses"][0]), np.array(step["losses"][1])
            _assert_close(zero_loss, local_loss, f"ZeRO loss at {what}")
            _assert_params(step["sharded"], step["local"], f"DDP+ZeRO at {what}")


@pytest.mark.spec("zero.join.uneven_inputs")
@costly(2)  # 32 ms an example at world size 4
@given(data=st.data())
def test_join_with_uneven_inputs_matches_ddp(world: World, data: st.DataObject) -> None:
    case = data.draw(join_cases(world.world_size), label="case")
    parity.attach(repr(case))
    for rank, iterations in enumerate(world.run(training.join_on_rank, case)):
        for index, (zero_params, ddp_params) in enumerate(iterations):
            _assert_params(zero_params, ddp_params, f"ZeRO at iteration {index} on rank {rank}")


def _check_overlap(world: World, shard_buckets: bool, data: st.DataObject) -> None:
    case = data.draw(overlap_cases(world.world_size, shard_buckets=shard_buckets), label="case")
    _check_overlap_case(world, case)


def _check_overlap_case(world: World, case: OverlapCase) -> None:
    parity.attach(repr(case))
    for rank, (before, overlapped, local) in enumerate(world.run(training.overlap_on_rank, case)):
        _assert_params(overlapped, local, f"overlapped DDP+ZeRO on rank {rank}")
        changed = any(not np.array_equal(a, b) for a, b in zip(before, overlapped, strict=True))
        assert_equal_values(changed, True, what=f"parameters updated on rank {rank}")


@pytest.mark.spec("zero.ddp_overlap.parity")
@costly(2)  # 20 ms an example at world size 4
@given(data=st.data())
def test_ddp_hook_stepping_zero_matches_ddp_local_sgd(world: World, data: st.DataObject) -> None:
    _check_overlap(world, False, data)


@pytest.mark.spec("zero.ddp_overlap.shard_buckets")
@PROPERTY
@given(data=st.data())
def test_ddp_hook_with_sharded_buckets_matches_ddp_local_sgd(
    world: World, data: st.DataObject
) -> None:
    _check_overlap(world, True, data)


@pytest.mark.spec("zero.ddp_overlap.shard_buckets_fitting")
@pytest.mark.world_size(min=2)
@costly(2)  # 23 ms an example at world size 4
@given(data=st.data())
def test_sharded_buckets_that_fit_match_ddp_local_sgd(world: World, data: st.DataObject) -> None:
    _check_overlap_case(world, data.draw(fitting_overlap_cases(world.world_size), label="case"))


@pytest.mark.spec("zero.param_groups.frozen")
@costly(2)  # 21 ms an example at world size 4
@given(data=st.data())
def test_frozen_parameters_in_groups_step_like_one_device(
    world: World, data: st.DataObject
) -> None:
    _check_frozen(world, data.draw(frozen_groups_cases(world.world_size), label="case"))


@pytest.mark.spec("zero.param_groups.late_first_grad_fused_sgd")
@PROPERTY
@given(data=st.data())
def test_a_parameter_unfrozen_after_the_first_step_steps_under_fused_sgd(
    world: World, data: st.DataObject
) -> None:
    case = data.draw(frozen_groups_cases(world.world_size, late_fused_sgd=True), label="case")
    _check_frozen(world, case, reference=replace(case.optim, impl="default"))


def _check_frozen(
    world: World, case: FrozenGroupsCase, reference: OptimConfig | None = None
) -> None:
    """ZeRO's steps on every rank against ``reference`` (the case's optimizer unless given)
    on one device."""
    parity.attach(case.call())
    expected = checks.reference_frozen(replace(case, optim=reference or case.optim))
    for rank, params in enumerate(world.run(checks.zero_frozen_on_rank, case)):
        _assert_params(params, expected, f"rank {rank}")


@pytest.mark.spec("zero.model_parallel")
@pytest.mark.gpus(4)
@pytest.mark.world_size(2)
@pytest.mark.runner("processes", reason="each rank drives two accelerator devices of its own")
@PROPERTY
@given(data=st.data())
def test_model_parallel_ranks_match_a_local_model(world: World, data: st.DataObject) -> None:
    case = data.draw(join_cases(world.world_size), label="case")
    parity.attach(repr(case))
    for rank, steps in enumerate(world.run(training.model_parallel_on_rank, case)):
        for index, (loss, local_loss, params, local_params) in enumerate(steps):
            # TF32 and two devices reorder the matmuls (upstream allows 1e-3 as well).
            what = f"step {index} on rank {rank}"
            assert_close(
                np.array(loss),
                np.array(local_loss),
                rtol=1e-3,
                atol=1e-8,
                dtype="float32",
                what=f"loss at {what}",
                why="TF32 matmuls",
            )
            for p, q in zip(params, local_params, strict=True):
                assert_close(
                    p,
                    q,
                    rtol=1e-3,
                    atol=1e-4,
                    dtype="float32",
                    what=f"parameters at {what}",
                    why="TF32 matmuls",
                )
