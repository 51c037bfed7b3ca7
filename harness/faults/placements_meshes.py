"""Faults in DeviceMesh: per-dim queries, meshes built by slicing, flattening or from a process
group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._origin import blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import forcing_argument
from harness.faults.held_out import DTENSOR_DEPTH, FIRST

_MESH = "torch.distributed.device_mesh"


def _slice_groups_by_position(original: Callable[..., Any]) -> Callable[..., Any]:
    def _create_sub_mesh(self: Any, layout: Any, submesh_dim_names: tuple[str, ...]) -> Any:
        submesh = original(self, layout, submesh_dim_names)
        names = tuple(self._mesh_dim_names or ())
        groups = list(getattr(self, "_dim_group_names", ()))
        if groups and all(name in names for name in submesh_dim_names):
            # The i-th sliced dim gets the parent's i-th group, not the group of its name.
            submesh._dim_group_names = groups[: len(submesh_dim_names)]
        return submesh

    return _create_sub_mesh


def _first_group_of_slice(original: Callable[..., Any]) -> Callable[..., Any]:
    def _get_mesh_tensor_from_full_mesh(full_mesh: Any, current_rank: int | None = None) -> Any:
        return full_mesh[0]

    return _get_mesh_tensor_from_full_mesh


def _flatten_innermost_first(original: Callable[..., Any]) -> Callable[..., Any]:
    def _create_flatten_mesh(self: Any, mesh_dim_name: str, backend_override: Any = None) -> Any:
        from torch.distributed._mesh_layout import _MeshLayout

        layout = self._layout
        override = (None, None) if backend_override is None else backend_override
        if len(layout) < 2:
            return original(self, mesh_dim_name, override)
        self._layout = _MeshLayout([layout[i] for i in reversed(range(len(layout)))])
        try:
            return original(self, mesh_dim_name, override)
        finally:
            self._layout = layout

    return _create_flatten_mesh


def _from_group_local_ranks(original: Callable[..., Any]) -> Callable[..., Any]:
    def from_group(
        group: Any, device_type: str, mesh: Any = None, *, mesh_dim_names: Any = None
    ) -> Any:
        import torch
        from torch.distributed import ProcessGroup
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(group, ProcessGroup):
            return original(group, device_type, mesh, mesh_dim_names=mesh_dim_names)
        # Ranks 0..n-1 of the group, where global ranks were meant.
        local_ranks = torch.arange(group.size(), dtype=torch.int)
        device_mesh = DeviceMesh(
            device_type, local_ranks, mesh_dim_names=mesh_dim_names, _init_backend=False
        )
        device_mesh._dim_group_names = [group.group_name]
        device_mesh._pg_registry[group.group_name] = group
        return device_mesh

    return from_group


FAULTS: tuple[Fault, ...] = (
    # https://github.com/pytorch/pytorch/pull/164473: DeviceMesh.get_local_rank ignored its
    # mesh_dim argument on meshes with more than one dim (it answered for the first dim).
    Fault(
        id="dtensor.mesh_local_rank_ignores_dim",
        area="placements",
        bug_class="per-dim mesh query answered for the wrong mesh dim",
        summary="DeviceMesh.get_local_rank(mesh_dim) returns the local rank on mesh dim 0; "
        "on CPU, Shard(i) -> Shard(j) on an inner mesh dim then keeps another rank's chunk",
        patches=(Patch(f"{_MESH}:DeviceMesh.get_local_rank", forcing_argument("mesh_dim", 0)),),
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/pull/164473", survived_before=False
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/127465 and PR #132310 (nD and non-contiguous
    # slicing: each sliced name must take the process group of *its* dim in the parent, found
    # by name; the bookkeeping was rewritten for non-contiguous slices), bug class: the
    # slice's dim groups looked up by position among the sliced names.
    Fault(
        id="placements.mesh_slice_groups_by_position",
        area="placements",
        bug_class="a sliced submesh bound to the wrong mesh dim's process group",
        summary="mesh[names] gives the i-th sliced dim the parent's i-th process group: on a "
        "('dp', 'tp') mesh, mesh['tp'] keeps tp's ranks and coordinates but runs its "
        "collectives on the dp group",
        patches=(Patch(f"{_MESH}:DeviceMesh._create_sub_mesh", _slice_groups_by_position),),
        origin=blind(
            DTENSOR_DEPTH, "https://github.com/pytorch/pytorch/pull/127465", survived_before=False
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/127465 (a slice must be the submesh that
    # contains the current rank: `if cur_rank in mesh_nd: res_submesh = submesh`) and PR
    # #118614 (ranks outside a submesh); bug class: every rank given the first submesh.
    Fault(
        id="placements.mesh_slice_first_submesh",
        area="placements",
        bug_class="a sliced submesh taking another rank group's ranks and coordinates",
        summary="a sliced (or flattened) mesh's rank tensor is its first group on every rank: "
        "on a 2x2 mesh, mesh['tp'] is [0, 1] on ranks 2 and 3 too, whose get_coordinate() is "
        "then None (DTensors there hold empty local tensors)",
        patches=(
            Patch(f"{_MESH}:DeviceMesh._get_mesh_tensor_from_full_mesh", _first_group_of_slice),
        ),
        origin=blind(
            DTENSOR_DEPTH, "https://github.com/pytorch/pytorch/pull/127465", survived_before=False
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/165542 ("Fix layout calculation when flattening
    # non-contiguous dims") and the sorted-strides flatten layout reviewed in PR #160429:
    # _flatten's rank order must follow the mesh's row-major order (outer dim slowest).
    Fault(
        id="placements.mesh_flatten_innermost_first",
        area="placements",
        bug_class="a flattened mesh enumerating its ranks in the wrong order",
        summary="mesh[...]._flatten() orders ranks innermost dim first: a ('dp', 'tp') 2x2 "
        "mesh flattens to [0, 2, 1, 3], so flat coordinates disagree with the row-major "
        "order and with the process group's rank order",
        patches=(Patch(f"{_MESH}:DeviceMesh._create_flatten_mesh", _flatten_innermost_first),),
        origin=blind(
            DTENSOR_DEPTH, "https://github.com/pytorch/pytorch/pull/165542", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/124787 (DeviceMesh.from_group) with the rank
    # space confusion of https://github.com/pytorch/pytorch/issues/109973 and PR #108331
    # (group-local ranks used where global ranks were meant).
    Fault(
        id="placements.mesh_from_group_local_ranks",
        area="placements",
        bug_class="group-local ranks used where global ranks were meant",
        summary="DeviceMesh.from_group(pg) builds the mesh [0..pg.size()-1] instead of the "
        "group's global ranks: for a subgroup not starting at rank 0 its members are 'not in "
        "the mesh' (get_coordinate() None, empty local tensors)",
        patches=(Patch(f"{_MESH}:DeviceMesh.from_group", _from_group_local_ranks),),
        origin=blind(
            DTENSOR_DEPTH,
            "https://github.com/pytorch/pytorch/pull/124787",
            "https://github.com/pytorch/pytorch/issues/109973",
            survived_before=True,
        ),
    ),
)
