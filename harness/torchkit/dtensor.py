"""Bridges between DTensor and the torch-free reference models, for use on ranks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Partial as TorchPartial
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor.placement_types import Placement as TorchPlacement

from harness.cases.placements import DistributeCase
from harness.errors import check_one_of
from harness.torchkit import local
from harness.torchkit.context import RankContext
from specs.placements import Coord, Partial, Placement, Replicate, Shard

TORCH_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}


def torch_dtype(name: str) -> torch.dtype:
    check_one_of("dtype", name, TORCH_DTYPES)
    return TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_torch_placements(placements: Sequence[Placement]) -> tuple[TorchPlacement, ...]:
    converted: list[TorchPlacement] = []
    for p in placements:
        if isinstance(p, Shard):
            converted.append(TorchShard(p.dim))
        elif isinstance(p, Replicate):
            converted.append(TorchReplicate())
        else:
            converted.append(TorchPartial(p.reduce_op))
    return tuple(converted)


def from_torch_placements(placements: Sequence[TorchPlacement]) -> tuple[Placement | str, ...]:
    """The model's spelling of plain placements; any other kind is kept as its repr."""
    converted: list[Placement | str] = []
    for p in placements:
        if type(p) is TorchShard:
            converted.append(Shard(p.dim))
        elif type(p) is TorchReplicate:
            converted.append(Replicate())
        elif type(p) is TorchPartial:
            converted.append(Partial(p.reduce_op))
        else:
            converted.append(repr(p))
    return tuple(converted)


def tensor_from(array: np.ndarray, dtype: str, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor of ``dtype`` on ``device`` (exact for the integer-valued cases).

    Copied into a fresh ``torch.empty`` so the strides are torch's own for the shape: numpy
    gives empty arrays strides torch would not (``from_numpy`` of a (0,) array has stride 0).
    """
    values = np.asarray(array)
    tensor = torch.empty(values.shape, dtype=torch_dtype(dtype), device=device)
    return tensor.copy_(torch.from_numpy(values.copy()))


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A host copy; bfloat16 widens to float32, which represents every bfloat16 exactly.
    A simulated tensor gives each rank's copy (``local.per_shard``)."""
    return local.per_shard(tensor, _host_copy)


def _host_copy(tensor: torch.Tensor) -> np.ndarray:
    host = tensor.detach().cpu()
    if host._is_zerotensor():
        host = torch.zeros_like(host)
    host = host.resolve_conj().resolve_neg()
    if host.dtype in _WIDENED:
        host = host.to(_WIDENED[host.dtype])
    return host.numpy().copy()


# dtypes numpy lacks, as the wider dtype that holds each of their values exactly
_WIDENED = {torch.bfloat16: torch.float32, torch.complex32: torch.complex64}


def full_array(tensor: torch.Tensor) -> np.ndarray:
    """The whole tensor on this rank as a numpy array: ``full_tensor()`` of a DTensor (a
    collective: every rank must call it), the tensor itself otherwise."""
    return to_numpy(tensor.full_tensor() if isinstance(tensor, DTensor) else tensor)


def full_grads(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Every parameter's whole gradient by name (a collective per DTensor gradient)."""
    return {n: full_array(p.grad) for n, p in model.named_parameters() if p.grad is not None}


@dataclass(frozen=True)
class DTensorView:
    """What one rank holds of a DTensor, in plain values the driver can compare."""

    rank: int
    coord: Coord
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    placements: tuple[Placement | str, ...]
    dtype: str
    local_dtype: str
    local: np.ndarray
    full: np.ndarray | None
    mesh_ranks: tuple[int, ...] = ()
    """The global ranks of the DTensor's mesh, flattened row-major."""
    local_stride: tuple[int, ...] = ()
    """The local tensor's own strides (its values are in ``local``)."""


def view_of(
    tensor: torch.Tensor | None, who: int | RankContext, *, with_full: bool = True
) -> DTensorView:
    """Snapshot ``tensor`` on this rank (``who``: the rank, or its context); ``with_full``
    gathers ``full_tensor()`` (a collective: every rank must call it).

    Anything but a DTensor fails the check: a parameter or gradient that should be sharded
    and is not is a conformance failure, not a harness error. Given the context of a check
    that simulates every rank, the view holds every rank's values, split per rank by the
    runner (``harness.torchkit.local``).
    """
    rank = who if isinstance(who, int) else local.rank_of(who)
    if not isinstance(tensor, DTensor):
        on = f"rank {who}" if isinstance(who, int) else _ranks_of(who)
        raise AssertionError(f"{on}: got {type(tensor).__name__}, should be a DTensor")
    piece = tensor.to_local()
    full = to_numpy(tensor.full_tensor()) if with_full else None
    coord = tuple(local.integer(c) for c in (tensor.device_mesh.get_coordinate() or ()))
    return DTensorView(
        rank=rank,
        coord=coord,
        shape=tuple(tensor.shape),
        stride=tuple(tensor.stride()),
        placements=from_torch_placements(tensor.placements),
        dtype=dtype_name(tensor.dtype),
        local_dtype=dtype_name(piece.dtype),
        local=to_numpy(piece),
        full=full,
        mesh_ranks=local.mesh_ranks(tensor.device_mesh),
        local_stride=tuple(local.integer(s) for s in piece.stride()),
    )


def _ranks_of(ctx: RankContext) -> str:
    ranks = local.simulated_ranks()
    return f"rank {ctx.rank}" if ranks is None else f"ranks {ranks[0]}-{ranks[-1]} (simulated)"


def distribute(ctx: RankContext, case: DistributeCase) -> DTensor:
    """``distribute_tensor`` of the case's input on this rank over its mesh and placements."""
    mesh = ctx.mesh_of(case.mesh)
    placements = to_torch_placements(case.placements)
    local.check_distribute_source(mesh, placements, case.src_data_rank)
    tensor = local.rank_tensor(
        ctx, lambda rank: tensor_from(case.input_of(rank), case.dtype, ctx.device)
    )
    return distribute_tensor(tensor, mesh, placements, src_data_rank=case.src_data_rank)
