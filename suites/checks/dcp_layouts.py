"""Rank functions of the DCP layout property: ``dcp.save`` of named DTensors laid out as the
case says, and ``dcp.load`` into DTensors of other layouts (maybe on another World).

Every DTensor is made with ``DTensor.from_local`` from the piece the reference model
(``specs.strided``) gives this rank, so any layout the model knows can be saved, the
FSDP-over-TP ``_StridedShard`` among them. The driver makes the checkpoint directory and
removes it; a refusal is returned as text on every rank that met it, for the driver to judge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement as TorchPlacement
from torch.distributed.tensor.placement_types import _StridedShard

from harness import RankContext
from harness.cases.dcp_layouts import SENTINEL, DcpLayoutCase, Layout, SavedTensor
from harness.torchkit.dtensor import (
    DTensorView,
    full_array,
    tensor_from,
    to_torch_placements,
    view_of,
)
from specs.placements import contiguous_stride
from specs.strided import LayoutPlacement, StridedShard


def torch_placements(placements: tuple[LayoutPlacement, ...]) -> tuple[TorchPlacement, ...]:
    """The model's placements as torch's (``StridedShard`` as ``_StridedShard``, the rest
    as ``harness.torchkit.dtensor.to_torch_placements`` spells them)."""
    return tuple(
        _StridedShard(p.dim, split_factor=p.split_factor)
        if isinstance(p, StridedShard)
        else to_torch_placements((p,))[0]
        for p in placements
    )


def _dtensor(ctx: RankContext, tensor: SavedTensor, layout: Layout, local: np.ndarray) -> DTensor:
    """``DTensor.from_local`` of ``local`` laid out by ``layout``, with the global shape and
    stride given (uneven pieces: torch cannot infer them)."""
    piece = tensor_from(local, tensor.dtype, ctx.device)
    return DTensor.from_local(
        piece,
        ctx.mesh(layout.mesh_shape),
        torch_placements(layout.placements),
        shape=torch.Size(tensor.shape),
        stride=contiguous_stride(tensor.shape),
    )


def _refusal(exc: BaseException) -> str:
    """The error's type and, for one carrying tracebacks (``CheckpointException`` holds
    every failed rank's), the last line: the error raised at the bottom."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def save_on_rank(ctx: RankContext, case: DcpLayoutCase, directory: str) -> str | None:
    """``dcp.save`` of every tensor of the case in its save layout; what it raised, if anything."""
    state = {t.name: _dtensor(ctx, t, t.save, t.local_of(t.save, ctx.rank)) for t in case.tensors}
    try:
        dcp_save(state, checkpoint_id=directory)
    except (Exception, CheckpointException) as exc:  # a BaseException, wrapping every rank's
        return _refusal(exc)
    return None


@dataclass(frozen=True)
class Loaded:
    """What one rank holds after ``dcp.load``: the error it raised, or a view of every
    destination DTensor by name (its local piece, without ``full_tensor()``)."""

    error: str | None
    views: dict[str, DTensorView]


def load_on_rank(ctx: RankContext, case: DcpLayoutCase, directory: str) -> Loaded:
    """``dcp.load`` into DTensors of every tensor's load layout, each filled with
    ``SENTINEL`` first. No collective after the load: the driver compares the local pieces
    before anything gathers them (``gathered_on_rank``), so that a piece loaded wrong is
    told apart from a gather that goes wrong."""
    state: dict[str, Any] = {}
    for t in case.tensors:
        filled = np.full(t.local_shape(t.load, ctx.rank), SENTINEL, dtype=np.float64)
        state[t.name] = _dtensor(ctx, t, t.load, filled)
    try:
        dcp_load(state, checkpoint_id=directory)
    except (Exception, CheckpointException) as exc:  # a BaseException, wrapping every rank's
        return Loaded(_refusal(exc), {})
    views = {t.name: view_of(state[t.name], ctx.rank, with_full=False) for t in case.tensors}
    return Loaded(None, views)


def gathered_on_rank(
    ctx: RankContext, case: DcpLayoutCase, loaded: list[dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """``full_tensor()`` of every loaded DTensor, by name: the DTensor of its load layout
    over the piece ``loaded[rank]`` this rank loaded (shape, stride and placements the
    driver found unchanged by the load)."""
    mine = loaded[ctx.rank]
    return {t.name: full_array(_dtensor(ctx, t, t.load, mine[t.name])) for t in case.tensors}
