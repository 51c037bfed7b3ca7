"""Reference model of DTensor placements over an N-D device mesh, in numpy.

A placement per mesh axis says how the global array is laid out along that axis:

- ``Shard(dim)``: the array is split along tensor ``dim`` with ``torch.chunk`` semantics
  (``specs.chunking``); mesh coordinate ``i`` on the axis holds the ``i``-th piece.
- ``Replicate()``: every coordinate on the axis holds the whole array.
- ``Partial(reduce_op)``: every coordinate holds a contribution; reducing the contributions
  with ``reduce_op`` (sum, avg, max, min) gives the array.

Placements apply in mesh-axis order: axis 0 lays out the global array, axis 1 lays out each
piece axis 0 produced, and so on, which is how ``distribute_tensor`` nests ``Shard``.
``local_arrays`` maps a global array to the array on every mesh coordinate; ``assemble`` is
its inverse. Mesh coordinates are row-major: rank ``r`` sits at ``np.unravel_index(r, mesh)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import product
from typing import Literal, TypeAlias

import numpy as np

from harness.errors import check_one_of, fail, require
from specs.chunking import shard_offsets, shard_sizes

REDUCE_OPS = ("sum", "avg", "max", "min")
PartialMode = Literal["divide", "distinct"]
Coord: TypeAlias = tuple[int, ...]


@dataclass(frozen=True)
class Shard:
    dim: int


@dataclass(frozen=True)
class Replicate:
    pass


@dataclass(frozen=True)
class Partial:
    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        check_one_of("reduce_op", self.reduce_op, REDUCE_OPS)


Placement: TypeAlias = Shard | Replicate | Partial


def normalize(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    """Placements with negative ``Shard`` dims counted from the end, as DTensor stores them."""
    return tuple(Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in placements)


def validate(mesh_shape: Sequence[int], placements: Sequence[Placement], ndim: int) -> None:
    """Raise ``InvalidArgument`` (a ``ValueError``) unless the placements fit the mesh and a
    tensor of rank ``ndim``."""
    sizes = bool(mesh_shape) and all(isinstance(s, int) and s >= 1 for s in mesh_shape)
    require(sizes, "mesh_shape", tuple(mesh_shape), "a non-empty tuple of ints >= 1")
    if len(placements) != len(mesh_shape):
        expected = f"one entry per mesh axis (mesh_shape={tuple(mesh_shape)!r})"
        fail("placements", tuple(placements), expected)
    for p in placements:
        is_placement = isinstance(p, Shard | Replicate | Partial)
        require(is_placement, "placement", p, "a Shard, Replicate or Partial")
        if isinstance(p, Shard) and not -ndim <= p.dim < ndim:
            fail("placement", p, f"a Shard of a dim in [{-ndim}, {ndim}) (a tensor of rank {ndim})")


def mesh_coords(mesh_shape: Sequence[int]) -> list[Coord]:
    """Every mesh coordinate in rank order (row-major)."""
    return list(product(*(range(s) for s in mesh_shape)))


def coord_of_rank(mesh_shape: Sequence[int], rank: int) -> Coord:
    return tuple(int(i) for i in np.unravel_index(rank, tuple(mesh_shape)))


def shard_pieces(array: np.ndarray, dim: int, k: int) -> list[np.ndarray]:
    """The ``k`` pieces of ``array`` along ``dim``; trailing pieces may be short or empty."""
    n = array.shape[dim]
    starts, sizes = shard_offsets(n, k), shard_sizes(n, k)
    index: list[slice] = [slice(None)] * array.ndim
    pieces = []
    for start, size in zip(starts, sizes, strict=True):
        index[dim] = slice(start, start + size)
        pieces.append(array[tuple(index)])
    return pieces


def reduce(contributions: Sequence[np.ndarray], reduce_op: str) -> np.ndarray:
    check_one_of("reduce_op", reduce_op, REDUCE_OPS)
    stacked = np.stack(contributions)
    if reduce_op == "sum":
        return np.asarray(stacked.sum(axis=0))
    if reduce_op == "avg":
        return np.asarray(stacked.sum(axis=0) / len(contributions))
    if reduce_op == "max":
        return np.asarray(stacked.max(axis=0))
    return np.asarray(stacked.min(axis=0))


def divide_split(value: np.ndarray, m: int, reduce_op: str) -> list[np.ndarray]:
    """``distribute_tensor``'s split: a sum is divided evenly, avg/max/min are copied."""
    if reduce_op == "sum":
        return [value / m for _ in range(m)]
    return [value.copy() for _ in range(m)]


def distinct_split(
    value: np.ndarray, m: int, reduce_op: str, rng: np.random.Generator
) -> list[np.ndarray]:
    """``m`` different contributions that reduce to ``value`` exactly when it is integer-valued.

    Distinct contributions catch a reduction that reads one rank, or the wrong rank, where
    identical copies would not.
    """
    zero = np.zeros_like(value)
    if reduce_op in ("sum", "avg"):
        noise = [rng.integers(-2, 3, size=value.shape).astype(value.dtype) for _ in range(m - 1)]
        base = zero if reduce_op == "sum" else value
        return [value - sum(noise, zero), *(base + n for n in noise)]
    holder = rng.integers(0, m, size=value.shape)
    sign = -1 if reduce_op == "max" else 1
    gaps = [rng.integers(0, 3, size=value.shape).astype(value.dtype) for _ in range(m)]
    return [np.where(holder == j, value, value + sign * gaps[j]) for j in range(m)]


def _axis_pieces(
    array: np.ndarray,
    placement: Placement,
    m: int,
    partial: PartialMode,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    if isinstance(placement, Shard):
        return shard_pieces(array, placement.dim % array.ndim, m)
    if isinstance(placement, Replicate):
        return [array] * m
    if partial == "divide":
        return divide_split(array, m, placement.reduce_op)
    return distinct_split(array, m, placement.reduce_op, rng)


def local_arrays(
    global_array: np.ndarray,
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    *,
    partial: PartialMode = "divide",
    seed: int = 0,
) -> dict[Coord, np.ndarray]:
    """The local array on every mesh coordinate.

    ``partial`` picks the contributions for ``Partial`` axes: ``"divide"`` is what
    ``distribute_tensor`` does, ``"distinct"`` draws different integer contributions from
    ``seed`` (exact for integer-valued arrays).
    """
    validate(mesh_shape, placements, global_array.ndim)
    check_one_of("partial", partial, ("divide", "distinct"))
    rng = np.random.default_rng(seed)
    layout: dict[Coord, np.ndarray] = {(): global_array}
    for placement, m in zip(placements, mesh_shape, strict=True):
        layout = {
            (*prefix, i): piece
            for prefix, array in layout.items()
            for i, piece in enumerate(_axis_pieces(array, placement, m, partial, rng))
        }
    return layout


def _groups(layout: Mapping[Coord, np.ndarray], m: int) -> Iterator[tuple[Coord, list[np.ndarray]]]:
    prefixes = sorted({coord[:-1] for coord in layout})
    for prefix in prefixes:
        yield prefix, [layout[(*prefix, i)] for i in range(m)]


def assemble(
    layout: Mapping[Coord, np.ndarray],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
) -> np.ndarray:
    """The global array from the local array on every coordinate (inverse of ``local_arrays``).

    Raises ``InvalidArgument`` (a ``ValueError``) when coordinates are missing or replicas
    disagree.
    """
    expected = set(mesh_coords(mesh_shape))
    if set(layout) != expected:
        fail("sorted(layout)", sorted(layout), f"the mesh's coords {sorted(expected)!r}")
    current: dict[Coord, np.ndarray] = dict(layout)
    for axis in reversed(range(len(mesh_shape))):
        placement, merged = placements[axis], {}
        for prefix, pieces in _groups(current, mesh_shape[axis]):
            merged[prefix] = _merge(pieces, placement, prefix)
        current = merged
    return current[()]


def _merge(pieces: list[np.ndarray], placement: Placement, prefix: Coord) -> np.ndarray:
    if isinstance(placement, Shard):
        return np.concatenate(pieces, axis=placement.dim % pieces[0].ndim)
    if isinstance(placement, Replicate):
        for i, piece in enumerate(pieces[1:], start=1):
            if piece.shape != pieces[0].shape or not np.array_equal(piece, pieces[0]):
                first = (*prefix, 0)
                fail(f"layout[{(*prefix, i)}]", piece, f"layout[{first}] (replicas differ)")
        return pieces[0]
    return reduce(pieces, placement.reduce_op)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of a contiguous tensor (a size-0 dim counts as 1, as in torch)."""
    stride, step = [], 1
    for size in reversed(tuple(shape)):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def local_boxes(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> dict[Coord, tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(local shape, global offset)`` on every mesh coordinate: where each local array
    sits in the global one. Shards nest in mesh-axis order, so a dim sharded on two axes
    starts at its first piece's offset plus the second piece's offset within it. An empty
    piece's offset is not meaningful (torch reports the dim's global size)."""
    validate(mesh_shape, placements, len(shape))
    boxes: dict[Coord, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for coord in mesh_coords(mesh_shape):
        sizes, offsets = list(shape), [0] * len(shape)
        for placement, k, i in zip(placements, mesh_shape, coord, strict=True):
            if isinstance(placement, Shard):
                dim = placement.dim % len(shape)
                offsets[dim] += shard_offsets(sizes[dim], k)[i]
                sizes[dim] = shard_sizes(sizes[dim], k)[i]
        boxes[coord] = (tuple(sizes), tuple(offsets))
    return boxes
