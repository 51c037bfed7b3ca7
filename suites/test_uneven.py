"""Uneven chunks: torch.chunk semantics for shards, no padding leaks, fully_shard on dims the
world size does not divide (or exceeds)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.distributed.fsdp import fully_shard

from harness import RankContext, World, parity
from harness.cases.training import MLPCase
from harness.parity import assert_array_equal, assert_close, assert_equal_values
from harness.profiles import costly, property_settings
from harness.strategies import (
    distribute_cases,
    extremum_empty_shard_cases,
    mlp_cases,
    uneven_redistribute_cases,
    uneven_shard_cases,
)
from harness.torchkit.dtensor import DTensorView, tensor_from, to_numpy, view_of
from harness.torchkit.models import build_mlp, global_batch
from specs.placements import Partial, Shard, local_arrays, local_boxes
from suites.checks.dtensor import (
    assert_layout,
    box_on_rank,
    distribute_on_rank,
    op_on_one_device,
    op_on_rank,
    redistribute_on_rank,
)

PROPERTY = property_settings()
# The local runner simulates every rank in one thread (LocalTensorMode): fully_shard's
# hooks and each rank's own batch need ranks of their own.
FSDP_RANKS = pytest.mark.runner(
    "threads",
    "processes",
    reason="the local runner cannot serve fully_shard: its forward/backward hooks and each "
    "rank's own batch (ctx.rank) need a thread or process per rank",
)

# Sharded training sums the per-rank gradients of per-rank mean losses and divides by the
# world size; the reference takes one mean over the global batch. Same terms, different
# order of floating-point additions: a few ulps apart, far below any real defect (a wrong
# scale or a missing shard moves values by whole percent).
TOLERANCE = {"float64": (1e-10, 1e-12), "float32": (1e-4, 1e-6)}  # (rtol, atol)
REASON = "per-rank mean losses are averaged in another order than the global mean"


@pytest.mark.spec("uneven.shard.torch_chunk")
@PROPERTY
@given(data=st.data())
def test_shard_gives_torch_chunk_pieces(world: World, data: st.DataObject) -> None:
    case = data.draw(uneven_shard_cases(world.world_size), label="case")
    parity.attach(case.call())
    assert_layout(world.run(distribute_on_rank, case), case, partial_values_known=True)


@pytest.mark.spec("uneven.shard.global_offset")
@PROPERTY
@given(data=st.data())
def test_shards_know_where_they_sit_in_the_global_tensor(world: World, data: st.DataObject) -> None:
    case = data.draw(distribute_cases(world.world_size, lacks=world.lacks), label="case")
    parity.attach(case.call())
    global_array = case.global_array()
    boxes = local_boxes(case.shape, case.mesh_shape, case.placements)
    per_rank = world.run(box_on_rank, case)
    for (shape, offset), view in per_rank:
        what = f"rank {view.rank} (mesh coord {view.coord})"
        coord = case.coord_of(view.rank)
        assert_equal_values(view.coord, coord, what=f"mesh coordinate of rank {view.rank}")
        expected_shape, expected_offset = boxes[coord]
        assert_equal_values(shape, expected_shape, what=f"local shape of {what}")
        if 0 in shape:
            continue  # an empty shard sits nowhere: its offset means nothing
        assert_equal_values(offset, expected_offset, what=f"global offset of {what}")
        window = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        if not any(isinstance(p, Partial) for p in case.placements):
            assert_array_equal(view.local, global_array[window], what=f"global slice at {what}")


@pytest.mark.spec("uneven.ops.extremum_empty_shard")
@pytest.mark.world_size(min=2)
@PROPERTY
@given(data=st.data())
def test_max_min_reductions_over_empty_shards(world: World, data: st.DataObject) -> None:
    case = data.draw(extremum_empty_shard_cases(world.world_size), label="case")
    parity.attach(case.call())
    (expected,) = op_on_one_device(case, world.device)
    for (view,) in world.run(op_on_rank, case):
        assert view.full is not None
        # max and min pick an element: exact
        assert_array_equal(view.full, expected, what=f"{case.op} on rank {view.rank}")


@pytest.mark.spec("uneven.redistribute.no_padding")
@PROPERTY
@given(data=st.data())
def test_redistribute_uneven_shards_leaks_no_padding(world: World, data: st.DataObject) -> None:
    case = data.draw(uneven_redistribute_cases(world.world_size, lacks=world.lacks), label="case")
    parity.attach(case.call())
    assert_layout(world.run(redistribute_on_rank, case), case, partial_values_known=True)


# --- fully_shard on uneven MLPs ------------------------------------------------------------


def _shard(model: nn.Sequential, case: MLPCase, ctx: RankContext) -> None:
    mesh = ctx.mesh((ctx.world_size,))
    if case.shard_layers:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _local_batch(case: MLPCase, ctx: RankContext) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = global_batch(case, ctx.world_size)
    rows = slice(ctx.rank * case.batch_per_rank, (ctx.rank + 1) * case.batch_per_rank)
    return tensor_from(inputs[rows], case.dtype, ctx.device), tensor_from(
        targets[rows], case.dtype, ctx.device
    )


def train_on_rank(ctx: RankContext, case: MLPCase, stage: str) -> dict[str, Any]:
    """Shard the MLP, then stop at ``stage``: 'params', 'grads' or 'step' (one SGD step)."""
    model = build_mlp(case, ctx.device)
    _shard(model, case, ctx)
    if stage == "params":
        return {name: view_of(p, ctx.rank) for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=case.lr, momentum=case.momentum)
    inputs, targets = _local_batch(case, ctx)
    F.mse_loss(model(inputs), targets).backward()
    if stage == "grads":
        return {name: view_of(p.grad, ctx.rank) for name, p in model.named_parameters()}
    optimizer.step()
    return {
        name: (view_of(p, ctx.rank), _momentum_shape(optimizer, p))
        for name, p in model.named_parameters()
    }


def _momentum_shape(
    optimizer: torch.optim.Optimizer, param: torch.Tensor
) -> tuple[int, ...] | None:
    buffer = optimizer.state.get(param, {}).get("momentum_buffer")
    return None if buffer is None else tuple(buffer.to_local().shape)


def reference_step(case: MLPCase, world_size: int, device: str) -> dict[str, dict[str, np.ndarray]]:
    """The same model, batch and optimizer on one device: params before, grads, params after."""
    model = build_mlp(case, torch.device(device))
    before = {name: to_numpy(p) for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=case.lr, momentum=case.momentum)
    inputs, targets = global_batch(case, world_size)
    dev = torch.device(device)
    F.mse_loss(
        model(tensor_from(inputs, case.dtype, dev)), tensor_from(targets, case.dtype, dev)
    ).backward()
    grads = {name: to_numpy(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    after = {name: to_numpy(p) for name, p in model.named_parameters()}
    return {"params": before, "grads": grads, "after": after}


def _assert_sharded_like(view: DTensorView, full: np.ndarray, world_size: int, what: str) -> None:
    __tracebackhide__ = True
    piece = local_arrays(full, (world_size,), (Shard(0),))[(view.rank,)]
    assert_equal_values(view.placements, (Shard(0),), what=f"placements of {what}")
    assert_equal_values(view.shape, full.shape, what=f"global shape of {what}")
    assert_equal_values(view.local.shape, piece.shape, what=f"local shape of {what}")


def _assert_like_one_device(
    view: DTensorView, expected: np.ndarray, case: MLPCase, what: str, kind: str
) -> None:
    """The full value within ``TOLERANCE`` of one device's, kept as ``kind``/dtype."""
    __tracebackhide__ = True
    rtol, atol = TOLERANCE[case.dtype]
    assert view.full is not None
    assert_close(
        view.full,
        expected,
        rtol=rtol,
        atol=atol,
        dtype=case.dtype,
        what=what,
        why=REASON,
        record_as=f"{kind}/{case.dtype}",
    )


@pytest.mark.spec("uneven.fully_shard.params")
@FSDP_RANKS
@costly(2)  # 54 ms an example at world size 4
@given(data=st.data())
def test_fully_shard_params_are_torch_chunk_pieces(world: World, data: st.DataObject) -> None:
    case = data.draw(mlp_cases(world.world_size), label="case")
    parity.attach(case.call())
    reference = reference_step(case, world.world_size, world.device)["params"]
    per_rank = world.run(train_on_rank, case, "params")
    for rank, views in enumerate(per_rank):
        assert_equal_values(
            sorted(views), sorted(reference), what=f"parameter names on rank {rank}"
        )
        for name, view in views.items():
            what = f"{name} on rank {rank}"
            _assert_sharded_like(view, reference[name], world.world_size, what)
            strides = tuple(torch.empty(reference[name].shape).stride())
            assert_equal_values(view.stride, strides, what=f"global stride of {what}")
            piece = local_arrays(reference[name], (world.world_size,), (Shard(0),))[(rank,)]
            assert_array_equal(view.local, piece, what=f"local shard of {what}")


@pytest.mark.spec("uneven.fully_shard.grads")
@FSDP_RANKS
@costly(3)  # 73 ms an example at world size 4
@given(data=st.data())
def test_fully_shard_grads_match_one_device(world: World, data: st.DataObject) -> None:
    case = data.draw(mlp_cases(world.world_size), label="case")
    parity.attach(case.call())
    reference = reference_step(case, world.world_size, world.device)["grads"]
    per_rank = world.run(train_on_rank, case, "grads")
    for rank, views in enumerate(per_rank):
        for name, view in views.items():
            what = f"grad of {name} on rank {rank}"
            _assert_sharded_like(view, reference[name], world.world_size, what)
            _assert_like_one_device(view, reference[name], case, what, "grad")


@pytest.mark.spec("uneven.fully_shard.step_parity")
@FSDP_RANKS
@costly(3)  # 82 ms an example at world size 4
@given(data=st.data())
def test_fully_shard_sgd_step_matches_one_device(world: World, data: st.DataObject) -> None:
    case = data.draw(mlp_cases(world.world_size), label="case")
    parity.attach(case.call())
    reference = reference_step(case, world.world_size, world.device)["after"]
    per_rank = world.run(train_on_rank, case, "step")
    for rank, results in enumerate(per_rank):
        for name, (view, momentum_shape) in results.items():
            what = f"{name} after one step on rank {rank}"
            _assert_like_one_device(view, reference[name], case, what, "param")
            expected_state = tuple(view.local.shape) if case.momentum else None
            assert_equal_values(
                momentum_shape,
                expected_state,
                what=f"momentum buffer shape of {name} on rank {rank}",
            )
