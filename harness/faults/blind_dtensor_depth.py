"""Blind faults in DTensor programs, gradients and meshes built by slicing, flattening or
from process groups: ops chained on Partial results, in-place ops, from_local / to_local /
full_tensor and their backward, and DeviceMesh submeshes.

Written blind, as a held-out set: by a contributor who read upstream's bug reports and
torch's source but not distconf's suites, each fault re-creating the mechanism of a real
upstream bug (the comment above it) in torch 2.13. The DCP and metadata faults of the same
set are in ``blind_dtensor_depth2``.

Each patch was written for torch 2.13: a target that is gone raises FaultError when applied.

In the catalogue since the DTensor depth work (``harness.faults.FAULTS``).

Before that work, the placements, uneven and state_dict suites at the ci profile (threads,
world sizes 1-4, torch 2.13) caught 7 of the 18 faults of the two modules; here caught:
``inplace_op_redistributes_self`` (only as ``state_dict.full.module_load``'s known
deviation no longer happening), ``mesh_slice_groups_by_position`` (state_dict.full.gather),
``mesh_slice_first_submesh`` (state_dict.dcp.reshard); survived:
``partial_plus_scalar_kept_partial``, the four gradient faults
(``from_local_backward_not_redistributed``, ``from_local_backward_partial_divides``,
``to_local_grad_placements_ignored``, ``to_local_partial_grad_kept_partial``),
``mesh_flatten_innermost_first``, ``mesh_from_group_local_ranks``.

After it, the same run catches all 18. Here: the mesh faults by placements.mesh.constructions
(``mesh_flatten_innermost_first`` by placements.mesh.flatten_keeps_gather), the others by
placements.program.matches_one_device, which alone catches all six of them
(``inplace_op_redistributes_self`` after 89 examples); in a whole run
``to_local_grad_placements_ignored`` shows first as placements.api.shard_dim_from_the_back's
known deviation no longer happening.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from harness.faults._patch import Fault, Patch, forcing_argument

_API = "torch.distributed.tensor._api"
_OPS_UTILS = "torch.distributed.tensor._ops.utils"
_MESH = "torch.distributed.device_mesh"
_PROPAGATOR = "torch.distributed.tensor._api:DTensor._op_dispatcher.sharding_propagator"


# --- Partial(sum) + Python scalar kept Partial ------------------------------------------------


def _scalar_add_keeps_partial(original: dict[Any, Any]) -> dict[Any, Any]:
    import torch
    from torch.distributed.tensor._dtensor_spec import TensorMeta
    from torch.distributed.tensor.placement_types import Partial

    aten = torch.ops.aten
    additive = (aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor)

    def with_unary_partial_rule(func: Callable[..., Any]) -> Callable[..., Any]:
        def strategy(op: Any, args_schema: Any, kwargs_schema: Any) -> Any:
            rules = list(func(op, args_schema, kwargs_schema))
            if sum(isinstance(arg, TensorMeta) for arg in args_schema) == 1:
                # The pre-fix linearity rule: P(sum) op scalar -> P(sum), no reduction.
                rules.append([Partial("sum"), Partial("sum")])
            return rules

        return strategy

    patched = dict(original)
    for op in additive:
        if op in patched:
            info = patched[op]
            patched[op] = dataclasses.replace(info, func=with_unary_partial_rule(info.func))
    return patched


# --- from_local backward: the gradient is not redistributed to the forward placements -------


def _from_local_grad_passthrough(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(ctx: Any, grad_output: Any) -> Any:
        if grad_output is None:
            return None, None, None, None, None, None, None
        # Whatever placement the gradient arrived with, its local piece is returned as is.
        return grad_output._local_tensor, None, None, None, None, None, None

    return backward


# --- from_local backward: Partial forward placement divides the replicated gradient --------


def _from_local_grad_to_partial(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(ctx: Any, grad_output: Any) -> Any:
        if grad_output is None:
            return None, None, None, None, None, None, None
        from torch.distributed.tensor._dtensor_spec import DTensorSpec
        from torch.distributed.tensor._redistribute import redistribute_local_tensor

        target = ctx.grad_placements or ctx.forward_input_placements
        if tuple(grad_output.placements) == tuple(target):
            return grad_output._local_tensor, None, None, None, None, None, None
        spec = DTensorSpec(
            ctx.forward_input_device_mesh, tuple(target), tensor_meta=grad_output._spec.tensor_meta
        )
        # Pre-#115967: back to the forward placements as they are, so a replicated
        # gradient becomes Partial by dividing it by the mesh size.
        local = redistribute_local_tensor(grad_output._local_tensor, grad_output._spec, spec)
        return local, None, None, None, None, None, None

    return backward


# --- to_local: grad_placements dropped; Partial gradient kept Partial ------------------------


def _to_local_grad_placements_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(ctx: Any, input: Any, grad_placements: Any) -> Any:
        return original(ctx, input, None)

    return forward


def _to_local_partial_grad_kept(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(ctx: Any, input: Any, grad_placements: Any) -> Any:
        if grad_placements is None:
            # Pre-#173454: the gradient is assumed to have the forward placements, Partial
            # included, so a gradient that is really replicated is reduced once more.
            grad_placements = tuple(input.placements)
        return original(ctx, input, grad_placements)

    return forward


# --- DeviceMesh: a named slice takes its parent's dim groups by position ---------------------


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


# --- DeviceMesh: a slice's ranks taken from its first group on every rank ---------------------


def _first_group_of_slice(original: Callable[..., Any]) -> Callable[..., Any]:
    def _get_mesh_tensor_from_full_mesh(full_mesh: Any, current_rank: int | None = None) -> Any:
        return full_mesh[0]

    return _get_mesh_tensor_from_full_mesh


# --- DeviceMesh._flatten: ranks enumerated innermost dim first ------------------------------


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


# --- DeviceMesh.from_group: the mesh built from group-local ranks ----------------------------


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
    # https://github.com/pytorch/pytorch/issues/163193 (also #149768: clip_grad_norm_'s
    # total_norm + 1e-6 on a Partial norm), fixed by PR #170030: adding a Python scalar to a
    # Partial(sum) DTensor kept the output Partial, so every rank added the scalar to its
    # partial value and the reduced result held it world-size times.
    Fault(
        id="placements.partial_plus_scalar_kept_partial",
        area="placements",
        bug_class="a non-linear use of a pending sum: a scalar added once per rank",
        summary="add/sub (and add_/sub_) of a Partial('sum') DTensor and a Python scalar keep "
        "Partial('sum') without reducing first: dt.sum() + c reduces to sum + world_size * c",
        patches=(Patch(f"{_PROPAGATOR}.op_single_dim_strategy_funcs", _scalar_add_keeps_partial),),
    ),
    # https://github.com/pytorch/pytorch/pull/172477 ("inplace ops were able to generate
    # expanded strategies incompatible with the current input placements, which aren't
    # allowed to be modified by redistribution"; cf. issue #163374, clamp_ on a Partial
    # DTensor giving 144 instead of 2): an in-place op picked a strategy that redistributed
    # self, so the result was written into a temporary copy and self's spec was relabelled.
    Fault(
        id="placements.inplace_op_redistributes_self",
        area="placements",
        bug_class="an in-place op allowed to change its self argument's placement",
        summary="the full-mesh strategy expansion no longer filters in-place strategies that "
        "redistribute self: x_replicated.add_(y_sharded) shards x's spec while its local "
        "tensor stays whole, and Partial.clamp_ runs on a reduced copy",
        patches=(
            Patch(
                f"{_OPS_UTILS}:expand_to_full_mesh_op_strategy",
                forcing_argument("inplace_op", False),
            ),
        ),
    ),
    # https://github.com/pytorch/torchtitan/issues/2416 (MoE numerics, fixed with PR
    # pytorch/pytorch#175867) and torchtitan PR #2532: a gradient that must be all-reduced
    # when it leaves DTensor (from_local's backward redistributing Partial -> Replicate) was
    # handed back as each rank's local partial piece.
    Fault(
        id="placements.from_local_backward_not_redistributed",
        area="placements",
        bug_class="an input gradient not reduced (its pending Partial dropped)",
        summary="from_local's backward returns the incoming gradient's local tensor without "
        "redistributing it to the forward placements (or grad_placements): a Partial "
        "gradient reaches the plain tensor unreduced, a Shard one as a shard of the wrong size",
        patches=(Patch(f"{_API}:_FromTorchTensor.backward", _from_local_grad_passthrough),),
    ),
    # https://github.com/pytorch/pytorch/pull/115967 ("The current div logic will lead to
    # wrong numerical value"; also #173153): from_local with a Partial forward placement
    # redistributed its replicated gradient back to Partial, dividing it by the mesh size.
    Fault(
        id="placements.from_local_backward_partial_divides",
        area="placements",
        bug_class="a gradient redistributed to Partial (Replicate -> Partial divides by n)",
        summary="from_local's backward redistributes the gradient to the forward placements "
        "as they are instead of mapping Partial to Replicate: the local gradient of a tensor "
        "made with from_local(..., [Partial()]) is divided by the mesh dim size",
        patches=(Patch(f"{_API}:_FromTorchTensor.backward", _from_local_grad_to_partial),),
    ),
    # https://github.com/pytorch/pytorch/pull/121474 (to_local's grad_placements must be
    # honoured, not forced back to the forward placements) and torchtitan PR #2532 (a
    # to_local without the right grad_placements skipped the TP all-reduce of a norm weight's
    # gradient).
    Fault(
        id="placements.to_local_grad_placements_ignored",
        area="placements",
        bug_class="a user-given gradient layout hint ignored",
        summary="to_local(grad_placements=...) and full_tensor(grad_placements=...) drop the "
        "hint: the gradient is labelled with the forward placements (Partial -> Replicate), "
        "so a gradient declared Partial is never reduced and one declared Shard is mislabelled",
        patches=(Patch(f"{_API}:_ToTorchTensor.forward", _to_local_grad_placements_dropped),),
    ),
    # https://github.com/pytorch/pytorch/issues/172932 (fixed by PR #173454): to_local on a
    # Partial DTensor labelled its gradient Partial, so to_local + from_local(Partial) gave a
    # different gradient from the same program on DTensors.
    Fault(
        id="placements.to_local_partial_grad_kept_partial",
        area="placements",
        bug_class="a replicated gradient labelled Partial (summed once more)",
        summary="without grad_placements, to_local's backward labels the gradient with the "
        "forward placements as they are: for a Partial DTensor the (replicated) gradient is "
        "treated as Partial and all-reduced again, multiplying it by the mesh dim size",
        patches=(Patch(f"{_API}:_ToTorchTensor.forward", _to_local_partial_grad_kept),),
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
    ),
)
