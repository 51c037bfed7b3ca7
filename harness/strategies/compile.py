"""Strategies of the compile suite: DTensor programs from a small pool of skeletons, so that
examples reuse the graphs a rank compiled (a compile costs seconds, a cached call
milliseconds).

A skeleton fixes everything dynamo guards on (``CompileCase.structure``): the mesh (the
world's 1-D mesh), the leaves' shape, placements and how they are made, the steps. An
example draws a skeleton and its leaves' seeds: the values change, the graph does not.
Each skeleton stands for an op family a DTensor program meets under compile: pointwise
chains, reductions that leave a pending sum, contractions, to_local/from_local, in-place
ops and views, full_tensor and redistribute.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

from hypothesis import strategies as st

from harness.cases.compile import BACKENDS, CompileCase, CompiledTrainingCase
from harness.cases.meshes import MeshCase
from harness.cases.programs import Leaf, ProgramCase, Step
from harness.errors import check_int, check_one_of
from harness.strategies._common import sampled, seeds
from harness.strategies.training import DTENSOR_UNSUPPORTED, parity_cases
from specs.placements import Partial, Placement, Replicate, Shard

_S0: tuple[Placement, ...] = (Shard(0),)
_S1: tuple[Placement, ...] = (Shard(1),)
_R: tuple[Placement, ...] = (Replicate(),)
_P: tuple[Placement, ...] = (Partial("sum"),)

Skeleton = tuple[tuple[tuple[tuple[Placement, ...], str], ...], tuple[Step, ...]]
"""Each leaf's placements and how it is made, then the steps."""

SKELETONS: tuple[Skeleton, ...] = (
    # pointwise: one sharding rule, the graph DTensor traces without a collective
    (((_S0, "distribute"),), (Step("tanh", (0,)), Step("mul_scalar", (1,), scalar=2.0))),
    # a reduction over the sharded dim leaves a pending sum, which redistribute reduces
    (
        ((_S1, "from_local"),),
        (
            Step("sum_dim", (0,), dims=(1,)),
            Step("redistribute", (1,), target=_R),
            Step("relu", (2,)),
        ),
    ),
    # a contraction of a sharded and a replicated leaf, then a move of the result
    (
        ((_S0, "distribute"), (_R, "from_local")),
        (Step("matmul", (0, 1)), Step("redistribute", (2,), target=_S1)),
    ),
    # a pending sum made by from_local, its local pieces taken and given back
    (
        ((_P, "from_local"),),
        (
            Step("relabel", (0,), target=_S0, hint=True),
            Step("roundtrip", (1,)),
            Step("mul", (2, 2)),
        ),
    ),
    # in place on a replicated value, then a view and a full reduction
    (
        ((_R, "distribute"),),
        (
            Step("mul_scalar_", (0,), scalar=0.5),
            Step("transpose", (1,), dims=(0, 1)),
            Step("sum", (2,)),
        ),
    ),
    # two layouts met in one op, then full_tensor and a mean
    (
        ((_S0, "distribute"), (_S1, "distribute")),
        (Step("mul", (0, 1)), Step("full_tensor", (2,)), Step("mean_dim", (3,), dims=(0,))),
    ),
)


def skeleton_program(
    world_size: int, index: int, seeds_of_leaves: tuple[int, ...] | None = None
) -> ProgramCase:
    """Skeleton ``index`` on the world's 1-D mesh, its leaves of shape (world size + 1, 3)
    (split unevenly over two ranks or more), holding the values of ``seeds_of_leaves``
    (0, 1, ... by default)."""
    check_int("world_size", world_size)
    check_one_of("index", index, range(len(SKELETONS)))
    layouts, steps = SKELETONS[index]
    chosen = seeds_of_leaves if seeds_of_leaves is not None else tuple(range(len(layouts)))
    leaves = tuple(
        Leaf(placements, how, seed) for (placements, how), seed in zip(layouts, chosen, strict=True)
    )
    return ProgramCase(MeshCase((world_size,)), (world_size + 1, 3), leaves, steps)


def compile_cases(world_size: int, *, backend: str) -> st.SearchStrategy[CompileCase]:
    """A skeleton of ``SKELETONS`` (shrinking towards the first), its leaves' seeds drawn,
    compiled with ``backend``."""
    check_int("world_size", world_size)
    check_one_of("backend", backend, BACKENDS)
    return _compile_cases(world_size, backend)


@cache
def _compile_cases(world_size: int, backend: str) -> st.SearchStrategy[CompileCase]:
    @st.composite
    def draw_case(draw: st.DrawFn) -> CompileCase:
        index = draw(sampled(tuple(range(len(SKELETONS)))))
        count = len(SKELETONS[index][0])
        drawn = tuple(draw(seeds()) for _ in range(count))
        return CompileCase(skeleton_program(world_size, index, drawn), backend)

    return draw_case()


TRAINING_DIMS = ((3, 4, 2), (2, 5, 4, 3))
"""The MLPs compiled training draws: a small pool, so that examples reuse a rank's graphs
(a block's graph is specific to its shapes)."""


def compiled_training_cases(
    world_size: int, *, backend: str, tensor_parallel: bool = True
) -> st.SearchStrategy[CompiledTrainingCase]:
    """A training run under fsdp (or fsdp_tp, at 2+ ranks where ``tensor_parallel``) of an
    MLP of ``TRAINING_DIMS``, two rows a data-parallel rank, its blocks compiled with
    ``backend``; the optimizer, the steps and the values drawn as the parity properties
    draw them."""
    check_int("world_size", world_size)
    check_one_of("backend", backend, BACKENDS)
    layouts = ("fsdp", "fsdp_tp") if world_size > 1 and tensor_parallel else ("fsdp",)
    return _compiled_training_cases(world_size, backend, layouts)


@cache
def _compiled_training_cases(
    world_size: int, backend: str, layouts: tuple[str, ...]
) -> st.SearchStrategy[CompiledTrainingCase]:
    @st.composite
    def draw_case(draw: st.DrawFn) -> CompiledTrainingCase:
        layout = draw(sampled(layouts))
        training = draw(parity_cases(world_size, layout=layout, unsupported=DTENSOR_UNSUPPORTED))
        dims = draw(sampled(TRAINING_DIMS))
        if layout == "fsdp_tp":  # the TP degree divides every hidden size
            tp = training.mesh_shape[-1]
            dims = tuple(d * tp if 0 < i < len(dims) - 1 else d for i, d in enumerate(dims))
        fixed = replace(training, dims=dims, batch_per_rank=2, dtype="float64")
        return CompiledTrainingCase(fixed, backend)

    return draw_case()
