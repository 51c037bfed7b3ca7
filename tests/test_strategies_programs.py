"""DTensor programs are valid on one device by construction, and their cases refuse what
does not exist by name."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import strategies as hs
from harness.cases.meshes import MeshCase
from harness.cases.programs import OPS, Leaf, ProgramCase, Step, may_be_partial
from harness.errors import InvalidArgument
from harness.torchkit.programs import loss_of, run_steps
from specs.placements import Partial, Replicate, Shard


def _on_one_device(case: ProgramCase) -> list[torch.Tensor]:
    leaves = [
        torch.tensor(case.leaf_array(i), dtype=torch.float64).requires_grad_()
        for i in range(len(case.leaves))
    ]
    values = run_steps(case, list(leaves), None)
    loss_of(case, values).backward()
    if case.loss_of_all:
        assert all(leaf.grad is not None for leaf in leaves)
    return values


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), st.data())
def test_every_drawn_program_runs_on_one_device(world_size, data):
    case = data.draw(hs.program_cases(world_size))
    values = _on_one_device(case)
    assert len(values) == len(case.leaves) + len(case.steps)
    assert 1 <= len(case.steps) <= 8
    assert 0 not in case.shape, "tensors without elements are left to their own specs"
    assert case.call().startswith(f"on mesh {case.mesh.call()}: x0 = ")


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.data())
def test_inplace_ops_are_drawn_only_on_values_without_a_pending_sum(world_size, data):
    case = data.draw(hs.program_cases(world_size))
    partial = [any(isinstance(p, Partial) for p in leaf.placements) for leaf in case.leaves]
    for step in case.steps:
        if step.op in ("add_scalar_", "mul_"):
            assert not partial[step.args[0]], f"{step.op} on a value that may be Partial"
        partial.append(may_be_partial(step, [partial[a] for a in step.args]))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.data())
def test_no_program_leaf_or_target_shards_a_dim_of_size_one(world_size, data):
    case = data.draw(hs.program_cases(world_size))
    for leaf in case.leaves:
        sharded = [p.dim for p in leaf.placements if isinstance(p, Shard)]
        assert all(case.shape[d] > 1 for d in sharded)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.data())
def test_the_findings_strategies_draw_programs_one_device_runs(world_size, data):
    for strategy in (hs.inplace_on_partial_cases, hs.einsum_unit_dim_cases):
        _on_one_device(data.draw(strategy(world_size)))


def test_a_relabel_multiplies_by_the_sizes_of_its_partial_axes():
    mesh = MeshCase((2, 3))
    step = Step("relabel", (0,), target=(Replicate(), Replicate()), partial_axes=(1,))
    case = ProgramCase(mesh, (2,), (Leaf((Replicate(), Replicate()), "distribute", 0),), (step,))
    values = _on_one_device(case)
    assert torch.equal(values[1], values[0] * 3)
    assert "to_local(grad_placements=(Replicate(), Partial(reduce_op='sum')))" in case.call()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Step("fold", (0,)), "op='fold'"),
        (lambda: Step("add", (0,)), "args=(0,)"),
        (lambda: Leaf((Replicate(),), "scatter", 0), "how='scatter'"),
        (
            lambda: ProgramCase(
                MeshCase((2,)), (2,), (Leaf((Replicate(),), "distribute", 0),), (Step("neg", (1,)),)
            ),
            "steps=Step(op='neg', args=(1,)",
        ),
        (lambda: hs.program_cases(2, max_steps=0), "max_steps=0"),
    ],
)
def test_program_cases_refuse_what_does_not_exist(make, message):
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        make()


def test_every_op_of_the_table_has_a_runner_or_moves_data():
    from harness.torchkit import programs

    runnable = set(programs._RUN)
    assert {name for name, op in OPS.items() if not op.dtensor_only} == runnable
