"""How a case's device mesh is built: from a shape, or as a slice, a flattened submesh or
an axis group of a named parent mesh (``specs.meshes`` models each)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.errors import check_one_of, require
from specs.meshes import CONSTRUCTIONS, coord_in, submesh_ranks
from specs.placements import Coord

AXIS_NAMES = ("a0", "a1", "a2")
# Flattening leaves state on the root mesh that every slice of it shares: torch 2.13 then
# gathers unevenly nested shards wrongly on them (spec placements.mesh.flatten_keeps_gather
# checks that on its own), so flattened meshes come from a root of their own.
FLATTENED_NAMES = ("f0", "f1", "f2")


@dataclass(frozen=True)
class MeshCase:
    """A device mesh: ``init_device_mesh(parent)`` itself (``how="shape"``), or of the
    parent mesh, named ``a0, a1, ...``, the slice keeping ``axes`` (``"sliced"``), those
    axes flattened into one (``"flattened"``), or ``DeviceMesh.from_group`` of the group of
    its one axis in ``axes`` (``"from_group"``)."""

    parent: tuple[int, ...]
    how: str = "shape"
    axes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_one_of("how", self.how, CONSTRUCTIONS)
        ndim = len(self.parent)
        require(1 <= ndim <= len(AXIS_NAMES), "parent", self.parent, "a mesh shape of 1-3 axes")
        if self.how == "shape":
            require(not self.axes, "axes", self.axes, "() for a mesh built from its shape")
            return
        ascending = list(self.axes) == sorted(set(self.axes)) and set(self.axes) <= set(range(ndim))
        require(ascending, "axes", self.axes, f"ascending distinct axes of a {ndim}-D mesh")
        fewest = {"sliced": 1, "flattened": 2, "from_group": 1}[self.how]
        most = 1 if self.how == "from_group" else ndim
        require(fewest <= len(self.axes) <= most, "axes", self.axes, f"{fewest}-{most} axes")

    @property
    def kept(self) -> tuple[int, ...]:
        return self.axes if self.axes else tuple(range(len(self.parent)))

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the mesh a DTensor is laid out on."""
        sizes = tuple(self.parent[axis] for axis in self.kept)
        return (math.prod(sizes),) if self.how == "flattened" else sizes

    @property
    def names(self) -> tuple[str, ...] | None:
        """The parent's axis names (None: a mesh from a shape has none)."""
        if self.how == "shape":
            return None
        names = FLATTENED_NAMES if self.how == "flattened" else AXIS_NAMES
        return names[: len(self.parent)]

    def ranks_of(self, rank: int) -> list[int]:
        """The global ranks of ``rank``'s mesh, flattened row-major."""
        flatten = self.how == "flattened"
        return submesh_ranks(self.parent, self.kept, rank, flatten=flatten).reshape(-1).tolist()

    def coord_of(self, rank: int) -> Coord:
        flatten = self.how == "flattened"
        return coord_in(submesh_ranks(self.parent, self.kept, rank, flatten=flatten), rank)

    def call(self) -> str:
        if self.how == "shape":
            return f"init_device_mesh({self.parent})"
        assert self.names is not None
        named = f"init_device_mesh({self.parent}, mesh_dim_names={self.names})"
        kept = ", ".join(repr(self.names[axis]) for axis in self.axes)
        if self.how == "sliced":
            return f"{named}[{kept}]"
        if self.how == "flattened":
            return f"{named}[{kept}]._flatten()"
        return f"DeviceMesh.from_group({named}.get_group({kept}))"
