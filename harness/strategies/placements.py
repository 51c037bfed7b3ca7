"""Strategies for DTensor placement cases: placements valid for a mesh and a tensor rank,
``distribute_tensor`` and ``redistribute`` cases, uneven shards."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache

from hypothesis import strategies as st

from harness.cases.placements import (
    FACTORIES,
    DistributeCase,
    FactoryCase,
    FillValue,
    FlattenedCase,
    OpCase,
    RedistributeCase,
    ReshapeCase,
)
from harness.errors import check_int, check_subset, require
from harness.strategies._common import (
    Lacks,
    checked_lacks,
    dtypes,
    factorisations,
    sampled,
    seeds,
    shapes,
    takes_world_size,
)
from harness.strategies.meshes import mesh_cases
from harness.torchkit.dtensor_ops import OPS, Op
from specs.placements import (
    REDUCE_OPS,
    Partial,
    Placement,
    Replicate,
    Shard,
    local_boxes,
    normalize,
)


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
    check_int("mesh_ndim", mesh_ndim)
    check_int("tensor_ndim", tensor_ndim, 0)
    check_subset("reduce_ops", reduce_ops, REDUCE_OPS)
    return _placements(mesh_ndim, tensor_ndim, tuple(reduce_ops))


@cache
@st.composite
def _placements(
    draw: st.DrawFn, mesh_ndim: int, tensor_ndim: int, reduce_ops: tuple[str, ...]
) -> tuple[Placement, ...]:
    op = draw(sampled(reduce_ops)) if reduce_ops else None
    axis = sampled(_axis_choices(tensor_ndim, op))
    return tuple(draw(axis) for _ in range(mesh_ndim))


def _ops_for(dtype: str) -> tuple[str, ...]:
    # An average of integers needs a rounding rule no placement spec states: not drawn.
    return tuple(op for op in REDUCE_OPS if not (dtype == "int64" and op == "avg"))


@takes_world_size
@st.composite
def distribute_cases(
    draw: st.DrawFn, world_size: int, *, no_source: bool = False, lacks: Lacks = frozenset()
) -> DistributeCase:
    """A tensor, a mesh over ``world_size`` ranks, placements and a ``src_data_rank`` (a
    group rank every axis has; ``no_source=True`` also draws None where no axis is Partial)
    for ``distribute_tensor``; source 0 where the World lacks ``scatter.group_src``.

    int64 never meets ``Partial('sum')`` here: torch 2.13 turns it into float32
    (spec ``placements.distribute.partial_sum_keeps_dtype`` checks that on its own).
    """
    built = draw(mesh_cases(world_size, lacks=lacks))
    mesh = built.shape
    shape = draw(shapes(near=max(mesh)))
    dtype = draw(dtypes())
    ops = tuple(op for op in _ops_for(dtype) if not (dtype == "int64" and op == "sum"))
    chosen = draw(placements(len(mesh), len(shape), reduce_ops=ops))
    sources: tuple[int | None, ...] = tuple(range(min(mesh)))
    if no_source and not any(isinstance(p, Partial) for p in chosen):
        sources += (None,)
    seed, source = draw(seeds()), draw(sampled(sources))
    if "scatter.group_src" in lacks and source:
        source = 0  # drawn all the same, as mesh_cases does with a construction it lacks
    return DistributeCase(mesh, chosen, shape, dtype, seed, source, built)


@takes_world_size
@st.composite
def op_cases(draw: st.DrawFn, world_size: int, *, lacks: Lacks = frozenset()) -> tuple[OpCase, ...]:
    """A float64 DTensor laid out by drawn placements and 1-4 distinct ops of
    ``harness.torchkit.dtensor_ops`` that fit its rank (amax/amin along a non-empty dim, as on one
    device), each an ``OpCase`` of the same source. An op along a dim is applied along each
    of them, in a drawn order, each dim spelled ``d`` or ``d - ndim``.

    max/min reductions are drawn only where no rank holds an empty shard
    (``extremum_empty_shard_cases`` draws those), matmul only where no dim of size 0 is
    sharded in a tensor of 3 or more dims (``matmul_empty_batch_cases``)."""
    built = draw(mesh_cases(world_size, lacks=lacks))
    mesh = built.shape
    shape = draw(shapes(near=max(mesh)))
    chosen = draw(placements(len(mesh), len(shape)))
    empty = any(0 in box for box, _ in local_boxes(shape, mesh, chosen).values())
    sharded = any(isinstance(p, Shard) for p in chosen)
    empty_batch = _shards_an_empty_dim_of_a_batch(shape, chosen)
    fitting = [name for name, op in OPS.items() if _fits(op, shape, empty, sharded, empty_batch)]
    names = draw(st.lists(sampled(tuple(fitting)), min_size=1, max_size=4, unique=True))
    source = DistributeCase(mesh, chosen, shape, "float64", draw(seeds()), 0, built)
    return tuple(OpCase(source, name, draw(_applications(name, shape))) for name in names)


@st.composite
def _applications(
    draw: st.DrawFn, name: str, shape: tuple[int, ...]
) -> tuple[tuple[int, bool], ...]:
    op = OPS[name]
    if not op.needs_dim:
        return ((0, draw(st.booleans())),)
    dims = [d for d in range(len(shape)) if not (op.nonempty_dim and shape[d] == 0)]
    spelled = _spelled if op.negative_dims else _from_the_front
    return tuple(
        (draw(spelled(d, len(shape))), draw(st.booleans())) for d in draw(st.permutations(dims))
    )


def _spelled(dim: int, ndim: int) -> st.SearchStrategy[int]:
    """``dim`` as torch accepts it: counted from the front or from the back."""
    return sampled((dim, dim - ndim))


def _from_the_front(dim: int, ndim: int) -> st.SearchStrategy[int]:
    return st.just(dim)


@takes_world_size
@st.composite
def reshape_cases(draw: st.DrawFn, world_size: int, *, lacks: Lacks = frozenset()) -> ReshapeCase:
    """A DTensor with elements laid out by drawn placements, viewed or reshaped to 1-3 dims
    that regroup its elements (the prime factors of its size dealt out anew, sides of 1
    among them). Tensors without elements are left to ``flatten_empty_cases``: torch 2.13
    never returns from some of their views (spec placements.ops.flatten_empty)."""
    built = draw(mesh_cases(world_size, lacks=lacks))
    mesh = built.shape
    shape = draw(shapes(min_ndim=1, near=max(mesh)).filter(lambda s: 0 not in s))
    chosen = draw(placements(len(mesh), len(shape)))
    target = [1] * draw(st.integers(1, 3))
    for prime in _prime_factors(math.prod(shape)):
        target[draw(st.integers(0, len(target) - 1))] *= prime
    source = DistributeCase(mesh, chosen, shape, "float64", draw(seeds()), 0, built)
    return ReshapeCase(source, tuple(target), draw(sampled(("view", "reshape"))))


def _prime_factors(n: int) -> list[int]:
    found, factor = [], 2
    while n > 1:
        while n % factor == 0:
            found.append(factor)
            n //= factor
        factor += 1
    return found


@takes_world_size
@st.composite
def scan_negative_dim_cases(draw: st.DrawFn, world_size: int) -> OpCase:
    """cumsum along a dim given counted from the back, on a tensor a 1-D mesh of
    ``world_size`` >= 2 ranks shards along that dim."""
    require(world_size >= 2, "world_size", world_size, ">= 2 for a dim to be split")
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[dim] = draw(st.integers(world_size, 2 * world_size + 1))
    source = DistributeCase((world_size,), (Shard(dim),), tuple(shape), "float64", draw(seeds()))
    return OpCase(source, "cumsum", ((dim - ndim, False),))


@takes_world_size
@st.composite
def flatten_empty_cases(draw: st.DrawFn, world_size: int) -> OpCase:
    """flatten of a tensor with no elements whose leading dim is 0 (2-3 dims, the others
    1-3), replicated on a 1-D mesh of ``world_size`` ranks."""
    shape = (0, *(draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 2)))))
    source = DistributeCase((world_size,), (Replicate(),), shape, "float64", draw(seeds()))
    return OpCase(source, "flatten", ((0, False),))


@takes_world_size
@st.composite
def matmul_empty_batch_cases(draw: st.DrawFn, world_size: int) -> OpCase:
    """matmul of a tensor of 3 or 4 dims with itself (its last two dims transposed) whose dim
    of size 0, a batch dim or a matrix one, is sharded on a 1-D mesh of ``world_size`` ranks
    (the other dims 1-3)."""
    shape = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(3, 4)))]
    dim = draw(st.integers(0, len(shape) - 1))
    shape[dim] = 0
    source = DistributeCase((world_size,), (Shard(dim),), tuple(shape), "float64", draw(seeds()))
    return OpCase(source, "matmul", ((0, False),))


@takes_world_size
@st.composite
def extremum_empty_shard_cases(draw: st.DrawFn, world_size: int) -> OpCase:
    """amax along, or amin over, a dim sharded on a 1-D mesh of ``world_size`` >= 2 ranks
    into fewer pieces than ranks: the trailing ranks hold empty shards."""
    require(world_size >= 2, "world_size", world_size, ">= 2 for a rank to hold nothing")
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[dim] = draw(st.integers(1, world_size - 1))
    source = DistributeCase((world_size,), (Shard(dim),), tuple(shape), "float64", draw(seeds()))
    return OpCase(source, draw(sampled(("amax_dim", "amin"))), ((dim, draw(st.booleans())),))


def _shards_an_empty_dim_of_a_batch(shape: tuple[int, ...], chosen: tuple[Placement, ...]) -> bool:
    """A mesh axis shards a dim of size 0 of a tensor of 3 or more dims, a batch of matrices
    that matmul folds through a view."""
    return len(shape) >= 3 and any(
        isinstance(p, Shard) and shape[p.dim % len(shape)] == 0 for p in chosen
    )


def _fits(op: Op, shape: tuple[int, ...], empty: bool, sharded: bool, empty_batch: bool) -> bool:
    if (op.extremum and empty) or (op.unsharded_only and sharded) or (op.batched and empty_batch):
        return False
    if len(shape) < op.min_ndim or (op.nonempty and 0 in shape):
        return False
    return not (op.nonempty_dim and all(side == 0 for side in shape))


@takes_world_size
@st.composite
def redistribute_cases(
    draw: st.DrawFn,
    world_size: int,
    *,
    reduce_ops: tuple[str, ...] = REDUCE_OPS,
    shardable_ops: frozenset[str] = frozenset(REDUCE_OPS),
    lacks: Lacks = frozenset(),
) -> RedistributeCase:
    """A source and a destination layout for ``redistribute``.

    A destination axis is ``Shard``, ``Replicate`` or the source's own ``Partial``
    (redistributing *into* a new Partial is refused by DTensor, checked by
    ``placements.redistribute.partial_target_rejected``). A ``Partial(op)`` axis becomes
    ``Shard`` (a reduce-scatter with ``op``) only when ``op`` is in ``shardable_ops``.
    """
    built = draw(mesh_cases(world_size, lacks=lacks))
    mesh = built.shape
    shape = draw(shapes(near=max(mesh)))
    dtype = draw(dtypes())
    ops = tuple(op for op in _ops_for(dtype) if op in reduce_ops)
    src = draw(placements(len(mesh), len(shape), reduce_ops=ops))
    choices = [_destinations(p, len(shape), shardable_ops) for p in src]
    dst = [draw(sampled(c)) for c in choices]
    if dst == list(src):  # nothing to move: change the first axis that has another choice
        axis = next((a for a, c in enumerate(choices) if len(c) > 1), None)
        if axis is not None:
            others = tuple(c for c in choices[axis] if c != src[axis])
            dst[axis] = draw(sampled(others))
    return RedistributeCase(mesh, src, tuple(dst), shape, dtype, draw(seeds()), built)


def _destinations(
    source: Placement, tensor_ndim: int, shardable_ops: frozenset[str]
) -> tuple[Placement, ...]:
    choices = _axis_choices(tensor_ndim, None)
    if isinstance(source, Partial):
        choices += (source,)
        if source.reduce_op not in shardable_ops:
            choices = tuple(c for c in choices if not isinstance(c, Shard))
    return choices


@takes_world_size
@st.composite
def partial_target_cases(
    draw: st.DrawFn, world_size: int, *, lacks: Lacks = frozenset()
) -> RedistributeCase:
    """A redistribute whose destination adds a ``Partial`` on an axis the source does not
    hold it on (DTensor must refuse it)."""
    built = draw(mesh_cases(world_size, lacks=lacks))
    mesh = built.shape
    shape = draw(shapes())
    dtype = draw(dtypes())
    src = list(draw(placements(len(mesh), len(shape), reduce_ops=_ops_for(dtype))))
    axis = draw(st.integers(0, len(mesh) - 1))
    src[axis] = draw(sampled(_axis_choices(len(shape), None)))
    held = {p.reduce_op for p in src if isinstance(p, Partial)}
    op = held.pop() if held else draw(sampled(_ops_for(dtype)))
    dst = [*src[:axis], Partial(op), *src[axis + 1 :]]
    seed = draw(seeds())
    return RedistributeCase(mesh, tuple(src), tuple(dst), shape, dtype, seed, built)


@takes_world_size
@st.composite
def extremum_to_shard_cases(
    draw: st.DrawFn, world_size: int, *, lacks: Lacks = frozenset()
) -> RedistributeCase:
    """A ``Partial('max'|'min')`` axis that becomes ``Shard`` (a reduce-scatter with max/min)."""
    built = draw(mesh_cases(world_size, lacks=lacks))
    mesh = built.shape
    shape = draw(shapes(min_ndim=1))
    dtype = draw(dtypes())
    op = draw(sampled(("max", "min")))
    src = list(draw(placements(len(mesh), len(shape), reduce_ops=(op,))))
    axis = draw(st.integers(0, len(mesh) - 1))
    src[axis] = Partial(op)
    dst = [draw(sampled((*_axis_choices(len(shape), None), p))) for p in src]
    dst[axis] = Shard(draw(st.integers(-len(shape), len(shape) - 1)))
    seed = draw(seeds())
    return RedistributeCase(mesh, tuple(src), tuple(dst), shape, dtype, seed, built)


@takes_world_size
@st.composite
def partial_sum_integer_cases(
    draw: st.DrawFn, world_size: int, *, lacks: Lacks = frozenset()
) -> DistributeCase:
    """int64 tensors distributed with at least one ``Partial('sum')`` axis."""
    built = draw(mesh_cases(world_size, lacks=lacks))
    mesh = built.shape
    shape = draw(shapes())
    chosen = list(draw(placements(len(mesh), len(shape), reduce_ops=("sum",))))
    chosen[draw(st.integers(0, len(mesh) - 1))] = Partial("sum")
    seed = draw(seeds())
    return DistributeCase(mesh, tuple(chosen), shape, "int64", seed, 0, built)


@takes_world_size
@st.composite
def uneven_redistribute_cases(
    draw: st.DrawFn, world_size: int, *, lacks: Lacks = frozenset()
) -> RedistributeCase:
    """Shard/Replicate to Shard/Replicate on 1-D and 2-D meshes (built any way), dims drawn
    around the axis sizes so pieces are short, empty or uneven (the collectives pad them)."""
    built = draw(mesh_cases(world_size, max_ndim=2, lacks=lacks))
    mesh = built.shape
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0, 2 * max(mesh) + 1)) for _ in range(ndim))
    dtype = draw(dtypes(("float32", "int64")))
    src = draw(placements(len(mesh), ndim, reduce_ops=()))
    dst = draw(placements(len(mesh), ndim, reduce_ops=()))
    seed = draw(seeds())
    return RedistributeCase(mesh, src, dst, shape, dtype, seed, built)


@takes_world_size
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


_FILLS: tuple[FillValue, ...] = (2, 1.5, True, -3, 0.25, False)


def factory_cases(
    world_size: int, *, factories: Sequence[str] = FACTORIES, lacks: Lacks = frozenset()
) -> st.SearchStrategy[FactoryCase]:
    """A DTensor factory of ``factories`` over a drawn mesh and Shard/Replicate placements
    (dims counted from the front: spec placements.api.shard_dim_from_the_back checks the
    other spelling): its dtype given (float32, float64, int64) or left to torch (full
    infers it from a bool, int or float fill value), ``requires_grad`` drawn where the
    dtype is floating (torch refuses it on integer tensors)."""
    check_int("world_size", world_size)
    check_subset("factories", factories, FACTORIES, non_empty=True)
    return _factory_cases(world_size, tuple(factories), checked_lacks(lacks))


@cache
@st.composite
def _factory_cases(
    draw: st.DrawFn, world_size: int, factories: tuple[str, ...], lacks: Lacks
) -> FactoryCase:
    built = draw(mesh_cases(world_size, lacks=lacks))
    mesh = built.shape
    shape = draw(shapes(near=max(mesh)))
    chosen = normalize(draw(placements(len(mesh), len(shape), reduce_ops=())), len(shape))
    factory = draw(sampled(factories))
    floating_only = factory in ("rand", "randn")
    choices = ("float32", "float64") if floating_only else ("float32", "float64", "int64")
    dtype = draw(sampled((None, *choices)))
    fill = draw(sampled(_FILLS)) if factory == "full" else None
    floating = _floating(dtype, fill)
    requires_grad = draw(st.booleans()) if floating else False
    return FactoryCase(mesh, chosen, shape, factory, dtype, requires_grad, fill, built)


def _floating(dtype: str | None, fill: FillValue | None) -> bool:
    """The factory's result is floating: torch's default dtype, or full's inferred one."""
    if dtype is not None:
        return dtype != "int64"
    return not isinstance(fill, bool | int) or fill is None


@takes_world_size
@st.composite
def from_the_back_cases(
    draw: st.DrawFn, world_size: int, *, lacks: Lacks = frozenset()
) -> DistributeCase:
    """float64 Shard/Replicate placements over a drawn mesh, one axis or more sharding a
    dim counted from the back (``Shard(d - ndim)``)."""
    built = draw(mesh_cases(world_size, lacks=lacks))
    mesh = built.shape
    shape = draw(shapes(min_ndim=1, near=max(mesh)))
    chosen = list(draw(placements(len(mesh), len(shape), reduce_ops=())))
    axis = draw(st.integers(0, len(mesh) - 1))
    chosen[axis] = Shard(draw(st.integers(-len(shape), -1)))
    seed = draw(seeds())
    return DistributeCase(mesh, tuple(chosen), shape, "float64", seed, 0, built)


@takes_world_size
@st.composite
def flattened_cases(draw: st.DrawFn, world_size: int) -> FlattenedCase:
    """A mesh of 2 or more axes over ``world_size`` ranks, some of its axes flattened, and a
    float64 tensor with one dim sharded on every flattened axis (nested: uneven and empty
    pieces where the dim is short), the other axes Replicate or Shard."""
    require(world_size >= 1, "world_size", world_size, ">= 1")
    mesh = draw(sampled(tuple(s for s in factorisations(world_size, 3) if len(s) >= 2)))
    axes = draw(st.lists(sampled(tuple(range(len(mesh)))), min_size=2, unique=True))
    shape = draw(shapes(min_ndim=1, near=max(mesh)))
    chosen = list(draw(placements(len(mesh), len(shape), reduce_ops=())))
    dim = draw(st.integers(0, len(shape) - 1))
    for axis in axes:
        chosen[axis] = Shard(dim)
    source = DistributeCase(mesh, tuple(chosen), shape, "float64", draw(seeds()))
    return FlattenedCase(source, tuple(sorted(axes)))
