"""Reference model of device meshes built other ways than from a shape: a named mesh's
slices (``mesh["a0", "a2"]``), its flattened submeshes (``mesh["a0", "a1"]._flatten()``)
and a mesh made from one of its axis groups (``DeviceMesh.from_group``).

A parent mesh of ``parent`` shape holds ranks ``0..prod(parent)-1`` row-major. Keeping some
of its ``axes`` splits the world into submeshes, one per coordinate of the other axes; a
rank's submesh is the one holding it, its ranks in the parent's order. Flattening merges the
kept axes into one, row-major (the outer axis slowest). A rank's coordinate is where it sits
in its own submesh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from harness.errors import require
from specs.placements import Coord

CONSTRUCTIONS = ("shape", "sliced", "flattened", "from_group")


def submesh_ranks(
    parent: Sequence[int], axes: Sequence[int], rank: int, *, flatten: bool = False
) -> np.ndarray:
    """The ranks of the submesh of ``parent`` keeping ``axes`` that holds ``rank``: an array
    of the kept axes' sizes (one axis of their product when ``flatten``)."""
    parent = tuple(parent)
    require(0 <= rank < math.prod(parent), "rank", rank, f"a rank of a {parent} mesh")
    grid = np.arange(math.prod(parent)).reshape(parent)
    coord = np.unravel_index(rank, parent)
    index = tuple(slice(None) if axis in axes else int(c) for axis, c in enumerate(coord))
    ranks = grid[index]
    return ranks.reshape(-1) if flatten else ranks


def coord_in(ranks: np.ndarray, rank: int) -> Coord:
    """Where ``rank`` sits in the mesh ``ranks``."""
    found = np.argwhere(ranks == rank)
    require(len(found) == 1, "rank", rank, f"a rank of the mesh {ranks.tolist()}")
    return tuple(int(c) for c in found[0])
