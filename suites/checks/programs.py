"""Rank function and one-device reference of the DTensor program property."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from harness import RankContext
from harness.cases.programs import ProgramCase
from harness.torchkit import local
from harness.torchkit.dtensor import (
    DTensorView,
    tensor_from,
    to_numpy,
    to_torch_placements,
    view_of,
)
from harness.torchkit.programs import loss_of, run_steps
from specs.placements import Partial, Placement, Replicate, Shard, contiguous_stride, local_arrays


@dataclass(frozen=True)
class ProgramRun:
    """One rank's program: every value (leaves first), whether each requires grad, and
    each leaf's gradient: a DTensor view for a distributed leaf, this rank's local
    gradient for a leaf made by from_local (None: no gradient reached it)."""

    values: list[DTensorView]
    requires_grad: list[bool]
    grads: list[DTensorView | np.ndarray | None]


@dataclass(frozen=True)
class Reference:
    """The program on one device: values, their strides and flags, leaf gradients."""

    values: list[np.ndarray]
    strides: list[tuple[int, ...]]
    contiguous: list[bool]
    requires_grad: list[bool]
    grads: list[np.ndarray | None]
    """None where the loss does not depend on the leaf (it counts the last value only)."""


def leaf_pieces(case: ProgramCase, index: int, rank: int) -> np.ndarray:
    """What ``rank`` passes to from_local for leaf ``index``: its piece of the global
    array (distinct contributions on Partial axes, which add up to it)."""
    leaf = case.leaves[index]
    layout = local_arrays(
        case.leaf_array(index),
        case.mesh.shape,
        leaf.placements,
        partial="distinct",
        seed=leaf.seed,
    )
    return layout[case.mesh.coord_of(rank)]


Runs = Callable[[list[torch.Tensor], DeviceMesh], tuple[list[torch.Tensor], torch.Tensor]]
"""Runs a program's steps on its input DTensors: every value (leaves first) and the loss."""


def eager_steps(case: ProgramCase) -> Runs:
    """``case``'s steps run as written (eagerly), then its loss."""

    def run(
        inputs: list[torch.Tensor], mesh: DeviceMesh
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        values = run_steps(case, inputs, mesh)
        return values, loss_of(case, values)

    return run


def program_on_rank(ctx: RankContext, case: ProgramCase) -> ProgramRun:
    return run_program(ctx, case, eager_steps(case))


def run_program(ctx: RankContext, case: ProgramCase, runs: Runs) -> ProgramRun:
    """``case`` on this rank: its leaves made, its steps and loss run by ``runs``, then
    ``backward()``."""
    mesh = ctx.mesh_of(case.mesh)
    inputs: list[torch.Tensor] = []
    leaves: list[torch.Tensor] = []
    for index, leaf in enumerate(case.leaves):
        placements = to_torch_placements(leaf.placements)
        if leaf.how == "distribute":
            whole = _whole(case.leaf_array(index), leaf.transposed, ctx.device)
            dtensor = distribute_tensor(whole.requires_grad_(), mesh, placements)
            inputs.append(dtensor)
            leaves.append(dtensor)
            continue
        piece = _leaf_piece(ctx, case, index)
        piece.requires_grad_()
        if leaf.explicit_shape:
            shape, stride = torch.Size(case.shape), contiguous_stride(case.shape)
            inputs.append(DTensor.from_local(piece, mesh, placements, shape=shape, stride=stride))
        else:
            inputs.append(DTensor.from_local(piece, mesh, placements))
        leaves.append(piece)
    values, loss = runs(list(inputs), mesh)
    loss.backward()
    return ProgramRun(
        values=[view_of(v.detach(), ctx) for v in values],
        requires_grad=[v.requires_grad for v in values],
        grads=[_grad_of(leaf, ctx) for leaf in leaves],
    )


def _whole(array: np.ndarray, transposed: bool, device: torch.device) -> torch.Tensor:
    """The tensor a distributed leaf is made from: a transposed view of a contiguous tensor
    where the leaf says so (the same values, its last two strides swapped)."""
    if not transposed:
        return tensor_from(array, "float64", device)
    swapped = tensor_from(np.ascontiguousarray(array.swapaxes(-1, -2)), "float64", device)
    return swapped.transpose(-1, -2)


def _leaf_piece(ctx: RankContext, case: ProgramCase, index: int) -> torch.Tensor:
    """This rank's piece of leaf ``index``, as a tensor (every rank's, simulated)."""
    return local.rank_tensor(
        ctx, lambda rank: tensor_from(leaf_pieces(case, index, rank), "float64", ctx.device)
    )


def _grad_of(leaf: torch.Tensor, ctx: RankContext) -> DTensorView | np.ndarray | None:
    if leaf.grad is None:
        return None
    if isinstance(leaf, DTensor):
        return view_of(leaf.grad, ctx)
    return to_numpy(leaf.grad)


def program_on_one_device(case: ProgramCase, device: str) -> Reference:
    where = torch.device(device)
    leaves = [
        _whole(case.leaf_array(i), leaf.transposed, where).detach().requires_grad_()
        for i, leaf in enumerate(case.leaves)
    ]
    values = run_steps(case, list(leaves), None)
    loss_of(case, values).backward()
    return Reference(
        values=[to_numpy(v) for v in values],
        strides=[tuple(v.stride()) for v in values],
        contiguous=[v.is_contiguous() for v in values],
        requires_grad=[v.requires_grad for v in values],
        grads=[None if leaf.grad is None else to_numpy(leaf.grad) for leaf in leaves],
    )


def transitions(case: ProgramCase, run: ProgramRun) -> list[str]:
    """What one rank's program reached: each leaf's kind and placements, and each step's op
    with the placements of its arguments and of its result (``S(0)``, ``R``, ``P(sum)``)."""
    spelled = [_spell(view.placements) for view in run.values]
    leaves = [f"leaf {leaf.how}: {spelled[index]}" for index, leaf in enumerate(case.leaves)]
    offset = len(case.leaves)
    steps = [
        f"{step.op}: {', '.join(spelled[a] for a in step.args)} -> {spelled[offset + number]}"
        for number, step in enumerate(case.steps)
    ]
    return leaves + steps


def _spell(placements: tuple[Placement | str, ...]) -> str:
    def one(p: Placement | str) -> str:
        if isinstance(p, Shard):
            return f"S({p.dim})"
        if isinstance(p, Partial):
            return f"P({p.reduce_op})"
        return "R" if isinstance(p, Replicate) else str(p)

    return "".join(one(p) for p in placements) or "()"
