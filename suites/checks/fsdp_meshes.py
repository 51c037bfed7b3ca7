"""Rank functions of the FSDP init suite on 2-D meshes: FSDP over TP, HSDP, meshes made from
process groups, all-reduce hooks, and the mesh argument's errors."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from harness import RankContext
from harness.cases.modules import MLPMeshCase
from harness.parity import assert_array_equal, failure
from harness.torchkit import devices
from harness.torchkit.dtensor import DTensorView, full_grads, tensor_from, to_numpy, view_of
from harness.torchkit.module_graphs import GraphMLP, build_mesh_mlp, mesh_batch, reset_all
from specs import fsdp_layouts as layouts

CONSTANT = 1337.0
PLAN = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
TP_DIMS: dict[str, int | None] = {
    "in_proj.weight": 0,
    "in_proj.bias": 0,
    "out_proj.weight": 1,
    "out_proj.bias": None,
}
"""The dim TP shards (None: replicated) under ``PLAN``, by parameter name."""


@dataclass(frozen=True)
class MeshView:
    params: dict[str, DTensorView]
    """Every parameter after sharding (and, on meta, materialising), with its full value."""
    grads: dict[str, np.ndarray]
    """Full gradients after one forward and backward over this rank's rows."""
    loss: float


def _other_dim(param: nn.Parameter) -> Shard:
    """FSDP on the dim TP leaves: dim 1 of a weight TP shards on dim 0, else dim 0."""
    placements = param.placements if isinstance(param, DTensor) else ()
    tp_dims = [p.dim for p in placements if isinstance(p, Shard)]
    return Shard(1) if param.ndim == 2 and tp_dims == [0] else Shard(0)


def _shard(model: GraphMLP, case: MLPMeshCase, mesh: DeviceMesh, **options: Any) -> None:
    parts = [model.in_proj, model.out_proj] if case.nested else []
    for module in [*parts, model]:
        fully_shard(module, mesh=mesh, **options)


def _materialize(model: nn.Module, device: torch.device) -> None:
    model.to_empty(device=device)
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            (tensor.to_local() if isinstance(tensor, DTensor) else tensor).fill_(CONSTANT)
    reset_all(model)


def _rows(case: MLPMeshCase, ctx: RankContext, dp_size: int, dp_rank: int) -> list[torch.Tensor]:
    rows = slice(dp_rank * case.batch_per_dp_rank, (dp_rank + 1) * case.batch_per_dp_rank)
    return [tensor_from(a[rows], "float64", ctx.device) for a in mesh_batch(case, dp_size)]


def _step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    loss = F.mse_loss(model(inputs), targets)
    loss.backward()
    return float(loss.item())


def tp_on_rank(ctx: RankContext, case: MLPMeshCase) -> MeshView:
    """``parallelize_module`` over ``tp`` (Colwise in, Rowwise out), ``fully_shard`` over
    ``dp``; then, when TP splits ``hidden`` evenly, one step on the rows of this rank's dp
    coordinate (no gradients otherwise)."""
    mesh = ctx.mesh(case.mesh_shape, ("dp", "tp"))
    model = build_mesh_mlp(case, ctx.device)
    parallelize_module(model, mesh["tp"], PLAN)
    placement_fn = _other_dim if case.other_dim else None
    _shard(model, case, mesh["dp"], shard_placement_fn=placement_fn)
    if case.meta:
        _materialize(model, ctx.device)
    params = {name: view_of(p, ctx.rank) for name, p in model.named_parameters()}
    if not case.trains_with_tp:
        return MeshView(params, {}, float("nan"))
    dp_rank = mesh.get_local_rank("dp")
    loss = _step(model, *_rows(case, ctx, case.mesh_shape[0], dp_rank))
    return MeshView(params, full_grads(model), loss)


def reference_step(case: MLPMeshCase, data_parallel: int) -> tuple[dict[str, Any], float]:
    """Values before and gradients after one step on one device over the global batch."""
    model = build_mesh_mlp(replace(case, meta=False), "cpu")
    values = {name: to_numpy(p) for name, p in model.named_parameters()}
    inputs, targets = (torch.from_numpy(a) for a in mesh_batch(case, data_parallel))
    loss = _step(model, inputs, targets)
    return {"values": values, "grads": full_grads(model)}, loss


@dataclass(frozen=True)
class HSDPView:
    params: dict[str, DTensorView]
    corrupted: dict[str, list[np.ndarray]]
    """Per tensor: the local data of every replica after replicas > 0 were overwritten."""
    broadcast: dict[str, list[np.ndarray]]
    """The same after a broadcast from replica 0 over the replicate group."""
    grads: dict[str, np.ndarray]
    loss: float


def _replicas(tensor: torch.Tensor, group: Any, size: int) -> list[np.ndarray]:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local.numel() == 0:
        return [to_numpy(local)] * size  # the same empty piece on every replica
    gathered = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(gathered, local.contiguous(), group=group)
    return [to_numpy(t) for t in gathered]


def hsdp_on_rank(ctx: RankContext, case: MLPMeshCase) -> HSDPView:
    """HSDP on ``(replicate, shard)``: overwrite replicas > 0, broadcast from replica 0,
    then one step on this rank's rows (every rank is data-parallel)."""
    mesh = ctx.mesh(case.mesh_shape, ("replicate", "shard"))
    model = build_mesh_mlp(case, ctx.device)
    _shard(model, case, mesh)
    params = {name: view_of(p, ctx.rank) for name, p in model.named_parameters()}
    group, size = mesh.get_group("replicate"), case.mesh_shape[0]
    tensors = [*model.named_parameters(), *model.named_buffers()]
    if mesh.get_local_rank("replicate") > 0:
        with torch.no_grad():
            for _, tensor in tensors:
                (tensor.to_local() if isinstance(tensor, DTensor) else tensor).fill_(CONSTANT)
    corrupted = {name: _replicas(t, group, size) for name, t in tensors}
    source = dist.get_process_group_ranks(group)[0]
    for _, tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.numel():
            dist.broadcast(local, src=source, group=group)
    broadcast = {name: _replicas(t, group, size) for name, t in tensors}
    loss = _step(model, *_rows(case, ctx, ctx.world_size, ctx.rank))
    return HSDPView(params, corrupted, broadcast, full_grads(model), loss)


def strided_on_rank(
    ctx: RankContext, case: MLPMeshCase
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """FSDP over TP, then for each parameter placed with a ``_StridedShard``: (its local data,
    the local data ``distribute_tensor(full, its mesh, its placements)`` gives). The split
    is local (``src_data_rank=None``): no collective."""
    mesh = ctx.mesh(case.mesh_shape, ("dp", "tp"))
    model = build_mesh_mlp(case, ctx.device)
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    parallelize_module(model, mesh["tp"], PLAN)
    _shard(model, case, mesh["dp"])
    found = {}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), "fully_shard made every parameter a DTensor"
        if any("_StridedShard" in repr(p) for p in param.placements):
            spread = distribute_tensor(
                full[name], param.device_mesh, param.placements, src_data_rank=None
            )
            found[name] = (to_numpy(param.to_local()), to_numpy(spread.to_local()))
    return found


# --- meshes from process groups -------------------------------------------------------------


@dataclass(frozen=True)
class FromGroupView:
    meshes: tuple[Any, Any]
    """(init_device_mesh, from_group): mesh rank lists, this rank's coordinate, child ranks."""
    losses: tuple[float, float]
    params: tuple[dict[str, np.ndarray], dict[str, np.ndarray]]
    """Local parameter shards after the step, per mesh."""
    grads: tuple[dict[str, np.ndarray], dict[str, np.ndarray]]
    """Local gradient shards, per mesh."""


def _describe(mesh: DeviceMesh) -> Any:
    names = mesh.mesh_dim_names or ()
    children = tuple(dist.get_process_group_ranks(mesh.get_group(n)) for n in names)
    return mesh.mesh.tolist(), tuple(mesh.get_coordinate() or ()), children


def _locals(model: nn.Module, grads: bool) -> dict[str, np.ndarray]:
    found = {}
    for name, param in model.named_parameters():
        tensor = param.grad if grads else param
        if isinstance(tensor, DTensor):
            found[name] = to_numpy(tensor.to_local())
    return found


def from_group_on_rank(ctx: RankContext, case: MLPMeshCase, hsdp: bool) -> FromGroupView:
    """The same training on an ``init_device_mesh`` mesh and on ``DeviceMesh.from_group``
    over its process groups: 1-D (the ``dp`` mesh of a ``(dp, tp)`` mesh, rows by dp
    coordinate) or 2-D HSDP (``(replicate, shard)``, rows by rank)."""
    names = ("replicate", "shard") if hsdp else ("dp", "tp")
    full = ctx.mesh(case.mesh_shape, names)
    device = ctx.device.type
    if hsdp:
        reference = full
        layout = torch.arange(ctx.world_size).view(case.mesh_shape)
        groups = [full.get_group("replicate"), full.get_group("shard")]
        made = DeviceMesh.from_group(groups, device, mesh=layout, mesh_dim_names=names)
        rows = _rows(case, ctx, ctx.world_size, ctx.rank)
    else:
        reference = full["dp"]
        made = DeviceMesh.from_group(reference.get_group(), device, mesh_dim_names=("dp",))
        rows = _rows(case, ctx, case.mesh_shape[0], full.get_local_rank("dp"))
    losses, params, grads = [], [], []
    for mesh in (reference, made):
        model = build_mesh_mlp(case, ctx.device)
        _shard(model, case, mesh)
        losses.append(_step(model, *rows))
        params.append(_locals(model, grads=False))
        grads.append(_locals(model, grads=True))
    return FromGroupView(
        (_describe(reference), _describe(made)),
        (losses[0], losses[1]),
        (params[0], params[1]),
        (grads[0], grads[1]),
    )


# --- all-reduce hooks -----------------------------------------------------------------------


def hook_on_rank(ctx: RankContext, case: MLPMeshCase) -> tuple[dict[str, np.ndarray], int]:
    """FSDP over the ``shard`` groups of a ``(replicate, shard)`` mesh (a mesh made with
    ``from_group``) with an all-reduce hook that averages over the ``replicate`` group: the
    full gradients after one step on this rank's rows, and how often the hook ran."""
    full = ctx.mesh(case.mesh_shape, ("replicate", "shard"))
    shard = DeviceMesh.from_group(
        full.get_group("shard"), ctx.device.type, mesh_dim_names=("shard",)
    )
    replicas, size = full.get_group("replicate"), case.mesh_shape[0]
    model = build_mesh_mlp(case, ctx.device)
    _shard(model, case, shard)
    calls = []

    def average_over_replicas(grad: torch.Tensor) -> None:
        dist.all_reduce(grad, group=replicas)  # sum: gloo has no AVG
        grad.div_(size)
        calls.append(1)

    for module in (model.in_proj, model.out_proj, model) if case.nested else (model,):
        module.set_all_reduce_hook(average_over_replicas)  # type: ignore[operator]
    _step(model, *_rows(case, ctx, ctx.world_size, ctx.rank))
    return full_grads(model), len(calls)


def stream_rejected_on_rank(ctx: RankContext, case: MLPMeshCase) -> str | None:
    """``set_all_reduce_hook(..., stream=)`` on a native HSDP module: the ValueError."""
    mesh = ctx.mesh(case.mesh_shape, ("replicate", "shard"))
    model = build_mesh_mlp(case, ctx.device)
    fully_shard(model, mesh=mesh)
    stream = torch.Stream(device=ctx.device)
    try:
        model.set_all_reduce_hook(lambda grad: None, stream=stream)  # type: ignore[operator]
    except ValueError as exc:
        return str(exc)
    return None


def hook_stream_on_rank(ctx: RankContext, case: MLPMeshCase) -> bool:
    """FSDP (1-D) with a hook given an accelerator stream: whether the hook ran in it."""
    model = build_mesh_mlp(case, ctx.device)
    fully_shard(model, mesh=ctx.mesh((ctx.world_size,)))
    stream = torch.Stream(device=ctx.device)
    seen: list[Any] = []
    model.set_all_reduce_hook(  # type: ignore[operator]
        lambda grad: seen.append(devices.current_stream(ctx.device)), stream=stream
    )
    _step(model, *_rows(case, ctx, ctx.world_size, ctx.rank))
    devices.synchronize(ctx.device)
    return bool(seen) and all(s == stream for s in seen)


# --- the mesh argument ----------------------------------------------------------------------


def mesh_error_on_rank(
    ctx: RankContext, shape: tuple[int, ...], named: bool, case: MLPMeshCase
) -> tuple[str, str, str] | None:
    """``fully_shard(mlp, mesh=...)`` on a mesh of ``shape``: (exception type, message, the
    mesh's ``str``), or None when it was accepted."""
    names = tuple(f"axis{i}" for i in range(len(shape))) if named else None
    mesh = ctx.mesh(shape, names)
    try:
        fully_shard(build_mesh_mlp(case, ctx.device), mesh=mesh)
    except (ValueError, AssertionError) as exc:
        return type(exc).__name__, str(exc), str(mesh)
    return None


# --- driver-side checks -----------------------------------------------------------------------


def buffer_value(case: MLPMeshCase) -> np.ndarray:
    """The seeded value of the MLP's buffer."""
    return to_numpy(build_mesh_mlp(replace(case, meta=False), "cpu").get_buffer("buffer"))


def assert_replicas(
    view: HSDPView, name: str, original: np.ndarray, replicas: int, rank: int
) -> None:
    """Replicas > 0 were overwritten (so they differed from replica 0, which kept
    ``original``); after the broadcast every replica holds ``original``."""
    __tracebackhide__ = True
    who = f"{name} on rank {rank}"
    corrupted, broadcast = view.corrupted[name], view.broadcast[name]
    assert_array_equal(corrupted[0], original, what=f"replica 0 of {who}")
    for index in range(1, replicas):
        if original.size:
            constant = np.full_like(original, CONSTANT)
            what = f"overwritten replica {index} of {who}"
            assert_array_equal(corrupted[index], constant, what=what)
    for index in range(replicas):
        what = f"replica {index} of {who} after the broadcast"
        assert_array_equal(broadcast[index], original, what=what)


def assert_fsdp_over_tp(
    view: DTensorView, name: str, full: np.ndarray, rank: int, case: MLPMeshCase
) -> None:
    """The parameter's placements are a conformant spelling of FSDP over TP, its local data
    is FSDP's piece of TP's piece, and its full value is the original."""
    __tracebackhide__ = True
    dp, tp = case.mesh_shape
    tp_dim = TP_DIMS[name]
    fsdp_dim = 1 if case.other_dim and tp_dim == 0 and name.endswith("weight") else 0
    who = f"{name} on rank {rank}"
    spellings = layouts.fsdp_over_tp_spellings(tp_dim, fsdp_dim, tp)
    spelled = tuple(map(str, view.placements))
    if spelled not in spellings:
        raise failure(f"placements of {who}: got {spelled}, should be one of {spellings}")
    local = layouts.fsdp_over_tp_local(full, (dp, tp), divmod(rank, tp), tp_dim, fsdp_dim)
    assert_array_equal(view.local, local, what=f"local data of {who}")
    assert view.full is not None, "views carry full_tensor()"
    assert_array_equal(view.full, full, what=f"full_tensor() of {who}")


def expected_mesh_error(shape: tuple[int, ...], mesh: str) -> tuple[str, str]:
    """The exception ``fully_shard`` raises for a mesh of ``shape`` (printed ``mesh``): a 3-D
    one is refused outright, a 2-D one without dim names fails HSDP's assertion."""
    if len(shape) == 3:
        return "ValueError", f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}"
    return "AssertionError", "Please init the 2D mesh for HSDP with mesh_dim_names specified"
