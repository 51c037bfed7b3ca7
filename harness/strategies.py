"""Hypothesis strategies for distconf cases, valid by construction.

Strategies run only in the driver. Each public strategy validates its arguments eagerly and
names the bad value (``world_size=0 must be ...``); what it draws always fits together
(placements fit the mesh and the tensor rank, mesh shapes multiply to the world size).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from functools import cache
from itertools import product
from typing import Any, TypeVar

from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

from harness.cases import DTYPES, DistributeCase, MLPCase, RedistributeCase
from specs.placements import REDUCE_OPS, Partial, Placement, Replicate, Shard

T = TypeVar("T")
MAX_SIDE = 17
MAX_MESH_NDIM = 3


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def _takes_world_size(
    composite: Callable[..., st.SearchStrategy[T]],
) -> Callable[..., st.SearchStrategy[T]]:
    """Validate ``world_size`` when the strategy is built, not when it is first drawn from;
    build each distinct strategy once (tests ask for one in every example)."""
    built = functools.lru_cache(maxsize=256)(composite)

    @functools.wraps(composite)
    def strategy(world_size: int, **kwargs: Any) -> st.SearchStrategy[T]:
        _check_int("world_size", world_size, 1)
        return built(world_size, **kwargs)

    return strategy


def _check_subset(name: str, values: Sequence[str], allowed: Sequence[str]) -> None:
    if not values or any(v not in allowed for v in values):
        raise ValueError(f"{name}={tuple(values)!r} must be a non-empty subset of {allowed}")


@cache
def factorisations(world_size: int, max_ndim: int) -> tuple[tuple[int, ...], ...]:
    """Every ordered factorisation of ``world_size`` into 1..``max_ndim`` factors, 1s included."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return tuple(
        shape
        for ndim in range(1, max_ndim + 1)
        for shape in product(divisors, repeat=ndim)
        if math.prod(shape) == world_size
    )


@cache
def _sampled(values: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    # Strategies are built once per distinct argument: building them inside every draw
    # costs more than the draw itself.
    return st.sampled_from(values)


@cache
def _array_shapes(
    min_ndim: int, max_ndim: int, max_side: int
) -> st.SearchStrategy[tuple[int, ...]]:
    return array_shapes(min_dims=min_ndim, max_dims=max_ndim, min_side=0, max_side=max_side)


_SEEDS = st.integers(0, 2**32 - 1)


def mesh_shapes(
    world_size: int, *, max_ndim: int = MAX_MESH_NDIM
) -> st.SearchStrategy[tuple[int, ...]]:
    """Mesh shapes whose product is ``world_size``, 1-D first (hypothesis shrinks there).

    Four draws in five avoid size-1 axes, which add mesh dims that move no data; the fifth
    may have them (a size-1 axis is still a case DTensor must get right).
    """
    _check_int("world_size", world_size, 1)
    _check_int("max_ndim", max_ndim, 1)
    every = factorisations(world_size, max_ndim)
    real = tuple(shape for shape in every if 1 not in shape) or every
    return _mix((4, _sampled(real)), (1, _sampled(every)))


def shapes(
    *, min_ndim: int = 0, max_ndim: int = 3, max_side: int = MAX_SIDE, near: int = 4
) -> st.SearchStrategy[tuple[int, ...]]:
    """Global tensor shapes, weighted towards sides that make uneven pieces on a mesh axis
    of size ``near``: most sides are 1..2*near+1 (smaller than the axis, not divisible by
    it, a few pieces each), some are empty (0) or up to ``max_side``; 0-d tensors are rare.
    Every draw checks values: a shape with a zero side or no dims is never the majority."""
    _check_int("min_ndim", min_ndim, 0)
    _check_int("max_ndim", max_ndim, min_ndim)
    _check_int("max_side", max_side, 0)
    _check_int("near", near, 1)
    return _shapes(min_ndim, max_ndim, max_side, min(near, max_side))


@cache
def _mix(*weighted: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """Draw from each strategy with its weight; the first shrinks best (list it first)."""
    picks = tuple(strategy for weight, strategy in weighted for _ in range(weight))
    return st.integers(0, len(picks) - 1).flatmap(lambda pick: picks[pick])


@cache
def _shapes(
    min_ndim: int, max_ndim: int, max_side: int, near: int
) -> st.SearchStrategy[tuple[int, ...]]:
    ranks = tuple(range(max(1, min_ndim), max_ndim + 1)) or (min_ndim,)
    ndim = _mix((9, _sampled(ranks)), (1, _sampled((min_ndim,))))
    uneven = st.integers(min(1, max_side), min(max_side, 2 * near + 1))
    side = _mix((16, uneven), (3, st.integers(0, max_side)), (1, st.just(0)))
    return ndim.flatmap(lambda n: st.tuples(*[side] * n))


def dtypes(allowed: Sequence[str] = DTYPES) -> st.SearchStrategy[str]:
    _check_subset("allowed", allowed, DTYPES)
    return _sampled(tuple(allowed))


def seeds() -> st.SearchStrategy[int]:
    return _SEEDS


def _axis_choices(tensor_ndim: int, partial_op: str | None) -> tuple[Placement, ...]:
    """Replicate first (hypothesis shrinks a ``sampled_from`` towards its first element),
    then Shard of every dim, counted from the front and from the back."""
    choices: list[Placement] = [Replicate()]
    choices += [Shard(d) for d in range(tensor_ndim)]
    choices += [Shard(d - tensor_ndim) for d in range(tensor_ndim)]
    if partial_op is not None:
        choices.append(Partial(partial_op))
    return tuple(choices)


def placements(
    mesh_ndim: int, tensor_ndim: int, *, reduce_ops: Sequence[str] = REDUCE_OPS
) -> st.SearchStrategy[tuple[Placement, ...]]:
    """One placement per mesh axis for a tensor of rank ``tensor_ndim``.

    All ``Partial`` axes of one draw share a reduce op: with two different ops the global
    value depends on the order the axes are reduced in, and ``distribute_tensor`` refuses
    mixed ops. Pass ``reduce_ops=()`` for no ``Partial`` at all.
    """
    _check_int("mesh_ndim", mesh_ndim, 1)
    _check_int("tensor_ndim", tensor_ndim, 0)
    if any(op not in REDUCE_OPS for op in reduce_ops):
        raise ValueError(f"reduce_ops={tuple(reduce_ops)!r} must be a subset of {REDUCE_OPS}")
    return _placements(mesh_ndim, tensor_ndim, tuple(reduce_ops))


@cache
@st.composite
def _placements(
    draw: st.DrawFn, mesh_ndim: int, tensor_ndim: int, reduce_ops: tuple[str, ...]
) -> tuple[Placement, ...]:
    op = draw(_sampled(reduce_ops)) if reduce_ops else None
    axis = _sampled(_axis_choices(tensor_ndim, op))
    return tuple(draw(axis) for _ in range(mesh_ndim))


def _ops_for(dtype: str) -> tuple[str, ...]:
    # An average of integers needs a rounding rule no placement spec states: not drawn.
    return tuple(op for op in REDUCE_OPS if not (dtype == "int64" and op == "avg"))


@_takes_world_size
@st.composite
def distribute_cases(draw: st.DrawFn, world_size: int) -> DistributeCase:
    """A tensor, a mesh over ``world_size`` ranks and placements for ``distribute_tensor``.

    int64 never meets ``Partial('sum')`` here: torch 2.13 turns it into float32
    (spec ``placements.distribute.partial_sum_keeps_dtype`` checks that on its own).
    """
    mesh = draw(mesh_shapes(world_size))
    shape = draw(shapes(near=max(mesh)))
    dtype = draw(dtypes())
    ops = tuple(op for op in _ops_for(dtype) if not (dtype == "int64" and op == "sum"))
    chosen = draw(placements(len(mesh), len(shape), reduce_ops=ops))
    return DistributeCase(mesh, chosen, shape, dtype, draw(seeds()))


@_takes_world_size
@st.composite
def redistribute_cases(
    draw: st.DrawFn,
    world_size: int,
    *,
    reduce_ops: tuple[str, ...] = REDUCE_OPS,
    shardable_ops: frozenset[str] = frozenset(REDUCE_OPS),
) -> RedistributeCase:
    """A source and a destination layout for ``redistribute``.

    A destination axis is ``Shard``, ``Replicate`` or the source's own ``Partial``
    (redistributing *into* a new Partial is refused by DTensor, checked by
    ``placements.redistribute.partial_target_rejected``). A ``Partial(op)`` axis becomes
    ``Shard`` (a reduce-scatter with ``op``) only when ``op`` is in ``shardable_ops``.
    """
    mesh = draw(mesh_shapes(world_size))
    shape = draw(shapes(near=max(mesh)))
    dtype = draw(dtypes())
    ops = tuple(op for op in _ops_for(dtype) if op in reduce_ops)
    src = draw(placements(len(mesh), len(shape), reduce_ops=ops))
    choices = [_destinations(p, len(shape), shardable_ops) for p in src]
    dst = [draw(_sampled(c)) for c in choices]
    if dst == list(src):  # nothing to move: change the first axis that has another choice
        axis = next((a for a, c in enumerate(choices) if len(c) > 1), None)
        if axis is not None:
            others = tuple(c for c in choices[axis] if c != src[axis])
            dst[axis] = draw(_sampled(others))
    return RedistributeCase(mesh, src, tuple(dst), shape, dtype, draw(seeds()))


def _destinations(
    source: Placement, tensor_ndim: int, shardable_ops: frozenset[str]
) -> tuple[Placement, ...]:
    choices = _axis_choices(tensor_ndim, None)
    if isinstance(source, Partial):
        choices += (source,)
        if source.reduce_op not in shardable_ops:
            choices = tuple(c for c in choices if not isinstance(c, Shard))
    return choices


@_takes_world_size
@st.composite
def partial_target_cases(draw: st.DrawFn, world_size: int) -> RedistributeCase:
    """A redistribute whose destination adds a ``Partial`` on an axis the source does not
    hold it on (DTensor must refuse it)."""
    mesh = draw(mesh_shapes(world_size))
    shape = draw(shapes())
    dtype = draw(dtypes())
    src = list(draw(placements(len(mesh), len(shape), reduce_ops=_ops_for(dtype))))
    axis = draw(st.integers(0, len(mesh) - 1))
    src[axis] = draw(_sampled(_axis_choices(len(shape), None)))
    held = {p.reduce_op for p in src if isinstance(p, Partial)}
    op = held.pop() if held else draw(_sampled(_ops_for(dtype)))
    dst = [*src[:axis], Partial(op), *src[axis + 1 :]]
    return RedistributeCase(mesh, tuple(src), tuple(dst), shape, dtype, draw(seeds()))


@_takes_world_size
@st.composite
def extremum_to_shard_cases(draw: st.DrawFn, world_size: int) -> RedistributeCase:
    """A ``Partial('max'|'min')`` axis that becomes ``Shard`` (a reduce-scatter with max/min)."""
    mesh = draw(mesh_shapes(world_size))
    shape = draw(shapes(min_ndim=1))
    dtype = draw(dtypes())
    op = draw(_sampled(("max", "min")))
    src = list(draw(placements(len(mesh), len(shape), reduce_ops=(op,))))
    axis = draw(st.integers(0, len(mesh) - 1))
    src[axis] = Partial(op)
    dst = [draw(_sampled((*_axis_choices(len(shape), None), p))) for p in src]
    dst[axis] = Shard(draw(st.integers(-len(shape), len(shape) - 1)))
    return RedistributeCase(mesh, tuple(src), tuple(dst), shape, dtype, draw(seeds()))


@_takes_world_size
@st.composite
def partial_sum_integer_cases(draw: st.DrawFn, world_size: int) -> DistributeCase:
    """int64 tensors distributed with at least one ``Partial('sum')`` axis."""
    mesh = draw(mesh_shapes(world_size))
    shape = draw(shapes())
    chosen = list(draw(placements(len(mesh), len(shape), reduce_ops=("sum",))))
    chosen[draw(st.integers(0, len(mesh) - 1))] = Partial("sum")
    return DistributeCase(mesh, tuple(chosen), shape, "int64", draw(seeds()))


@_takes_world_size
@st.composite
def uneven_redistribute_cases(draw: st.DrawFn, world_size: int) -> RedistributeCase:
    """Shard/Replicate to Shard/Replicate on 1-D and 2-D meshes, dims drawn around the axis
    sizes so pieces are short, empty or uneven (the collectives pad them)."""
    mesh = draw(mesh_shapes(world_size, max_ndim=2))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 2 * max(mesh) + 1)) for _ in range(ndim))
    dtype = draw(dtypes(("float32", "int64")))
    src = draw(placements(len(mesh), ndim, reduce_ops=()))
    dst = draw(placements(len(mesh), ndim, reduce_ops=()))
    return RedistributeCase(mesh, src, dst, shape, dtype, draw(seeds()))


@_takes_world_size
@st.composite
def uneven_shard_cases(draw: st.DrawFn, world_size: int) -> DistributeCase:
    """``Shard`` on a 1-D mesh where the sharded dim is around the world size: smaller than
    it, not divisible by it, or empty, so trailing ranks get short or empty pieces."""
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    sides = [draw(st.integers(0, 5)) for _ in range(ndim)]
    sides[dim] = draw(st.integers(0, 2 * world_size + 1))
    dtype = draw(dtypes(("float32", "int64")))
    return DistributeCase((world_size,), (Shard(dim),), tuple(sides), dtype, draw(seeds()))


@_takes_world_size
@st.composite
def mlp_cases(draw: st.DrawFn, world_size: int) -> MLPCase:
    """MLPs whose feature sizes are drawn around the world size (uneven and empty shards)."""
    n_layers = draw(st.integers(1, 3))
    dims = tuple(draw(st.integers(1, 2 * world_size + 1)) for _ in range(n_layers + 1))
    return MLPCase(
        dims=dims,
        bias=draw(st.booleans()),
        shard_layers=draw(st.booleans()),
        batch_per_rank=draw(st.integers(1, 3)),
        lr=draw(st.sampled_from((0.1, 0.01))),
        momentum=draw(st.sampled_from((0.0, 0.9))),
        dtype=draw(st.sampled_from(("float64", "float32"))),
        seed=draw(seeds()),
    )
