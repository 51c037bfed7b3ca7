"""The op-conformance suite's pieces: Partial splits, samples, random ops, drawn cases."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.ops import (
    OpInfoCase,
    TensorArgument,
    extremum_holder,
    share_denominator,
    sum_shares,
)
from harness.strategies import opinfo_cases
from harness.torchkit import op_db
from specs.placements import Partial, Replicate, Shard
from suites.checks.ops import _contribution, _piece, global_inputs

FLOAT = TensorArgument(shape=(5, 3), kind="float", finite=True, strided=True)
INDEX = TensorArgument(shape=(4,), kind="int", finite=True, strided=True)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8, 16, 64])
def test_sum_shares_are_uneven_positive_and_add_up_to_their_denominator(size):
    shares = sum_shares(size)
    assert sum(shares) == share_denominator(size)
    assert min(shares) >= 1
    assert size == 1 or len(set(shares)) > 1


def _case(placements, mesh_shape=(3,), dtype="float32"):
    arguments = (FLOAT,) * len(placements)
    return OpInfoCase(
        op="add",
        dtype=dtype,
        sample=0,
        mesh_shape=mesh_shape,
        placements=placements,
        arguments=arguments,
        backward=False,
    )


@pytest.mark.parametrize("reduce_op", ["sum", "avg"])
@pytest.mark.parametrize("mesh_shape", [(3,), (2, 2), (4, 1, 2)])
def test_sum_and_avg_pieces_add_up_to_the_rounded_value_in_any_order(reduce_op, mesh_shape):
    placements = tuple(Partial(reduce_op) for _ in mesh_shape)
    case = _case((placements,), mesh_shape)
    bits = case.significand_bits(0)
    assert bits is not None
    value = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 9
    mantissa, exponent = torch.frexp(value)
    value = torch.ldexp(torch.round(mantissa * 2.0**bits) / 2.0**bits, exponent)
    coords = list(np.ndindex(*mesh_shape))
    pieces = [_contribution(value, placements, mesh_shape, c) for c in coords]
    count = len(coords) if reduce_op == "avg" else 1
    for order in (pieces, pieces[::-1], pieces[1:] + pieces[:1]):
        total = torch.zeros_like(value)
        for piece in order:
            total = total + piece
        assert torch.equal(total / count, value)
    assert any(not torch.equal(pieces[0], p) for p in pieces[1:])


@pytest.mark.parametrize("reduce_op", ["max", "min"])
def test_extremum_pieces_give_each_element_to_one_rank_and_beat_the_others(reduce_op):
    mesh_shape, placements = (2, 3), (Partial(reduce_op), Partial(reduce_op))
    value = torch.randn(12, generator=torch.Generator().manual_seed(1))
    pieces = torch.stack(
        [_contribution(value, placements, mesh_shape, c) for c in np.ndindex(*mesh_shape)]
    )
    reduced = pieces.amax(0) if reduce_op == "max" else pieces.amin(0)
    assert torch.equal(reduced, value)
    holders = (pieces == value).sum(0)
    assert torch.equal(holders, torch.ones_like(holders))
    assert len({extremum_holder(e, 0, 3) for e in range(12)}) == 3


def test_pieces_of_shards_are_torch_chunk_pieces_then_empty_ones():
    case = _case(((Shard(0),),), mesh_shape=(4,))
    value = torch.arange(6.0).reshape(3, 2)
    sizes = [_piece(case, r, value, (Shard(0),)).shape[0] for r in range(4)]
    assert sizes == [1, 1, 1, 0]
    nested = _case(((Shard(-1), Shard(1)),), mesh_shape=(2, 2))
    piece = _piece(nested, 3, torch.arange(8.0).reshape(1, 8), (Shard(-1), Shard(1)))
    assert piece.tolist() == [[6.0, 7.0]]


def test_only_tensors_with_a_sum_or_avg_axis_are_rounded():
    assert _case(((Replicate(),),)).significand_bits(0) is None
    assert _case(((Partial("max"),),)).significand_bits(0) is None
    assert _case(((Partial("sum"),),), dtype="float64").significand_bits(0) == 53 - 4 - 1
    inputs = global_inputs(_case(((Replicate(),), (Partial("sum"),))), torch.device("cpu"))
    sample = op_db.samples("add", "float32")[0]
    original = list(op_db.tensors_of(sample))
    assert torch.equal(inputs[0], original[0])
    assert not torch.equal(inputs[1], original[1])
    assert torch.allclose(inputs[1], original[1], rtol=2**-18)


def test_samples_are_the_same_in_every_thread_whatever_the_global_generator_does():
    op_db.forget_samples()
    torch.rand(5)
    first = op_db.samples("mul", "float64")[0].input.detach().clone()
    op_db.forget_samples()
    seen: list[torch.Tensor] = []

    def sample() -> None:
        torch.rand(3)
        seen.append(op_db.samples("mul", "float64")[0].input)

    threads = [threading.Thread(target=sample) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(s is seen[0] for s in seen)  # made once, whoever asked first
    op_db.forget_samples()
    torch.rand(7)
    assert torch.equal(op_db.samples("mul", "float64")[0].input, first)


def test_random_ops_are_told_from_functions_of_their_inputs_without_changing_the_samples():
    before = op_db.samples("exponential", "float32")[0].input.detach().clone()
    assert op_db.is_random("exponential", "float32", 0)
    assert op_db.is_random("nn.functional.dropout", "float32", 0)
    assert not op_db.is_random("add", "float32", 0)
    assert torch.equal(op_db.samples("exponential", "float32")[0].input, before)


SAMPLES = {"float32": ((FLOAT, INDEX), (FLOAT,)), "float64": ((FLOAT,), (INDEX,))}


@settings(max_examples=60, deadline=None)
@given(data=st.data(), world_size=st.integers(1, 8))
def test_drawn_cases_lay_out_every_tensor_on_the_mesh(data, world_size):
    case = data.draw(
        opinfo_cases(
            world_size,
            op="demo",
            dtypes=tuple(SAMPLES),
            arguments=SAMPLES.__getitem__,
            differentiable=("float64",),
        )
    )
    arguments = SAMPLES[case.dtype][case.sample]
    assert case.arguments == arguments
    for argument, placements in zip(arguments, case.placements, strict=True):
        assert len(placements) == len(case.mesh_shape)
        if not argument.may_be_partial:
            assert not any(isinstance(p, Partial) for p in placements)
        ops = {p.reduce_op for p in placements if isinstance(p, Partial)}
        assert len(ops) <= 1
    assert not case.backward or case.dtype == "float64"
