"""Placements: distribute_tensor and redistribute against the numpy placement model."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from harness import World, parity
from harness.cases.meshes import MeshCase
from harness.cases.placements import DistributeCase, FactoryCase, OpCase, ReshapeCase
from harness.cases.programs import ProgramCase
from harness.parity import assert_array_equal, assert_close, assert_equal_values, failure
from harness.profiles import HANG_DEADLINE, costly, hanging, property_settings
from harness.strategies import (
    distribute_cases,
    einsum_unit_dim_cases,
    extremum_to_shard_cases,
    factory_cases,
    flatten_empty_cases,
    flattened_cases,
    from_the_back_cases,
    inplace_on_partial_cases,
    matmul_empty_batch_cases,
    mesh_cases,
    op_cases,
    partial_sum_integer_cases,
    partial_target_cases,
    program_cases,
    redistribute_cases,
    reshape_cases,
    scan_negative_dim_cases,
)
from harness.torchkit.dtensor import DTensorView, dtype_name, to_numpy
from specs.placements import (
    REDUCE_OPS,
    Shard,
    local_arrays,
)
from suites.checks.dtensor import (
    FactoryView,
    assert_layout,
    distribute_on_rank,
    expected_piece,
    factory_on_one_device,
    factory_on_rank,
    flattened_on_rank,
    from_the_back_on_rank,
    mesh_on_rank,
    op_on_one_device,
    op_on_rank,
    ops_on_rank,
    redistribute_on_rank,
    redistribute_or_refusal_on_rank,
    reshape_on_rank,
)
from suites.checks.programs import (
    program_on_one_device,
    program_on_rank,
    transitions,
)
from suites.checks.programs_compare import assert_program_matches

PROPERTY = property_settings()
# A program runs up to 8 steps and a backward pass: each example costs several op examples.
# inplace_op_redistributes_self met at the 89th example (at world size 2)
PROGRAM = costly(1, needs=89)


@pytest.mark.spec("placements.mesh.constructions")
@PROPERTY
@given(data=st.data())
def test_meshes_built_every_way_hold_the_model_ranks(world: World, data: st.DataObject) -> None:
    case = data.draw(mesh_cases(world.world_size, lacks=world.lacks), label="case")
    parity.attach(case.call())
    views = world.run(mesh_on_rank, case)
    for rank, view in enumerate(views):
        ranks = case.ranks_of(rank)
        assert_equal_values(view.ranks, ranks, what=f"ranks of the mesh on rank {rank}")
        assert_equal_values(view.coord, case.coord_of(rank), what=f"coordinate of rank {rank}")
        for axis, group in enumerate(_axis_groups(case, rank)):
            what = f"the group of mesh axis {axis} on rank {rank}"
            assert_equal_values(view.group_ranks[axis], group, what=f"ranks of {what}")
            assert_equal_values(view.group_sums[axis], sum(group), what=f"all_reduce over {what}")


def _axis_groups(case: MeshCase, rank: int) -> list[list[int]]:
    """The ranks of each axis group holding ``rank``, in group-rank order (model)."""
    grid = np.array(case.ranks_of(rank)).reshape(case.shape)
    coord = case.coord_of(rank)
    return [
        [int(r) for r in grid[tuple(slice(None) if a == axis else c for a, c in enumerate(coord))]]
        for axis in range(len(case.shape))
    ]


_KNOWN_VALUES = ("ones", "zeros", "full", "empty")
_RANDOM = ("rand", "randn")


@pytest.mark.spec("placements.factories.match_torch")
@PROPERTY
@given(data=st.data())
def test_dtensor_factories_make_what_torch_factories_make(
    world: World, data: st.DataObject
) -> None:
    case = data.draw(
        factory_cases(world.world_size, lacks=world.lacks, factories=_KNOWN_VALUES), label="case"
    )
    parity.attach(case.call())
    want = factory_on_one_device(case, world.device)
    for rank, made in enumerate(world.run(factory_on_rank, case)):
        _assert_factory_made(made, want, case, rank)


@pytest.mark.spec("placements.factories.random")
@PROPERTY
@given(data=st.data())
def test_random_dtensor_factories_make_tensors_like_torch(
    world: World, data: st.DataObject
) -> None:
    case = data.draw(
        factory_cases(world.world_size, lacks=world.lacks, factories=_RANDOM), label="case"
    )
    parity.attach(case.call())
    want = factory_on_one_device(case, world.device)
    for rank, made in enumerate(world.run(factory_on_rank, case)):
        _assert_factory_made(made, want, case, rank)


def _assert_factory_made(
    made: FactoryView, want: torch.Tensor, case: FactoryCase, rank: int
) -> None:
    __tracebackhide__ = True
    view, who = made.view, f"rank {rank} (mesh coord {made.view.coord})"
    assert view.full is not None, "views are taken with full_tensor()"
    assert_equal_values(view.dtype, dtype_name(want.dtype), what=f"dtype on {who}")
    assert_equal_values(view.shape, tuple(want.shape), what=f"shape on {who}")
    assert_equal_values(view.stride, tuple(want.stride()), what=f"stride on {who}")
    flags, wanted = (made.requires_grad, made.is_leaf), (want.requires_grad, True)
    assert_equal_values(flags, wanted, what=f"(requires_grad, is_leaf) on {who}")
    values = to_numpy(want)
    local = local_arrays(values, case.mesh_shape, case.placements)[case.coord_of(rank)]
    assert_equal_values(view.local.shape, local.shape, what=f"to_local() shape on {who}")
    if case.deterministic:
        assert_array_equal(view.full, values, what=f"full_tensor() on {who}")
        assert_array_equal(view.local, local, what=f"to_local() on {who}")
    if not want.requires_grad:
        return
    if made.grad is None or made.grad.full is None:
        raise failure(f"{who}: the gradient got None, should be 2 * the tensor")
    # d/dx sum(x * x) of the factory's own values (empty and rand ones are not one device's)
    assert_array_equal(made.grad.full, 2 * view.full, what=f"gradient's full_tensor() on {who}")


@pytest.mark.spec("placements.api.shard_dim_from_the_back")
@PROPERTY
@given(data=st.data())
def test_every_api_takes_a_shard_dim_counted_from_the_back(
    world: World, data: st.DataObject
) -> None:
    case = data.draw(from_the_back_cases(world.world_size, lacks=world.lacks), label="case")
    parity.attach(case.call())
    results = world.run(from_the_back_on_rank, case)
    refused: dict[str, str] = {}
    for api in results[0]:
        made = [per_rank[api] for per_rank in results]
        errors = [m for m in made if isinstance(m, str)]
        if errors:
            refused[api] = errors[0]
            assert_equal_values(len(errors), len(made), what=f"ranks on which {api} raised")
        elif api in ("distribute_tensor", "from_local", "redistribute"):
            assert_layout(
                [m for m in made if not isinstance(m, str)], case, partial_values_known=True
            )
        else:
            _assert_from_the_back(api, [m for m in made if not isinstance(m, str)], case)
    if refused:
        listed = "; ".join(f"{api} ({error})" for api, error in refused.items())
        raise failure(
            f"refused {case.placements} in: {listed}; should take Shard(d - ndim) as Shard(d)"
        )


def _assert_from_the_back(api: str, views: list[DTensorView], case: DistributeCase) -> None:
    """zeros: zeros laid out as the placements say; to_local: the gradient of sum(y * y)."""
    __tracebackhide__ = True
    full = case.global_array() * 2 if api == "to_local" else np.zeros(case.shape)
    for rank, view in enumerate(views):
        assert view.full is not None
        assert_array_equal(view.full, full, what=f"full_tensor() of {api}'s DTensor on rank {rank}")
        if api == "zeros":
            want = local_arrays(full, case.mesh_shape, case.placements)[case.coord_of(rank)]
            assert_array_equal(view.local, want, what=f"to_local() of zeros on rank {rank}")


@pytest.mark.spec("placements.mesh.flatten_keeps_gather")
@pytest.mark.runner(
    "threads",
    "processes",
    reason="the local runner cannot serve it: once a flattened mesh is registered, "
    "redistribute merges the transforms over it and compares the ranks' uneven shard sizes "
    "(_redistribute.try_create_flattened), a branch that differs between ranks, which "
    "LocalTensorMode's one thread cannot take (LocalIntNode comparisons assert)",
)
@PROPERTY
@given(data=st.data())
def test_flattening_mesh_axes_leaves_dtensors_on_the_mesh_alone(
    world: World, data: st.DataObject
) -> None:
    case = data.draw(flattened_cases(world.world_size), label="case")
    parity.attach(case.call())
    assert_layout(world.run(flattened_on_rank, case), case.source, partial_values_known=True)


@pytest.mark.spec("placements.distribute.roundtrip")
@PROPERTY
@given(data=st.data())
def test_distribute_tensor_matches_model(world: World, data: st.DataObject) -> None:
    case = data.draw(
        distribute_cases(world.world_size, lacks=world.lacks, no_source=True), label="case"
    )
    parity.attach(case.call())
    views = world.run(distribute_on_rank, case)
    if case.src_data_rank is None:
        _assert_own_pieces(views, case)
        return
    # distribute_tensor divides a sum evenly, copies the rest
    assert_layout(views, case, partial_values_known=True)


def _assert_own_pieces(views: list[DTensorView], case: DistributeCase) -> None:
    """src_data_rank=None: every rank holds the model's piece of the tensor it passed."""
    __tracebackhide__ = True
    for rank, view in enumerate(views):
        coord = case.coord_of(rank)
        own = local_arrays(case.input_of(rank), case.mesh_shape, case.placements)[coord]
        assert_array_equal(view.local, own, what=f"to_local() on rank {rank} (of its own tensor)")


@pytest.mark.spec("placements.distribute.partial_sum_keeps_dtype")
@PROPERTY
@given(data=st.data())
def test_distribute_partial_sum_keeps_integer_dtype(world: World, data: st.DataObject) -> None:
    case = data.draw(partial_sum_integer_cases(world.world_size, lacks=world.lacks), label="case")
    parity.attach(case.call())
    views = world.run(distribute_on_rank, case)
    # how an integer sum is split is not specified
    assert_layout(views, case, partial_values_known=False)


def _shardable_ops(world: World) -> frozenset[str]:
    """The Partial ops that may become Shard: a reduce-scatter with that op on this runner."""
    return frozenset(op for op in REDUCE_OPS if f"reduce_scatter.{op}" not in world.lacks)


@pytest.mark.spec("placements.redistribute.roundtrip")
@PROPERTY
@given(data=st.data())
def test_redistribute_preserves_global_value(world: World, data: st.DataObject) -> None:
    shardable = _shardable_ops(world)
    strategy = redistribute_cases(world.world_size, lacks=world.lacks, shardable_ops=shardable)
    case = data.draw(strategy, label="case")
    parity.attach(case.call())
    views = world.run(redistribute_on_rank, case)
    # kept Partial axes hold source contributions, regrouped
    assert_layout(views, case, partial_values_known=False)


@pytest.mark.spec("placements.redistribute.partial_extremum_to_shard")
@PROPERTY
@given(data=st.data())
def test_redistribute_partial_extremum_to_shard(world: World, data: st.DataObject) -> None:
    lacking = sorted(op for op in ("reduce_scatter.max", "reduce_scatter.min") if op in world.lacks)
    if lacking:
        pytest.skip(
            f"{world.runner} runner cannot serve {', '.join(lacking)} (Partial max/min -> Shard)"
        )
    case = data.draw(extremum_to_shard_cases(world.world_size, lacks=world.lacks), label="case")
    parity.attach(case.call())
    views = world.run(redistribute_on_rank, case)
    assert_layout(views, case, partial_values_known=False)


@pytest.mark.spec("placements.redistribute.partial_target_rejected")
@PROPERTY
@given(data=st.data())
def test_redistribute_into_new_partial_is_refused_or_right(
    world: World, data: st.DataObject
) -> None:
    case = data.draw(partial_target_cases(world.world_size, lacks=world.lacks), label="case")
    parity.attach(case.call())
    results = world.run(redistribute_or_refusal_on_rank, case)
    refused = [rank for rank, result in enumerate(results) if isinstance(result, str)]
    if refused and len(refused) < len(results):
        raise failure(
            f"ranks {refused} refused ({results[refused[0]]!r}) and the others returned: "
            "should be refused on every rank or on none"
        )
    # Which transitions this torch allows shows in --hypothesis-show-statistics.
    event("refused" if refused else "allowed")
    if not refused:  # torch allows this transition: then the values must be right
        assert_layout(
            [r for r in results if not isinstance(r, str)], case, partial_values_known=False
        )


# Sharded reductions add per-shard partial results, then all-reduce them: the terms of one
# global sum in another order. Small integer inputs keep that a few ulps of float64; a wrong
# rule (a missing reduction, a shard counted twice, padding in a mean) is off by whole units.
OP_TOLERANCE = (1e-12, 1e-12)  # (rtol, atol)
OP_WHY = "sharded reductions add the same terms in another order"


@pytest.mark.spec("placements.ops.match_one_device")
@PROPERTY
@given(data=st.data())
def test_ops_on_dtensors_match_one_device(world: World, data: st.DataObject) -> None:
    cases = data.draw(op_cases(world.world_size, lacks=world.lacks), label="cases")
    results = world.run(ops_on_rank, cases)
    for number, case in enumerate(cases):
        parity.attach(case.call())
        for index, want in enumerate(op_on_one_device(case, world.device)):
            for per_rank in results:
                _assert_op_result(per_rank[number][index], want, case, index)


def _assert_op_result(view: DTensorView, expected: np.ndarray, case: OpCase, index: int) -> None:
    __tracebackhide__ = True
    rtol, atol = OP_TOLERANCE
    dim, _ = case.applications[index]
    who = f"{case.op}(dim={dim}) on rank {view.rank} (mesh coord {view.coord})"
    assert view.full is not None
    assert_close(
        view.full,
        expected,
        rtol=rtol,
        atol=atol,
        dtype="float64",
        what=f"full_tensor() of {who}",
        why=OP_WHY,
        record_as="op/float64",
    )
    local = expected_piece(view, expected, case.source.mesh_shape)
    if local is None:
        return
    assert_close(
        view.local,
        local,
        rtol=rtol,
        atol=atol,
        dtype="float64",
        what=f"to_local() of {who}",
        why=OP_WHY,
    )


@pytest.mark.spec("placements.ops.scan_negative_dim")
@pytest.mark.world_size(min=2)
@PROPERTY
@given(data=st.data())
def test_scan_along_a_dim_counted_from_the_back(world: World, data: st.DataObject) -> None:
    case = data.draw(scan_negative_dim_cases(world.world_size), label="case")
    parity.attach(case.call())
    (expected,) = op_on_one_device(case, world.device)
    for (view,) in world.run(op_on_rank, case):
        _assert_op_result(view, expected, case, 0)


@pytest.mark.spec("placements.ops.matmul_empty_batch")
@PROPERTY
@given(data=st.data())
def test_matmul_with_an_empty_sharded_dim(world: World, data: st.DataObject) -> None:
    case = data.draw(matmul_empty_batch_cases(world.world_size), label="case")
    parity.attach(case.call())
    (expected,) = op_on_one_device(case, world.device)
    for (view,) in world.run(op_on_rank, case):
        _assert_op_result(view, expected, case, 0)


# A spinning rank thread cannot be stopped: the process runner kills the rank (a respawn
# per example).
HANGS = hanging()


@pytest.mark.spec("placements.ops.flatten_empty")
@pytest.mark.runner(
    "processes",
    reason="torch 2.13 loops forever here (an expectation); a rank thread spinning in "
    "Python cannot be stopped and would hold the GIL for the rest of the session",
)
@HANGS
@given(data=st.data())
def test_flatten_of_a_tensor_without_elements(world: World, data: st.DataObject) -> None:
    case = data.draw(flatten_empty_cases(world.world_size), label="case")
    parity.attach(case.call())
    (expected,) = op_on_one_device(case, world.device)
    for (view,) in world.run(op_on_rank, case, timeout=HANG_DEADLINE):
        _assert_op_result(view, expected, case, 0)


@pytest.mark.spec("placements.ops.reshape")
@PROPERTY
@given(data=st.data())
def test_view_and_reshape_match_one_device(world: World, data: st.DataObject) -> None:
    case = data.draw(reshape_cases(world.world_size, lacks=world.lacks), label="case")
    parity.attach(case.call())
    expected = case.source.global_array().reshape(case.target)
    sharded = any(isinstance(p, Shard) for p in case.source.placements)
    for rank, result in enumerate(world.run(reshape_on_rank, case)):
        if isinstance(result, str):
            # Views never move data between ranks: torch may refuse a sharded layout local
            # views cannot serve (with several messages in 2.13), never an unsharded one.
            if not sharded:
                raise failure(
                    f"rank {rank}: got RuntimeError {result!r}, should be the reshaped tensor "
                    f"(only a sharded tensor may be refused)"
                )
            continue
        _assert_reshaped(result, expected, case)


def _assert_reshaped(view: DTensorView, expected: np.ndarray, case: ReshapeCase) -> None:
    __tracebackhide__ = True
    who = f"{case.method} on rank {view.rank} (mesh coord {view.coord})"
    assert view.full is not None
    assert_array_equal(view.full, expected, what=f"full_tensor() of {who}")
    local = expected_piece(view, expected, case.source.mesh_shape)
    if local is not None:
        assert_array_equal(view.local, local, what=f"to_local() of {who}")


@pytest.mark.spec("placements.program.matches_one_device")
@PROGRAM
@given(data=st.data())
def test_dtensor_programs_and_their_gradients_match_one_device(
    world: World, data: st.DataObject
) -> None:
    _check_drawn_program(world, data, program_cases)


@pytest.mark.spec("placements.program.inplace_on_partial")
@costly(7)  # 61 ms an example at world size 4
@given(data=st.data())
def test_inplace_ops_on_pending_sums_match_one_device(world: World, data: st.DataObject) -> None:
    _check_drawn_program(world, data, inplace_on_partial_cases)


@pytest.mark.spec("placements.ops.einsum_unit_dim")
@PROGRAM
@given(data=st.data())
def test_einsum_with_a_sharded_dim_of_size_one(world: World, data: st.DataObject) -> None:
    _check_drawn_program(world, data, einsum_unit_dim_cases)


def _check_drawn_program(
    world: World, data: st.DataObject, cases: Callable[..., st.SearchStrategy[ProgramCase]]
) -> None:
    case = data.draw(cases(world.world_size, lacks=world.lacks), label="case")
    parity.attach(case.call())
    expected = program_on_one_device(case, world.device)
    runs = world.run(program_on_rank, case)
    for label in transitions(case, runs[0]):
        parity.exercise(label)
    assert_program_matches(runs, expected, case)
