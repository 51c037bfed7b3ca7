"""Strategies for the DCP layout property: DTensor layouts over 1-, 2- and 3-D meshes (Shard,
Replicate, one dim sharded on two axes, FSDP-over-TP ``_StridedShard``), and cases of named
DTensors saved in one layout and loaded into another, maybe at another world size."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache

from hypothesis import strategies as st

from harness.cases.dcp_layouts import DCP_DTYPES, DcpLayoutCase, Layout, SavedTensor
from harness.errors import check_int, check_subset, require
from harness.strategies._common import dtypes, mesh_shapes, sampled, seeds, shapes
from specs.placements import Replicate, Shard
from specs.strided import LayoutPlacement, StridedShard

MAX_TENSORS = 3


def dcp_layouts(world_size: int, ndim: int) -> st.SearchStrategy[Layout]:
    """A layout of a tensor of rank ``ndim`` over ``world_size`` ranks: a mesh of 1-3 axes
    (``mesh_shapes``) and a placement per axis, Replicate or Shard of any dim. On a mesh of
    two or more axes, one draw in two shards one dim on two axes (nested: pieces of pieces,
    uneven and empty ones), and one such draw in two makes the first of those axes
    ``StridedShard(dim, sf)``, ``sf`` the ranks of the later axes sharding that dim, as
    FSDP over TP reports its parameters (``(_StridedShard(0, sf=tp), Shard(0))``)."""
    check_int("world_size", world_size)
    check_int("ndim", ndim, 0)
    return _layouts(world_size, ndim)


@cache
@st.composite
def _layouts(draw: st.DrawFn, world_size: int, ndim: int) -> Layout:
    mesh = draw(mesh_shapes(world_size))
    axis = sampled((Replicate(), *(Shard(d) for d in range(ndim))))
    placements: list[LayoutPlacement] = [draw(axis) for _ in mesh]
    if ndim and len(mesh) >= 2 and draw(st.booleans()):
        first, second = sorted(draw(st.permutations(range(len(mesh))))[:2])
        dim = draw(st.integers(0, ndim - 1))
        placements[first] = placements[second] = Shard(dim)
        if draw(st.booleans()):
            placements[first] = _strided(tuple(mesh), placements, first)
    return Layout(tuple(mesh), tuple(placements))


def _strided(
    mesh: tuple[int, ...], placements: Sequence[LayoutPlacement], axis: int
) -> StridedShard:
    """``StridedShard`` of the dim ``placements[axis]`` shards, split by the ranks of the
    later axes that shard it too (FSDP over TP: the TP degree)."""
    shard = placements[axis]
    assert isinstance(shard, Shard), "only a Shard axis becomes strided"
    later = [m for m, p in zip(mesh[axis + 1 :], placements[axis + 1 :], strict=True) if p == shard]
    return StridedShard(shard.dim, math.prod(later))


def dcp_layout_cases(
    world_size: int,
    load_sizes: Sequence[int],
    *,
    max_tensors: int = MAX_TENSORS,
    allowed_dtypes: Sequence[str] = DCP_DTYPES,
) -> st.SearchStrategy[DcpLayoutCase]:
    """1..``max_tensors`` named DTensors (integer values in ``allowed_dtypes``; 0-3 dims of
    0-17, empty and uneven ones included) saved on ``world_size`` ranks, each in its own
    ``dcp_layouts`` layout, and loaded on ``m`` ranks drawn from ``load_sizes`` (``world_size``
    first among them when it is one) into another drawn layout."""
    check_int("world_size", world_size)
    require(len(load_sizes) > 0, "load_sizes", tuple(load_sizes), "a non-empty sequence")
    for size in load_sizes:
        check_int("load_sizes[...]", size)
    check_int("max_tensors", max_tensors)
    check_subset("allowed_dtypes", allowed_dtypes, DCP_DTYPES, non_empty=True)
    own = (world_size,) if world_size in load_sizes else ()
    sizes = (*own, *sorted(set(load_sizes) - {world_size}))
    return _cases(world_size, sizes, max_tensors, tuple(allowed_dtypes))


@cache
@st.composite
def _cases(
    draw: st.DrawFn,
    world_size: int,
    load_sizes: tuple[int, ...],
    max_tensors: int,
    allowed_dtypes: tuple[str, ...],
) -> DcpLayoutCase:
    load_size = draw(sampled(load_sizes))
    count = draw(st.integers(1, max_tensors))
    # Sides near the larger world's axes: uneven pieces and empty ones on both sides.
    shape = shapes(near=max(world_size, load_size))
    tensors = []
    for index in range(count):
        drawn = draw(shape)
        tensors.append(
            SavedTensor(
                name=f"t{index}",
                shape=drawn,
                dtype=draw(dtypes(allowed_dtypes)),
                seed=draw(seeds()),
                save=draw(dcp_layouts(world_size, len(drawn))),
                load=draw(dcp_layouts(load_size, len(drawn))),
            )
        )
    return DcpLayoutCase(world_size, load_size, tuple(tensors))
