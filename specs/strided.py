"""Reference model of DTensor layouts with ``_StridedShard``, in numpy: which global indices
each rank holds along every dim.

``specs.placements`` lays out a global array axis by axis with ``Shard`` and ``Replicate``;
this model adds ``StridedShard(dim, split_factor)``, DTensor's ``_StridedShard``, and follows
the global index of every element, as ``compute_local_shape_and_global_offset`` does:

- ``Shard(dim)`` on a mesh axis of ``m`` ranks: coordinate ``c`` keeps the ``c``-th of the
  ``m`` ``torch.chunk`` pieces of the indices held so far along ``dim``.
- ``StridedShard(dim, sf)``: the indices held so far are chunked into ``sf`` pieces, each
  of those into ``m``; coordinate ``c`` keeps the ``c``-th piece of every one of them,
  concatenated in order. It stands for sharding "right to left": FSDP over TP reports
  ``(StridedShard(0, sf=tp), Shard(0))`` on a ``(dp, tp)`` mesh, the TP pieces sharded again
  over dp, and ``sf`` is the number of ranks on the later axes that shard the same dim.
- ``Replicate()``: every coordinate keeps what it holds.

Axes apply in mesh order. A rank's local array is the global one at the indices it holds
(``np.ix_``); its piece is a box of the global array when every dim's indices are a run of
consecutive integers (``is_box``), which is what a checkpoint's chunk metadata can describe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np

from harness.errors import check_int, fail, require
from specs.chunking import shard_offsets, shard_sizes
from specs.placements import Coord, Replicate, Shard, mesh_coords


@dataclass(frozen=True)
class StridedShard:
    """DTensor's ``_StridedShard(dim, split_factor=split_factor)``."""

    dim: int
    split_factor: int

    def __post_init__(self) -> None:
        check_int("dim", self.dim, 0)
        check_int("split_factor", self.split_factor)

    def torch_repr(self) -> str:
        """How torch 2.13 spells it (``repr(_StridedShard(0, split_factor=2))``)."""
        return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"


LayoutPlacement: TypeAlias = Shard | Replicate | StridedShard


def validate_layout(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[LayoutPlacement]
) -> None:
    """Raise ``InvalidArgument`` unless ``placements`` (one per mesh axis, no ``Partial``)
    fit ``mesh_shape`` and a tensor of ``shape``; shard dims are counted from the front."""
    sizes = bool(mesh_shape) and all(isinstance(s, int) and s >= 1 for s in mesh_shape)
    require(sizes, "mesh_shape", tuple(mesh_shape), "a non-empty tuple of ints >= 1")
    require(
        all(isinstance(n, int) and n >= 0 for n in shape),
        "shape",
        tuple(shape),
        "a tuple of ints >= 0",
    )
    if len(placements) != len(mesh_shape):
        fail("placements", tuple(placements), f"one per mesh axis of {tuple(mesh_shape)!r}")
    for p in placements:
        kinds = isinstance(p, Shard | Replicate | StridedShard)
        require(kinds, "placement", p, "a Shard, Replicate or StridedShard")
        if isinstance(p, Shard | StridedShard) and not 0 <= p.dim < len(shape):
            fail("placement", p, f"a shard of a dim in [0, {len(shape)})")


def _piece(indices: np.ndarray, k: int, i: int) -> np.ndarray:
    """The ``i``-th of the ``k`` ``torch.chunk`` pieces of ``indices`` (maybe empty)."""
    start, size = shard_offsets(len(indices), k)[i], shard_sizes(len(indices), k)[i]
    return indices[start : start + size]


def held_indices(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[LayoutPlacement],
    coord: Coord,
) -> tuple[np.ndarray, ...]:
    """The global indices along every dim that mesh coordinate ``coord`` holds, in order."""
    validate_layout(shape, mesh_shape, placements)
    require(coord in mesh_coords(mesh_shape), "coord", coord, f"a coordinate of {mesh_shape}")
    held = [np.arange(n) for n in shape]
    for placement, m, c in zip(placements, mesh_shape, coord, strict=True):
        if isinstance(placement, Shard):
            held[placement.dim] = _piece(held[placement.dim], m, c)
        elif isinstance(placement, StridedShard):
            indices = held[placement.dim]
            sf = placement.split_factor
            parts = [_piece(_piece(indices, sf, j), m, c) for j in range(sf)]
            held[placement.dim] = np.concatenate(parts)
    return tuple(held)


def local_array(
    global_array: np.ndarray,
    mesh_shape: Sequence[int],
    placements: Sequence[LayoutPlacement],
    coord: Coord,
) -> np.ndarray:
    """What mesh coordinate ``coord`` holds of ``global_array``."""
    held = held_indices(global_array.shape, mesh_shape, placements, coord)
    if not held:
        return global_array.copy()
    return np.asarray(global_array[np.ix_(*held)])


def is_box(held: Sequence[np.ndarray]) -> bool:
    """Every dim's indices are consecutive: the piece is one box of the global array."""
    return all(len(ix) < 2 or bool((np.diff(ix) == 1).all()) for ix in held)


def boxes_only(
    shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[LayoutPlacement]
) -> bool:
    """Whether every coordinate's piece is a box of the global array."""
    return all(
        is_box(held_indices(shape, mesh_shape, placements, coord))
        for coord in mesh_coords(mesh_shape)
    )
