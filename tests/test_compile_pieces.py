"""The compile suite's pieces: its cases and their structure key, the skeleton pool, which
errors are refusals, the per-process cache of compiled callables."""

from __future__ import annotations

import dataclasses

import numpy
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.compile import (
    BACKENDS,
    FAMILIES,
    CompileCase,
    CompiledTrainingCase,
    refusal_kind,
)
from harness.cases.programs import OPS, Leaf, Step
from harness.cases.training import ParityCase
from harness.errors import InvalidArgument
from harness.strategies import compile_cases, compiled_training_cases, program_cases
from harness.strategies.compile import FAMILIES as SKELETON_FAMILIES
from harness.strategies.compile import SKELETONS, skeleton_case, skeleton_program
from harness.torchkit.compile import compiled, refusal_of, timed
from harness.torchkit.programs import run_steps
from suites.checks.programs import program_on_one_device


def test_a_case_refuses_an_unknown_backend_naming_it() -> None:
    with pytest.raises(InvalidArgument, match="backend='eager'"):
        CompileCase(skeleton_program(2, 0), "eager")


def test_a_case_refuses_what_is_no_program() -> None:
    with pytest.raises(InvalidArgument, match="program="):
        CompileCase("x = 1", "aot_eager")  # type: ignore[arg-type]


def test_the_structure_ignores_the_leaves_values_only() -> None:
    case = CompileCase(skeleton_program(3, 2, (5, 6)), "aot_eager")
    same = CompileCase(skeleton_program(3, 2, (7, 8)), "aot_eager")
    assert case.structure() == same.structure()
    assert hash(case.structure()) == hash(same.structure())
    others = [
        CompileCase(skeleton_program(3, 2, (5, 6)), "inductor"),
        CompileCase(skeleton_program(4, 2, (5, 6)), "aot_eager"),
        CompileCase(skeleton_program(3, 1, (5,)), "aot_eager"),
        CompileCase(dataclasses.replace(case.program, loss_of_all=False), "aot_eager"),
    ]
    assert all(other.structure() != case.structure() for other in others)


def test_every_op_has_a_family_and_cases_name_theirs() -> None:
    assert set(FAMILIES) == set(OPS)
    assert CompileCase(skeleton_program(2, 1), "aot_eager").families() == (
        "reduction",
        "redistribute",
        "pointwise",
    )


@pytest.mark.parametrize(
    ("names", "kind"),
    [
        (["Unsupported", "TorchDynamoException", "RuntimeError"], "Unsupported"),
        (
            ["UnknownPropertiesDuringBackwardTrace", "Unsupported", "Exception"],
            "UnknownPropertiesDuringBackwardTrace",
        ),
        (["ObservedException", "TorchDynamoException"], None),
        (["BackendCompilerFailed", "ShortenTraceback", "TorchDynamoException"], None),
        (["TorchRuntimeError", "TorchDynamoException"], None),
        (["UserError", "Unsupported"], "UserError"),
        (["AssertionError", "Exception"], None),
    ],
)
def test_refusals_are_dynamo_declining_a_program(names: list[str], kind: str | None) -> None:
    assert refusal_kind(names) == kind


def test_refusal_kind_needs_a_class() -> None:
    with pytest.raises(InvalidArgument, match="class_names="):
        refusal_kind([])


def test_refusal_of_torchs_own_exceptions() -> None:
    import torch._dynamo.exc as exc

    assert refusal_of(exc.Unsupported("no graph here\nmore")) == "Unsupported: no graph here"
    assert refusal_of(RuntimeError("boom")) is None


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_skeleton_runs_on_one_device(world_size: int) -> None:
    for index in range(len(SKELETONS)):
        reference = program_on_one_device(skeleton_program(world_size, index), "cpu")
        skeleton = SKELETONS[index]
        assert len(reference.values) == len(skeleton.leaves) + len(skeleton.steps)


def test_a_skeleton_index_outside_the_pool_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="index=99"):
        skeleton_program(2, 99)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_drawn_cases_come_from_the_pool(data: st.DataObject) -> None:
    world_size = data.draw(st.integers(1, 4))
    backend = data.draw(st.sampled_from(BACKENDS))
    case = data.draw(compile_cases(world_size, backend=backend))
    assert case.backend == backend
    pool = {skeleton_case(world_size, i, backend).structure() for i in range(len(SKELETONS))}
    assert case.structure() in pool


def test_compile_cases_refuse_an_unknown_backend() -> None:
    with pytest.raises(InvalidArgument, match="backend='cudagraphs'"):
        compile_cases(2, backend="cudagraphs")


def test_a_key_compiles_once_and_counts_its_graphs() -> None:
    made: list[int] = []

    def make() -> object:
        made.append(1)
        return lambda x: (x * 2).sum()

    key = ("test_compile_pieces", object())
    entry = compiled(key, make, "aot_eager")
    again = compiled(key, make, "aot_eager")
    assert entry is again
    assert len(made) == 1
    value, cost = timed(entry, lambda: entry.call(torch.ones(3)))
    assert float(value) == 6.0
    assert cost.graphs == 1
    _, cost = timed(entry, lambda: entry.call(torch.full((3,), 2.0)))
    assert cost.graphs == 0  # the same shapes: the cached graph


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_compiled_training_draws_the_pool_and_tp_only_where_asked(data: st.DataObject) -> None:
    world_size = data.draw(st.integers(1, 4))
    tensor_parallel = data.draw(st.booleans())
    case = data.draw(
        compiled_training_cases(world_size, backend="aot_eager", tensor_parallel=tensor_parallel)
    )
    training = case.training
    assert training.layout in (("fsdp", "fsdp_tp") if tensor_parallel else ("fsdp",))
    assert (training.dtype, training.batch_per_rank, case.backend) == ("float64", 2, "aot_eager")
    tp = training.mesh_shape[-1] if training.layout == "fsdp_tp" else 1
    assert all(d % tp == 0 for d in training.dims[1:-1]), training.dims
    assert "fullgraph=True" in case.call()


def test_a_compiled_training_case_refuses_a_layout_it_does_not_compile() -> None:
    training = dataclasses.replace(_any_training(), layout="ddp", precision=None)
    with pytest.raises(InvalidArgument, match=r"training\.layout='ddp'"):
        CompiledTrainingCase(training, "aot_eager")


def _any_training() -> ParityCase:
    found: list[ParityCase] = []

    @settings(max_examples=1, database=None)
    @given(compiled_training_cases(2, backend="aot_eager"))
    def first(case: CompiledTrainingCase) -> None:
        found.append(case.training)

    first()
    return found[0]


def test_every_family_has_skeletons_and_draws_only_its_own() -> None:
    assert {skeleton.family for skeleton in SKELETONS} == set(SKELETON_FAMILIES)
    for family in SKELETON_FAMILIES:
        own = {
            skeleton_case(2, i, "aot_eager").structure()
            for i, skeleton in enumerate(SKELETONS)
            if skeleton.family == family
        }
        assert {case.structure() for case in _drawn(family)} <= own
    with pytest.raises(InvalidArgument, match="family='kernels'"):
        compile_cases(2, backend="aot_eager", family="kernels")


def _drawn(family: str) -> list[CompileCase]:
    drawn: list[CompileCase] = []

    @settings(max_examples=5, database=None, deadline=None)
    @given(compile_cases(2, backend="aot_eager", family=family))
    def collect(case: CompileCase) -> None:
        drawn.append(case)

    collect()
    return drawn


def _program_of(family: str, world_size: int = 2) -> CompileCase:
    index = next(i for i, s in enumerate(SKELETONS) if s.family == family)
    return skeleton_case(world_size, index, "aot_eager")


def test_a_split_case_compiles_a_prefix_and_refuses_what_cannot_get_a_tangent() -> None:
    case = _program_of("boundaries")
    assert case.split is not None
    assert "rest eager" in case.call()
    steps = len(case.program.steps)
    with pytest.raises(InvalidArgument, match=f"split={steps + 1}"):
        dataclasses.replace(case, split=steps + 1)
    with pytest.raises(InvalidArgument, match="split=0"):
        dataclasses.replace(case, split=0)
    last_only = dataclasses.replace(case.program, loss_of_all=False)
    with pytest.raises(InvalidArgument, match="loss_of_all=False"):
        dataclasses.replace(case, program=last_only)
    assert dataclasses.replace(case, split=None).structure() != case.structure()


def test_a_guarded_case_shares_its_key_with_its_first_call() -> None:
    case = _program_of("guards")
    first = case.first_call()
    assert first is not None
    assert first.program.leaves[0].placements == case.guard_placements
    assert first.program.leaves[1:] == case.program.leaves[1:]
    assert first.guard_placements == ()
    # one key: the case's call meets the graph its first call compiled
    assert dataclasses.replace(first, guard_placements=case.program.leaves[0].placements)
    assert (
        case.structure()
        == dataclasses.replace(
            first, guard_placements=case.program.leaves[0].placements
        ).structure()
    )
    # but the full structures differ: the guard must compile anew
    assert first.structure() != dataclasses.replace(case, guard_placements=()).structure()
    assert _program_of("layouts").first_call() is None
    own = case.program.leaves[0].placements
    with pytest.raises(InvalidArgument, match="guard_placements="):
        dataclasses.replace(case, guard_placements=own)


def test_a_transposed_leaf_is_distributed_and_keyed_apart() -> None:
    with pytest.raises(InvalidArgument, match="how"):
        Leaf(SKELETONS[0].leaves[0][0], "from_local", 0, transposed=True)
    case = _program_of("guards")
    assert any(leaf.transposed for leaf in case.program.leaves)
    plain = tuple(dataclasses.replace(leaf, transposed=False) for leaf in case.program.leaves)
    other = dataclasses.replace(case, program=dataclasses.replace(case.program, leaves=plain))
    assert other.structure() != case.structure()
    reference = program_on_one_device(case.program, "cpu")
    assert not reference.contiguous[1]  # the leaf itself, a transposed view


def test_collectives_are_the_identity_without_a_gradient_on_one_device() -> None:
    case = _program_of("collectives", world_size=3)
    assert case.families() == ("collectives",)
    assert case.program.shape[0] % 3 == 0  # reduce_scatter_tensor splits dim 0 evenly
    reference = program_on_one_device(case.program, "cpu")
    leaves = len(case.program.leaves)
    for step, value, flag in zip(
        case.program.steps, reference.values[leaves:], reference.requires_grad[leaves:], strict=True
    ):
        assert OPS[step.op].collective
        assert not flag
        numpy.testing.assert_array_equal(value, reference.values[step.args[0]])
    assert "dist.all_reduce" in case.call()


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_program_property_never_draws_a_collective(data: st.DataObject) -> None:
    case = data.draw(program_cases(data.draw(st.integers(1, 4))))
    assert not any(OPS[step.op].collective for step in case.steps)


def test_steps_run_from_a_given_step_on() -> None:
    program = skeleton_program(2, 0)
    whole = torch.ones(program.shape, dtype=torch.float64)
    started = run_steps(program, [whole], None)
    assert len(started) == 1 + len(program.steps)
    resumed = run_steps(program, started[:2], None, first=1)
    assert len(resumed) == len(started)
    torch.testing.assert_close(resumed[-1], started[-1])
    assert Step("tanh", (0,)) == program.steps[0]
