"""Cases of the op-conformance suite: an OpInfo sample, a mesh, a layout per tensor."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

from hypothesis import strategies as st

from harness.cases.ops import OpInfoCase, TensorArgument
from harness.errors import require
from harness.strategies._common import Lacks, mix, sampled, takes_world_size
from harness.strategies.meshes import mesh_cases
from specs.placements import REDUCE_OPS, Partial, Placement, Replicate, Shard

SampleArguments = tuple[tuple[TensorArgument, ...], ...]
"""Per sample of an OpInfo in one dtype, its tensor arguments."""


def usable_samples(arguments: SampleArguments) -> tuple[int, ...]:
    """The samples whose tensors can all be laid out as DTensors (dense; one at least)."""
    return tuple(
        index
        for index, tensors in enumerate(arguments)
        if tensors and all(t.strided for t in tensors)
    )


@takes_world_size
@st.composite
def opinfo_cases(
    draw: st.DrawFn,
    world_size: int,
    *,
    op: str,
    dtypes: tuple[str, ...],
    arguments: Callable[[str], SampleArguments],
    differentiable: tuple[str, ...] = (),
    lacks: Lacks = frozenset(),
) -> OpInfoCase:
    """A sample of ``op`` in one of ``dtypes`` (``arguments(dtype)``: its samples' tensor
    arguments, asked for the drawn dtype only: making samples takes time), on a mesh built
    some way of ``world_size`` ranks, each tensor argument with placements of its own:
    Replicate, Shard of any dim (spelled from the front or the back), or, for finite
    floating values, Partial of any reduce op; backward too when the dtype is one of
    ``differentiable``. The first dtype must have a usable sample (``usable_samples``); a
    later one without any falls back to it."""
    require(bool(dtypes), "dtypes", dtypes, "at least one dtype")
    dtype = draw(sampled(dtypes))
    indices = usable_samples(arguments(dtype))
    if not indices:
        dtype = dtypes[0]
        indices = usable_samples(arguments(dtype))
    require(bool(indices), "arguments", op, f"an op with a {dtype} sample DTensor can take")
    index = draw(sampled(indices))
    tensors = arguments(dtype)[index]
    mesh = draw(mesh_cases(world_size, lacks=lacks))
    layouts = tuple(
        draw(_layouts(len(mesh.shape), len(a.shape), a.may_be_partial)) for a in tensors
    )
    backward = dtype in differentiable
    return OpInfoCase(
        op=op,
        dtype=dtype,
        sample=index,
        mesh_shape=mesh.shape,
        placements=layouts,
        arguments=tensors,
        backward=backward,
        construction=mesh,
    )


@cache
def _layouts(
    mesh_ndim: int, tensor_ndim: int, may_be_partial: bool
) -> st.SearchStrategy[tuple[Placement, ...]]:
    """Placements of one tensor: per mesh axis Replicate, a Shard of any dim (from the front
    or the back) or, where allowed, the Partial of the tensor's reduce op. A rule's Partial
    inputs are its least exercised (and most often wrong) part: a Partial axis is drawn as
    often as a sharded one."""
    shards = [Shard(d) for d in range(tensor_ndim)] + [
        Shard(d - tensor_ndim) for d in range(tensor_ndim)
    ]
    ops = REDUCE_OPS if may_be_partial else ()
    return (sampled(ops) if ops else st.none()).flatmap(
        lambda op: st.tuples(*[_axis(tuple(shards), op)] * mesh_ndim)
    )


@cache
def _axis(shards: tuple[Placement, ...], op: str | None) -> st.SearchStrategy[Placement]:
    choices: list[tuple[int, st.SearchStrategy[Any]]] = [(1, st.just(Replicate()))]
    if shards:
        choices.append((2, sampled(shards)))
    if op is not None:
        choices.append((2, st.just(Partial(op))))
    return mix(*choices)
