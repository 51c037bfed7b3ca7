"""Strategies for DTensor programs: straight-line programs one device accepts by
construction, each step drawn among the ops that fit the shapes of the values before it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cache

from hypothesis import strategies as st

from harness.cases.meshes import MeshCase
from harness.cases.programs import (
    LEAF_KINDS,
    OPS,
    Leaf,
    ProgramCase,
    Shape,
    Step,
    may_be_partial,
)
from harness.errors import check_int
from harness.strategies._common import (
    Lacks,
    checked_lacks,
    mix,
    sampled,
    seeds,
    shapes,
    takes_world_size,
)
from harness.strategies.meshes import mesh_cases
from harness.strategies.placements import placements
from specs.placements import Partial, Placement, Replicate, Shard, local_boxes

# Powers of two and small integers: a scaled or shifted value stays exact in float64.
_SCALARS = (2.0, 0.5, -1.0, 3.0, 1.5)
_REDUCING_IN_PLACE = ("add_scalar_", "mul_")
# The steps that move a value between layouts (and the reductions that make pending sums
# for them to move) are where DTensor differs from one device: drawn more often than the
# pointwise ops, which share one sharding rule.
_WEIGHTS = {
    "redistribute": 3,
    "roundtrip": 3,
    "relabel": 4,
    "full_tensor": 2,
    "sum": 2,
    "sum_dim": 2,
    "matmul": 2,
    "transpose": 2,
    "mul_": 2,
    "add_scalar_": 2,
}
_ARITY_ONE_NEEDS: dict[str, Callable[[Shape], bool]] = {
    "sum_dim": lambda s: len(s) >= 1,
    "mean_dim": lambda s: any(side > 0 for side in s),
    "transpose": lambda s: len(s) >= 2,
    "unsqueeze": lambda s: len(s) <= 3,
}


def program_cases(
    world_size: int, *, max_steps: int = 8, lacks: Lacks = frozenset()
) -> st.SearchStrategy[ProgramCase]:
    """1-3 leaves of one shape with elements on a drawn mesh (every construction of
    ``mesh_cases``), each laid out by its own placements (Partial only 'sum': the one
    reduction with a gradient of its own), then 1-``max_steps`` steps, each of an op that
    fits the values before it."""
    check_int("world_size", world_size)
    check_int("max_steps", max_steps)
    return _program_cases(world_size, max_steps, checked_lacks(lacks))


@cache
@st.composite
def _program_cases(draw: st.DrawFn, world_size: int, max_steps: int, lacks: Lacks) -> ProgramCase:
    mesh = draw(mesh_cases(world_size, lacks=lacks))
    shape = draw(_shapes(max(mesh.shape)))
    count = draw(st.integers(1, 3))
    leaves = tuple(
        draw(
            _shaped(
                _unit_dims_whole(draw(_leaves(len(mesh.shape), len(shape))), shape),
                shape,
                mesh.shape,
            )
        )
        for _ in range(count)
    )
    known: list[Shape] = [shape] * count
    partial = [any(isinstance(p, Partial) for p in leaf.placements) for leaf in leaves]
    steps: list[Step] = []
    for _ in range(draw(st.integers(1, max_steps))):
        step = draw(_step(tuple(known), tuple(partial), mesh))
        steps.append(step)
        known.append(OPS[step.op].shape([known[a] for a in step.args], step))
        partial.append(may_be_partial(step, [partial[a] for a in step.args]))
    return ProgramCase(mesh, shape, leaves, tuple(steps), draw(st.booleans()))


def _evenly_split(shape: Shape, mesh_shape: tuple[int, ...], target: tuple[Placement, ...]) -> bool:
    """Every rank holds a piece of one shape: from_local can infer the global shape."""
    boxes = local_boxes(shape, mesh_shape, target)
    return len({local_shape for local_shape, _ in boxes.values()}) == 1


@st.composite
def _shaped(draw: st.DrawFn, leaf: Leaf, shape: Shape, mesh_shape: tuple[int, ...]) -> Leaf:
    """A from_local leaf of an even split may leave its shape and stride to torch."""
    if leaf.how != "from_local" or not _evenly_split(shape, mesh_shape, leaf.placements):
        return leaf
    return dataclasses.replace(leaf, explicit_shape=draw(st.booleans()))


@cache
def _shapes(near: int) -> st.SearchStrategy[Shape]:
    # Tensors without elements are left to the specs of their own: torch 2.13's view rule
    # refuses any view of one with a sharded dim, which backward passes take (spec
    # placements.ops.matmul_empty_batch).
    return shapes(near=near).filter(lambda shape: 0 not in shape)


def _unit_dims_replicated(placements: tuple[Placement, ...], shape: Shape) -> tuple[Placement, ...]:
    """Replicate where a placement shards a dim of size 1. einsum squeezes and views such a
    dim of its operands (and its backward of their gradients), which torch
    2.13 refuses, as it refuses einsum of a tensor sharded there (spec
    placements.ops.einsum_unit_dim checks that on its own)."""
    return tuple(
        Replicate() if isinstance(p, Shard) and shape[p.dim % len(shape)] == 1 else p
        for p in placements
    )


def _unit_dims_whole(leaf: Leaf, shape: Shape) -> Leaf:
    return Leaf(_unit_dims_replicated(leaf.placements, shape), leaf.how, leaf.seed)


@cache
def _leaves(mesh_ndim: int, ndim: int) -> st.SearchStrategy[Leaf]:
    return st.builds(
        Leaf,
        placements(mesh_ndim, ndim, reduce_ops=("sum",)),
        sampled(LEAF_KINDS),
        seeds(),
    )


def _candidates(
    op: str, known: tuple[Shape, ...], partial: tuple[bool, ...]
) -> tuple[tuple[int, ...], ...]:
    """The argument tuples ``op`` accepts among the values of these shapes. An in-place op
    that may have to reduce its self argument first is drawn only on values that hold no
    Partial (spec placements.program.inplace_on_partial checks that case on its own)."""
    values = [i for i in range(len(known)) if not (op in _REDUCING_IN_PLACE and partial[i])]
    if OPS[op].arity == 1:
        fits = _ARITY_ONE_NEEDS.get(op)
        return tuple((i,) for i in values if fits is None or fits(known[i]))
    pairs = [(i, j) for i in values for j in range(len(known))]
    if op in ("matmul", "einsum"):
        return tuple((i, j) for i, j in pairs if len(known[i]) == 2 and known[i] == known[j])
    if op == "mul_":  # in place: the result keeps the first value's shape
        return tuple((i, j) for i, j in pairs if known[j] in (known[i], ()))
    return tuple((i, j) for i, j in pairs if known[i] == known[j] or () in (known[i], known[j]))


def _arguments(
    candidates: tuple[tuple[int, ...], ...], count: int
) -> st.SearchStrategy[tuple[int, ...]]:
    """Half the draws read the newest value (programs chain their steps), the others any
    fitting value; both shrink towards the first fitting candidate."""
    newest = tuple(c for c in candidates if c[0] == count - 1)
    anywhere = sampled(candidates)
    return mix((1, anywhere), (1, sampled(newest))) if newest else anywhere


@st.composite
def _step(
    draw: st.DrawFn, known: tuple[Shape, ...], partial: tuple[bool, ...], mesh: MeshCase
) -> Step:
    fitting = tuple(op for op in OPS if not OPS[op].collective and _candidates(op, known, partial))
    op = draw(sampled(tuple(name for name in fitting for _ in range(_WEIGHTS.get(name, 1)))))
    args = draw(_arguments(_candidates(op, known, partial), len(known)))
    shape = known[args[0]]
    if op in ("sum_dim", "mean_dim"):
        dims = [d for d in range(len(shape)) if op == "sum_dim" or shape[d] > 0]
        dim = draw(sampled(tuple(dims)))
        spelled = draw(sampled((dim, dim - len(shape))))
        return Step(op, args, dims=(spelled,), keepdim=draw(st.booleans()))
    if op == "transpose":
        pair = draw(st.lists(st.integers(0, len(shape) - 1), min_size=2, max_size=2, unique=True))
        return Step(op, args, dims=tuple(pair))
    if op == "unsqueeze":
        return Step(op, args, dims=(draw(st.integers(0, len(shape))),))
    if op in ("redistribute", "relabel"):
        target = _unit_dims_replicated(draw(_targets(len(mesh.shape), len(shape))), shape)
        if op == "redistribute":
            return Step(op, args, target=target)
        return draw(_relabel(args, target, shape, mesh.shape))
    if "scalar" in op:
        return Step(op, args, scalar=draw(sampled(_SCALARS)))
    return Step(op, args)


@cache
def _targets(mesh_ndim: int, ndim: int) -> st.SearchStrategy[tuple[Placement, ...]]:
    return placements(mesh_ndim, ndim, reduce_ops=())


@st.composite
def _relabel(
    draw: st.DrawFn,
    args: tuple[int, ...],
    target: tuple[Placement, ...],
    shape: Shape,
    mesh_shape: tuple[int, ...],
) -> Step:
    replicated = [axis for axis, p in enumerate(target) if isinstance(p, Replicate)]
    partial_axes = tuple(axis for axis in replicated if draw(st.booleans()))
    even = _evenly_split(shape, mesh_shape, target)
    sharded = any(isinstance(p, Shard) for p in target)
    # from_local infers the global shape from an even split only
    explicit = draw(st.booleans()) if even or not sharded else True
    return Step(
        "relabel",
        args,
        target=target,
        partial_axes=partial_axes,
        hint=draw(st.booleans()),
        explicit_shape=explicit,
    )


@takes_world_size
@st.composite
def inplace_on_partial_cases(
    draw: st.DrawFn, world_size: int, *, lacks: Lacks = frozenset()
) -> ProgramCase:
    """A leaf with a sharded dim, a reduction over it (a Partial result where the dim is
    split), then an in-place op that needs the reduced value: a scalar added, or the value
    multiplied by itself."""
    mesh = draw(mesh_cases(world_size, lacks=lacks))
    shape = draw(_shapes(max(mesh.shape)).filter(lambda s: len(s) >= 1))
    chosen = list(draw(_targets(len(mesh.shape), len(shape))))
    dim = draw(st.integers(0, len(shape) - 1))
    chosen[draw(st.integers(0, len(chosen) - 1))] = Shard(dim)
    leaf = Leaf(tuple(chosen), draw(sampled(LEAF_KINDS)), draw(seeds()))
    reduced = draw(sampled((Step("sum", (0,)), Step("sum_dim", (0,), dims=(dim,)))))
    inplace = draw(
        sampled((Step("add_scalar_", (1,), scalar=draw(sampled(_SCALARS))), Step("mul_", (1, 1))))
    )
    return ProgramCase(mesh, shape, (leaf,), (reduced, inplace))


@takes_world_size
@st.composite
def einsum_unit_dim_cases(
    draw: st.DrawFn, world_size: int, *, lacks: Lacks = frozenset()
) -> ProgramCase:
    """einsum('ij,kj->ik') of a 2-D leaf with itself, one of its dims of size 1 and sharded
    on one mesh axis (the others Replicate), then backward."""
    mesh = draw(mesh_cases(world_size, lacks=lacks))
    dim = draw(st.integers(0, 1))
    shape = [draw(st.integers(1, 2 * max(mesh.shape) + 1)) for _ in range(2)]
    shape[dim] = 1
    chosen: list[Placement] = [Replicate()] * len(mesh.shape)
    chosen[draw(st.integers(0, len(chosen) - 1))] = Shard(dim)
    leaf = Leaf(tuple(chosen), draw(sampled(LEAF_KINDS)), draw(seeds()))
    return ProgramCase(mesh, tuple(shape), (leaf,), (Step("einsum", (0, 0)),))
