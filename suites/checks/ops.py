"""Rank side of the op-conformance suite: an OpInfo sample run on DTensors, and on one device.

Every tensor argument of the sample becomes a DTensor built from the pieces its placements
give each rank (``DTensor.from_local``: the layout is the case's, whatever
``distribute_tensor`` would do). An exception of the op is re-raised as ``OpRefused``:
raised alike on every rank it is a refusal (the op has no rule for the layout, or refuses
it), which the test records as coverage; on some ranks only it is a deviation. An exception
of the backward pass is returned with the forward's results, to be judged the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.utils import _pytree as pytree

from harness.cases.ops import OpInfoCase, extremum_holder, share_denominator, sum_shares
from harness.torchkit import local, op_db
from harness.torchkit.context import RankContext
from harness.torchkit.dtensor import (
    DTensorView,
    dtype_name,
    tensor_from,
    to_numpy,
    to_torch_placements,
    view_of,
)
from specs.placements import Partial, Placement, Shard


@dataclass(frozen=True)
class TensorValue:
    """A plain tensor's values and dtype (numpy lacks some of torch's dtypes)."""

    values: np.ndarray
    dtype: str


Leaf = DTensorView | TensorValue | str | None
"""What one output leaf or gradient is, for the driver: a DTensor's view, a plain tensor's
values, the repr of anything that is not a tensor, None for no gradient."""


class OpRefused(Exception):
    """The op (or its backward) raised on this rank."""


@dataclass(frozen=True)
class OpRun:
    """The op's outputs (flattened) and the gradients of its inputs, on one rank or device."""

    outputs: tuple[Leaf, ...]
    grads: tuple[Leaf, ...]
    grad_outputs: int
    """How many outputs the backward pass started from (0: no backward)."""
    backward_refused: str = ""
    """The exception of a backward pass that raised (the forward's results still stand)."""


def global_inputs(case: OpInfoCase, device: torch.device) -> list[torch.Tensor]:
    """The sample's tensors as the case lays them out: on ``device``, detached, those with a
    Partial sum or avg rounded to the significant bits their exact split leaves."""
    sample = op_db.samples(case.op, case.dtype)[case.sample]
    made = []
    for index, tensor in enumerate(op_db.tensors_of(sample)):
        value = tensor.detach().clone().to(device)
        bits = case.significand_bits(index)
        if bits is not None:
            mantissa, exponent = torch.frexp(value)
            value = torch.ldexp(torch.round(mantissa * 2.0**bits) / 2.0**bits, exponent)
        made.append(value.requires_grad_(tensor.requires_grad))
    return made


def opinfos_on_rank(ctx: RankContext, cases: tuple[OpInfoCase, ...]) -> list[OpRun]:
    """Each case in turn; an op's refusal names the case (``OpRefused: case N: ...``)."""
    runs = []
    for number, case in enumerate(cases):
        try:
            runs.append(opinfo_on_rank(ctx, case))
        except OpRefused as refused:
            raise OpRefused(f"case {number}: {refused}") from refused
    return runs


def opinfo_on_rank(ctx: RankContext, case: OpInfoCase) -> OpRun:
    mesh = ctx.mesh_of(case.mesh)
    inputs = []
    for index, value in enumerate(global_inputs(case, ctx.device)):
        placements = case.placements[index]
        piece = local.rank_tensor(ctx, partial(_piece, case, value=value, placements=placements))
        tensor = DTensor.from_local(
            piece,
            mesh,
            to_torch_placements(placements),
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
        inputs.append(tensor.detach().requires_grad_(value.requires_grad))
    return _run(
        case, inputs, lambda leaf: view_of(leaf, ctx) if isinstance(leaf, DTensor) else leaf
    )


def opinfo_on_one_device(case: OpInfoCase, device: str) -> OpRun:
    made = global_inputs(case, torch.device(device))
    inputs = [t.detach().requires_grad_(t.requires_grad) for t in made]
    return _run(case, inputs, lambda leaf: leaf)


def _run(case: OpInfoCase, inputs: list[torch.Tensor], viewed: Any) -> OpRun:
    sample = op_db.samples(case.op, case.dtype)[case.sample]
    first, args, kwargs = op_db.replaced(sample, inputs)
    try:
        out = op_db.op_info(case.op).op(first, *args, **kwargs)
    except Exception as error:
        raise OpRefused(f"forward: {type(error).__name__}: {error}") from error
    leaves = pytree.tree_leaves(out)
    outputs = tuple(_leaf(viewed(leaf)) for leaf in leaves)
    if not case.backward:
        return OpRun(outputs, (), 0)
    differentiated = pytree.tree_leaves(sample.output_process_fn_grad(out))
    started = [t for t in differentiated if isinstance(t, torch.Tensor) and t.requires_grad]
    needing = [t for t in inputs if t.requires_grad]
    if not started or not needing:
        return OpRun(outputs, (), 0)
    try:
        grads = iter(
            torch.autograd.grad(
                started,
                needing,
                [_grad_output(t, n) for n, t in enumerate(started)],
                allow_unused=True,
            )
        )
    except Exception as error:
        # Kept, not raised: the forward's results are still compared. Where only some ranks
        # raise, their peers wait in a collective until the deadline: a failure all the same.
        return OpRun(outputs, (), 0, backward_refused=f"{type(error).__name__}: {error}")
    # one entry per tensor argument, None for those that need no gradient
    per_argument = [next(grads) if t.requires_grad else None for t in inputs]
    return OpRun(outputs, tuple(_leaf(viewed(g)) for g in per_argument), len(started))


def _leaf(value: Any) -> Leaf:
    if value is None or isinstance(value, DTensorView):
        return value
    if isinstance(value, torch.Tensor):
        return TensorValue(to_numpy(value), dtype_name(value.dtype))
    return repr(value)


def _grad_output(output: torch.Tensor, number: int) -> torch.Tensor:
    """A seeded gradient for output ``number``: not all ones, so a gradient that lands on
    the wrong element shows; replicated when the output is a DTensor. Drawn by numpy: a
    simulated world would give each rank other values of torch's generator."""
    values = np.random.default_rng(1000 + number).standard_normal(tuple(output.shape))
    made = tensor_from(values, "float64", output.device).to(output.dtype)
    if not isinstance(output, DTensor):
        return made
    replicated = [Replicate()] * output.device_mesh.ndim
    return DTensor.from_local(made, output.device_mesh, replicated, run_check=False)


def _piece(
    case: OpInfoCase, rank: int, value: torch.Tensor, placements: tuple[Placement, ...]
) -> torch.Tensor:
    """What ``rank`` holds of ``value`` laid out as ``placements`` on the case's mesh."""
    coord = case.coord_of(rank)
    piece = _contribution(value.detach(), placements, case.mesh_shape, coord)
    for placement, size, c in zip(placements, case.mesh_shape, coord, strict=True):
        if isinstance(placement, Shard):
            piece = _chunk(piece, placement.dim % max(piece.dim(), 1), size, c)
    return piece.contiguous()


def _chunk(tensor: torch.Tensor, dim: int, size: int, index: int) -> torch.Tensor:
    """Piece ``index`` of ``size`` as DTensor shards: ``torch.chunk``'s pieces, then empty
    ones where chunk gives fewer than ``size``."""
    pieces = torch.chunk(tensor, size, dim)
    if index < len(pieces):
        return pieces[index]
    return tensor.narrow(dim, tensor.size(dim), 0)


def _contribution(
    value: torch.Tensor,
    placements: tuple[Placement, ...],
    mesh_shape: tuple[int, ...],
    coord: tuple[int, ...],
) -> torch.Tensor:
    """The whole-shaped tensor this coordinate contributes to ``value`` along its Partial
    axes (the value itself where there are none)."""
    partial_axes = [a for a, p in enumerate(placements) if isinstance(p, Partial)]
    if not partial_axes:
        return value
    first = placements[partial_axes[0]]
    assert isinstance(first, Partial)
    if first.reduce_op in ("sum", "avg"):
        factor = 1
        for axis in partial_axes:
            size = mesh_shape[axis]
            share = sum_shares(size)[coord[axis]]
            factor *= share * (size if first.reduce_op == "avg" else 1)
        denominator = 1
        for axis in partial_axes:
            denominator *= share_denominator(mesh_shape[axis])
        return value * factor / denominator
    flat = torch.arange(value.numel(), device=value.device).reshape(value.shape)
    holds = torch.ones(value.shape, dtype=torch.bool, device=value.device)
    for axis in partial_axes:
        holds &= extremum_holder(flat, axis, mesh_shape[axis]) == coord[axis]
    beaten = value.abs() + 1
    other = value - beaten if first.reduce_op == "max" else value + beaten
    return torch.where(holds, value, other)
