"""Cases of the DCP layout property: named DTensors saved with ``dcp.save`` in one layout on
N ranks and loaded with ``dcp.load`` into DTensors of another layout on M ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from harness.cases.placements import integer_array
from harness.errors import check_int, check_one_of, require
from specs.placements import Coord, Shard, coord_of_rank
from specs.strided import LayoutPlacement, StridedShard, held_indices, local_array, validate_layout

DCP_DTYPES = ("float64", "float32", "int64")
SENTINEL = -100
"""What every element of a destination DTensor holds before the load: no saved value is
one (they lie in [-64, 64]), so an element the load leaves alone shows."""


def spell(placement: LayoutPlacement) -> str:
    """A placement as torch spells it."""
    if isinstance(placement, StridedShard):
        return placement.torch_repr()
    if isinstance(placement, Shard):
        return f"Shard(dim={placement.dim})"
    return "Replicate()"


def viewed(placement: LayoutPlacement) -> LayoutPlacement | str:
    """A placement as ``harness.torchkit.dtensor.view_of`` reports it: ``Shard`` and
    ``Replicate`` as the model's, any other kind as torch's repr."""
    return placement.torch_repr() if isinstance(placement, StridedShard) else placement


@dataclass(frozen=True)
class Layout:
    """A DTensor layout: ``placements`` over a mesh of ``mesh_shape`` (row-major ranks)."""

    mesh_shape: tuple[int, ...]
    placements: tuple[LayoutPlacement, ...]

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    def coord_of(self, rank: int) -> Coord:
        return coord_of_rank(self.mesh_shape, rank)

    def call(self) -> str:
        placements = ", ".join(spell(p) for p in self.placements)
        comma = "," if len(self.placements) == 1 else ""
        return f"mesh {self.mesh_shape}, ({placements}{comma})"


@dataclass(frozen=True)
class SavedTensor:
    """One entry of the state dict: a DTensor of ``shape`` and ``dtype`` with seeded integer
    values, saved laid out by ``save`` and loaded into a DTensor laid out by ``load``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    seed: int
    save: Layout
    load: Layout

    def __post_init__(self) -> None:
        check_one_of("dtype", self.dtype, DCP_DTYPES)
        require(bool(self.name), "name", self.name, "a non-empty state-dict key")
        for layout in (self.save, self.load):
            validate_layout(self.shape, layout.mesh_shape, layout.placements)

    def global_array(self) -> np.ndarray:
        return integer_array(self.shape, self.seed)

    def local_of(self, layout: Layout, rank: int) -> np.ndarray:
        """What ``rank`` holds of the global array laid out by ``layout``."""
        return local_array(
            self.global_array(), layout.mesh_shape, layout.placements, layout.coord_of(rank)
        )

    def local_shape(self, layout: Layout, rank: int) -> tuple[int, ...]:
        held = held_indices(self.shape, layout.mesh_shape, layout.placements, layout.coord_of(rank))
        return tuple(len(ix) for ix in held)

    def call(self) -> str:
        layouts = f"saved on {self.save.call()} -> loaded on {self.load.call()}"
        return f"{self.name!r}: {self.dtype}{list(self.shape)} {layouts}"


@dataclass(frozen=True)
class DcpLayoutCase:
    """``dcp.save`` of ``tensors`` (each a DTensor laid out by its save layout) on
    ``save_size`` ranks, then ``dcp.load`` into DTensors of each one's load layout, filled
    with ``SENTINEL``, on ``load_size`` ranks."""

    save_size: int
    load_size: int
    tensors: tuple[SavedTensor, ...]

    def __post_init__(self) -> None:
        check_int("save_size", self.save_size)
        check_int("load_size", self.load_size)
        require(bool(self.tensors), "tensors", self.tensors, "one or more SavedTensor")
        names = [t.name for t in self.tensors]
        require(len(set(names)) == len(names), "tensors", names, "tensors of distinct names")
        for t in self.tensors:
            sizes = (t.save.world_size, t.load.world_size)
            expected = f"meshes of {self.save_size} and {self.load_size} ranks"
            require(sizes == (self.save_size, self.load_size), f"{t.name} meshes", sizes, expected)

    def call(self) -> str:
        entries = "; ".join(t.call() for t in self.tensors)
        return (
            f"dcp.save on {self.save_size} rank(s), dcp.load on {self.load_size} rank(s) "
            f"into DTensors filled with {SENTINEL}: {{{entries}}}"
        )
