"""Device meshes as a strategy: built from a shape, or sliced, flattened or taken from an
axis group of a named parent mesh, every way users build the mesh a DTensor lives on."""

from __future__ import annotations

from functools import cache

from hypothesis import strategies as st

from harness.cases.meshes import MeshCase
from harness.strategies._common import (
    MAX_MESH_NDIM,
    Lacks,
    mesh_shapes,
    mix,
    sampled,
    takes_world_size,
)
from specs.meshes import CONSTRUCTIONS

# Most meshes are built from their shape, the spelling hypothesis shrinks to.
_HOW = mix((3, st.just("shape")), (2, sampled(CONSTRUCTIONS[1:])))


@takes_world_size
@st.composite
def mesh_cases(
    draw: st.DrawFn, world_size: int, *, max_ndim: int = MAX_MESH_NDIM, lacks: Lacks = frozenset()
) -> MeshCase:
    """A mesh built some way from a parent mesh of ``world_size`` ranks and 1-``max_ndim``
    axes: the parent itself, a slice keeping some of its axes, some of its axes flattened
    into one, or the mesh of one of its axis groups (the last three need a parent of 2 axes
    or more); not a construction ``lacks`` names (``World.lacks``: ``mesh.from_group``)."""
    parent = draw(mesh_shapes(world_size, max_ndim=max_ndim))
    how = draw(_HOW) if len(parent) > 1 else "shape"
    if how == "shape":
        return MeshCase(parent)
    axes = draw(_axes(len(parent), how))
    if f"mesh.{how}" in lacks:
        # Drawn all the same and built from its shape: the rest of the case is then the one
        # a World lacking nothing draws from the same choices (runners compare case by case).
        return MeshCase(parent)
    return MeshCase(parent, how, axes)


@cache
def _axes(ndim: int, how: str) -> st.SearchStrategy[tuple[int, ...]]:
    fewest = 2 if how == "flattened" else 1
    most = 1 if how == "from_group" else ndim
    chosen = st.lists(sampled(tuple(range(ndim))), min_size=fewest, max_size=most, unique=True)
    return chosen.map(lambda axes: tuple(sorted(axes)))
