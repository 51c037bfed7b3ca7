"""Runs a ``ProgramCase``'s steps on DTensors over a mesh, or on plain tensors on one device.

The ops of ``harness.cases.programs.OPS`` that move data between layouts (redistribute,
from_local/to_local, full_tensor) are the identity on one device, and ``relabel`` a known
multiple: the program computes the same values either way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from harness.cases.programs import OPS, ProgramCase, Step, relabelled
from harness.torchkit.dtensor import to_torch_placements
from specs.placements import normalize

Run = Callable[[list[torch.Tensor], Step], torch.Tensor]

_RUN: dict[str, Run] = {
    "neg": lambda a, s: -a[0],
    "tanh": lambda a, s: torch.tanh(a[0]),
    "relu": lambda a, s: torch.relu(a[0]),
    "add_scalar": lambda a, s: a[0] + s.scalar,
    "rsub_scalar": lambda a, s: s.scalar - a[0],
    "mul_scalar": lambda a, s: a[0] * s.scalar,
    "div_scalar": lambda a, s: a[0] / s.scalar,
    "add_scalar_": lambda a, s: a[0].clone().add_(s.scalar),
    "mul_scalar_": lambda a, s: a[0].clone().mul_(s.scalar),
    "add": lambda a, s: a[0] + a[1],
    "sub": lambda a, s: a[0] - a[1],
    "mul": lambda a, s: a[0] * a[1],
    "mul_": lambda a, s: a[0].clone().mul_(a[1]),
    "sum": lambda a, s: a[0].sum(),
    "sum_dim": lambda a, s: a[0].sum(s.dims[0], keepdim=s.keepdim),
    "mean_dim": lambda a, s: a[0].mean(s.dims[0], keepdim=s.keepdim),
    "transpose": lambda a, s: a[0].transpose(s.dims[0], s.dims[1]),
    "unsqueeze": lambda a, s: a[0].unsqueeze(s.dims[0]),
    "matmul": lambda a, s: a[0] @ a[1].T,
    "einsum": lambda a, s: torch.einsum("ij,kj->ik", a[0], a[1]),
}


def run_steps(
    case: ProgramCase, values: list[torch.Tensor], mesh: DeviceMesh | None, first: int = 0
) -> list[torch.Tensor]:
    """``values`` (the leaves, then the results of the steps before ``first``) followed by
    each step's result from ``first`` on, on DTensors over ``mesh`` or, with no mesh, on
    plain tensors."""
    for step in case.steps[first:]:
        args = [values[i] for i in step.args]
        if step.op in _RUN:
            values.append(_RUN[step.op](args, step))
        elif mesh is None and OPS[step.op].collective:
            values.append(args[0].detach())
        elif mesh is None:
            scale = case.scale_of(step) if step.op == "relabel" else 1.0
            values.append(args[0] * scale if scale != 1.0 else args[0])
        else:
            values.append(_move(args[0], step, mesh))
    return values


def loss_of(case: ProgramCase, values: list[torch.Tensor]) -> torch.Tensor:
    """Every value's sum of squares, added up (or the last value's): a gradient that differs
    at every element."""
    counted = values if case.loss_of_all else values[-1:]
    total = (counted[0] * counted[0]).sum()
    for value in counted[1:]:
        total = total + (value * value).sum()
    return total


def _move(value: torch.Tensor, step: Step, mesh: DeviceMesh) -> torch.Tensor:
    assert isinstance(value, DTensor), f"a program's values are DTensors, got {type(value)}"
    if step.op == "redistribute":
        return value.redistribute(mesh, to_torch_placements(step.target))
    if step.op == "roundtrip":
        return DTensor.from_local(
            value.to_local(), mesh, value.placements, shape=value.shape, stride=value.stride()
        )
    if OPS[step.op].collective:
        return _collective(value, step.op, mesh)
    if step.op == "full_tensor":
        return DTensor.from_local(value.full_tensor(), mesh, [Replicate()] * mesh.ndim)
    moved = value.redistribute(mesh, to_torch_placements(step.target))
    labels = to_torch_placements(relabelled(step))
    # spelled from the front: torch 2.13's to_local takes no Shard(-d) hint (spec
    # placements.program.grad_placements_from_the_back checks that on its own)
    hinted = step.partial_axes or step.hint
    hint = to_torch_placements(normalize(relabelled(step), value.ndim)) if hinted else None
    local = moved.to_local(grad_placements=hint)
    if step.explicit_shape:
        return DTensor.from_local(local, mesh, labels, shape=moved.shape, stride=moved.stride())
    # from_local infers the global stride from the local one, and a redistribute on CPU
    # (all-gather, then a chunk) can leave a non-contiguous local piece
    return DTensor.from_local(local.contiguous(), mesh, labels)


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _collective(value: DTensor, op: str, mesh: DeviceMesh) -> torch.Tensor:
    """A collective of ``torch.distributed`` on ``value``'s local tensor (a detached copy),
    over the 1-D mesh's group, given back by ``from_local``: a Partial value reduced by hand
    with its own reduce op (all_reduce to Replicate, reduce_scatter_tensor to Shard(0)), an
    even Shard(0) gathered into a list (all_gather)."""
    assert mesh.ndim == 1, "a collective op runs on a 1-D mesh"
    group = mesh.get_group()
    local = value.to_local().detach().clone()
    if op == "all_gather":
        assert value.placements == (Shard(0),), f"all_gather reads Shard(0), got {value}"
        pieces = [torch.empty_like(local) for _ in range(mesh.size())]
        dist.all_gather(pieces, local, group=group)
        return DTensor.from_local(torch.cat(pieces), mesh, [Replicate()])
    (placement,) = value.placements
    assert isinstance(placement, Partial), f"{op} reads a Partial value, got {value}"
    reduce_op = _REDUCE_OPS[placement.reduce_op]
    if op == "all_reduce":
        dist.all_reduce(local, op=reduce_op, group=group)
        return DTensor.from_local(local, mesh, [Replicate()])
    out = local.new_empty((local.shape[0] // mesh.size(), *local.shape[1:]))
    dist.reduce_scatter_tensor(out, local, op=reduce_op, group=group)
    return DTensor.from_local(out, mesh, [Shard(0)], shape=value.shape, stride=value.stride())
