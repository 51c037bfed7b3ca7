"""Strategies of the compile suite: DTensor programs from a small pool of skeletons, so that
examples reuse the graphs a rank compiled (a compile costs seconds, a cached call
milliseconds).

A skeleton fixes everything dynamo guards on (``CompileCase.structure``): the mesh (the
world's 1-D mesh), the leaves' shape, placements and how they are made, the steps. An
example draws a skeleton and its leaves' seeds: the values change, the graph does not.
Each skeleton stands for an op family a DTensor program meets under compile: pointwise
chains, reductions that leave a pending sum, contractions, to_local/from_local, in-place
ops and views, full_tensor and redistribute (``layouts``); pending reductions other than a
sum, all-reduced and reduce-scattered (``reduce_ops``); a compiled block between eager code,
its outputs live (``boundaries``); ``torch.distributed`` collectives on local pieces
(``collectives``); one callable called in other placements, and a transposed input
(``guards``). The suite tests each family apart, so every run compiles every family.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
_MAX: tuple[Placement, ...] = (Partial("max"),)
_MIN: tuple[Placement, ...] = (Partial("min"),)
_AVG: tuple[Placement, ...] = (Partial("avg"),)

FAMILIES = ("layouts", "reduce_ops", "boundaries", "collectives", "guards")
"""The skeletons' families, each a test of its own (every family compiled every run)."""


@dataclass(frozen=True)
class Skeleton:
    """A program's fixed part: each leaf's placements and how it is made (a distributed
    leaf may be ``"transposed"``: not contiguous), the steps, and the case's own compile
    fields (``CompileCase.split``, ``CompileCase.guard_placements``)."""

    family: str
    leaves: tuple[tuple[tuple[Placement, ...], str], ...]
    steps: tuple[Step, ...]
    even: bool = False
    """Leaves of 2 rows a rank (a collective's split of dim 0), else world size + 1 rows."""
    split: int | None = None
    guard_placements: tuple[Placement, ...] = ()


SKELETONS: tuple[Skeleton, ...] = (
    # pointwise: one sharding rule, the graph DTensor traces without a collective
    Skeleton(
        "layouts",
        ((_S0, "distribute"),),
        (Step("tanh", (0,)), Step("mul_scalar", (1,), scalar=2.0)),
    ),
    # a reduction over the sharded dim leaves a pending sum, which redistribute reduces
    Skeleton(
        "layouts",
        ((_S1, "from_local"),),
        (
            Step("sum_dim", (0,), dims=(1,)),
            Step("redistribute", (1,), target=_R),
            Step("relu", (2,)),
        ),
    ),
    # a contraction of a sharded and a replicated leaf, then a move of the result
    Skeleton(
        "layouts",
        ((_S0, "distribute"), (_R, "from_local")),
        (Step("matmul", (0, 1)), Step("redistribute", (2,), target=_S1)),
    ),
    # a pending sum made by from_local, its local pieces taken and given back
    Skeleton(
        "layouts",
        ((_P, "from_local"),),
        (
            Step("relabel", (0,), target=_S0, hint=True),
            Step("roundtrip", (1,)),
            Step("mul", (2, 2)),
        ),
    ),
    # in place on a replicated value, then a view and a full reduction
    Skeleton(
        "layouts",
        ((_R, "distribute"),),
        (
            Step("mul_scalar_", (0,), scalar=0.5),
            Step("transpose", (1,), dims=(0, 1)),
            Step("sum", (2,)),
        ),
    ),
    # two layouts met in one op, then full_tensor and a mean
    Skeleton(
        "layouts",
        ((_S0, "distribute"), (_S1, "distribute")),
        (Step("mul", (0, 1)), Step("full_tensor", (2,)), Step("mean_dim", (3,), dims=(0,))),
    ),
    # pending reductions other than a sum: to Replicate (an all-reduce of their op) and to
    # Shard (a reduce-scatter of their op) along dims 0 and 1, uneven
    Skeleton(
        "reduce_ops",
        ((_MAX, "from_local"), (_MIN, "from_local"), (_AVG, "from_local")),
        (
            Step("redistribute", (0,), target=_R),
            Step("redistribute", (1,), target=_S1),
            Step("redistribute", (2,), target=_S0),
            Step("redistribute", (0,), target=_S1),
        ),
    ),
    # a compiled block between eager code: to_local with grad_placements and from_local with
    # an uneven shape inside it, its outputs live (one Partial), the loss outside, and an
    # eager op that sends a Replicate output's gradient back sharded
    Skeleton(
        "boundaries",
        ((_R, "distribute"), (_S0, "distribute")),
        (
            Step("relabel", (0,), target=_R, partial_axes=(0,)),
            Step("relabel", (1,), target=_S0, hint=True),
            Step("mul_scalar", (0,), scalar=2.0),
            Step("sum_dim", (1,), dims=(0,)),
            Step("mul", (4, 1)),
            Step("add", (3, 2)),
        ),
        split=4,
    ),
    # torch.distributed collectives on local pieces (which dynamo remaps to functional
    # ones): Partial values reduced by hand with their own op, an even shard gathered
    Skeleton(
        "collectives",
        ((_MAX, "from_local"), (_MIN, "from_local"), (_P, "from_local")),
        (
            Step("all_reduce", (0,)),
            Step("reduce_scatter", (1,)),
            Step("all_gather", (4,)),
            Step("all_reduce", (2,)),
            Step("reduce_scatter", (0,)),
            Step("all_reduce", (1,)),
        ),
        even=True,
    ),
    # one compiled callable called with a leaf in other placements than it was traced for
    # (Replicate, then a pending sum of the same local shape), beside a transposed leaf
    Skeleton(
        "guards",
        ((_P, "from_local"), (_S0, "transposed")),
        (
            Step("redistribute", (0,), target=_R),
            Step("mul", (2, 1)),
            Step("transpose", (3,), dims=(0, 1)),
        ),
        guard_placements=_R,
    ),
)


def skeleton_program(
    world_size: int, index: int, seeds_of_leaves: tuple[int, ...] | None = None
) -> ProgramCase:
    """Skeleton ``index`` on the world's 1-D mesh, its leaves of shape (world size + 1, 3)
    (split unevenly over two ranks or more; 2 rows a rank for an ``even`` skeleton),
    holding the values of ``seeds_of_leaves`` (0, 1, ... by default)."""
    check_int("world_size", world_size)
    check_one_of("index", index, range(len(SKELETONS)))
    skeleton = SKELETONS[index]
    layouts = skeleton.leaves
    chosen = seeds_of_leaves if seeds_of_leaves is not None else tuple(range(len(layouts)))
    leaves = tuple(
        Leaf(placements, "distribute", seed, transposed=True)
        if how == "transposed"
        else Leaf(placements, how, seed)
        for (placements, how), seed in zip(layouts, chosen, strict=True)
    )
    rows = 2 * world_size if skeleton.even else world_size + 1
    return ProgramCase(MeshCase((world_size,)), (rows, 3), leaves, skeleton.steps)


def skeleton_case(
    world_size: int, index: int, backend: str, seeds_of_leaves: tuple[int, ...] | None = None
) -> CompileCase:
    """Skeleton ``index``'s program (``skeleton_program``) compiled with ``backend`` as the
    skeleton says (``split``, ``guard_placements``)."""
    program = skeleton_program(world_size, index, seeds_of_leaves)
    skeleton = SKELETONS[index]
    return CompileCase(program, backend, skeleton.split, skeleton.guard_placements)


def compile_cases(
    world_size: int, *, backend: str, family: str | None = None
) -> st.SearchStrategy[CompileCase]:
    """A skeleton of ``SKELETONS`` (of ``family``, or any; shrinking towards the first),
    its leaves' seeds drawn, compiled with ``backend``."""
    check_int("world_size", world_size)
    check_one_of("backend", backend, BACKENDS)
    if family is not None:
        check_one_of("family", family, FAMILIES)
    return _compile_cases(world_size, backend, family)


@cache
def _compile_cases(
    world_size: int, backend: str, family: str | None
) -> st.SearchStrategy[CompileCase]:
    indices = tuple(i for i, skeleton in enumerate(SKELETONS) if family in (None, skeleton.family))

    @st.composite
    def draw_case(draw: st.DrawFn) -> CompileCase:
        index = draw(sampled(indices))
        count = len(SKELETONS[index].leaves)
        drawn = tuple(draw(seeds()) for _ in range(count))
        return skeleton_case(world_size, index, backend, drawn)

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
