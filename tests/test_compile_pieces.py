"""The compile suite's pieces: its cases and their structure key, the skeleton pool, which
errors are refusals, the per-process cache of compiled callables."""

from __future__ import annotations

import dataclasses

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
from harness.cases.programs import OPS
from harness.cases.training import ParityCase
from harness.errors import InvalidArgument
from harness.strategies import compile_cases, compiled_training_cases
from harness.strategies.compile import SKELETONS, skeleton_program
from harness.torchkit.compile import compiled, refusal_of, timed
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
        assert len(reference.values) == len(SKELETONS[index][0]) + len(SKELETONS[index][1])


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
    pool = {CompileCase(skeleton_program(world_size, i), backend).structure() for i in range(6)}
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
