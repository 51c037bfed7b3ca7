"""The per-rank context a check function receives as its first argument."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harness.cases.meshes import MeshCase
from harness.errors import invalid

if TYPE_CHECKING:  # the public face exports RankContext; importing it must not import torch
    import torch
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class RankContext:
    """Who this rank is and the meshes it has built.

    A check never knows whether ranks are threads or processes; it asks the context for its
    rank, its device and its meshes. Meshes are cached per rank for the World's lifetime:
    building one creates process groups, which costs more than most checks.
    """

    rank: int
    world_size: int
    device: torch.device
    runner: str
    _meshes: dict[tuple[tuple[int, ...], tuple[str, ...] | None], DeviceMesh] = field(
        default_factory=dict, repr=False
    )
    _built: dict[MeshCase, DeviceMesh] = field(default_factory=dict, repr=False)

    def forget_meshes(self) -> None:
        """Drop cached meshes: their process groups were destroyed."""
        self._meshes.clear()
        self._built.clear()

    def mesh(self, shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> DeviceMesh:
        """The device mesh of ``shape`` over all ranks (row-major), built once per World."""
        shape = tuple(shape)
        if not shape or math.prod(shape) != self.world_size:
            raise invalid(
                "shape",
                shape,
                f"a non-empty mesh shape whose product is the world size {self.world_size}",
            )
        if names is not None and len(names) != len(shape):
            raise invalid("names", names, f"a name for each of the {len(shape)} mesh axes")
        key = (shape, names)
        if key not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            self._meshes[key] = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        return self._meshes[key]

    def mesh_of(self, case: MeshCase) -> DeviceMesh:
        """The mesh ``case`` describes, built once per World: from its shape, or sliced,
        flattened or taken from an axis group of its named parent."""
        if case.how == "shape":
            return self.mesh(case.parent)
        if case not in self._built:
            self._built[case] = _build(self.mesh(case.parent, case.names), case, self.device.type)
        return self._built[case]


def _build(parent: DeviceMesh, case: MeshCase, device_type: str) -> DeviceMesh:
    assert case.names is not None, "a named parent for every construction but 'shape'"
    kept = tuple(case.names[axis] for axis in case.axes)
    if case.how == "from_group":
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(parent.get_group(kept[0]), device_type)
    sliced = parent[kept]
    return sliced._flatten("_".join(kept)) if case.how == "flattened" else sliced
