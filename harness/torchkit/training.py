"""Training steps of every data/tensor-parallel layout, shared by the suites' checks.

Every layout trains the same seeded MLP with the same optimizer on the same global batches
as ``harness.torchkit.optim.reference_run``; each data-parallel rank takes its rows of the
batch. ``parallelize`` applies a case's layout (DDP, ZeRO, fully_shard, HSDP, FSDP+TP),
``train_steps`` runs its steps, ``optimizer_for`` builds its optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from harness.cases.meshes import MeshCase
from harness.cases.training import TP_LAYOUTS, ParityCase
from harness.torchkit import comm_hooks
from harness.torchkit.context import RankContext
from harness.torchkit.ddp import ddp_kwargs
from harness.torchkit.dtensor import full_array, tensor_from
from harness.torchkit.fsdp_knobs import (
    add_forward_method,
    after_step,
    checkpointed,
    forward_of,
    layer_policies,
    micro_batch,
    root_policy,
    set_knobs,
)
from harness.torchkit.optim import (
    Trained,
    build_optimizer,
    loss_of,
    named_full_params,
    optimizer_kwargs,
    param_groups,
    rows_of,
    step_batch,
)
from harness.torchkit.schedules import build_scheduler, clip_gradients


def train_steps(
    ctx: RankContext,
    case: ParityCase,
    wrapped: nn.Module,
    optimizer: Any,
    dp_rank: int,
    *,
    full_params: Callable[[nn.Module], dict[str, np.ndarray]] | None = None,
    first_step: int = 0,
) -> Trained:
    """``case.steps`` steps of ``optimizer`` on an already parallelized model over this
    data-parallel rank's rows of each global batch (the batches of steps ``first_step``
    on); the losses and the full parameters by their unsharded names (``full_params``, by
    default DTensor or plain parameters)."""
    scheduler = build_scheduler(case.optim, optimizer)
    losses = []
    for step in range(first_step, first_step + case.steps):
        losses.append(train_step(wrapped, optimizer, case, dp_rank, step, ctx.device))
        if scheduler is not None:
            scheduler.step()
    params = (full_params or dtensor_full_params)(wrapped)
    return Trained(tuple(losses), params)


def dtensor_full_params(model: nn.Module) -> dict[str, np.ndarray]:
    """Every full parameter (a collective per DTensor) by its unsharded name."""
    return {n: full_array(p) for n, p in named_full_params(model)}


def train_step(
    wrapped: nn.Module,
    optimizer: Any,
    case: ParityCase,
    dp_rank: int,
    step: int,
    device: torch.device,
) -> float:
    """One optimizer step on this data-parallel rank's rows of batch ``step``, in
    ``case.micro_batches`` parts (the gradient sync only on the last, or on each if
    ``case.sync_each_micro_batch``), clipped as ``case.clipping`` says; its loss (the
    mean over its rows)."""
    inputs, targets = step_batch(case, step)
    rows = rows_of(case, dp_rank)
    optimizer.zero_grad()
    total = 0.0
    parts = np.array_split(np.arange(rows.start, rows.stop), case.micro_batches)
    for number, part in enumerate(parts):
        with micro_batch(wrapped, case, last=number == len(parts) - 1):
            # equal parts: the mean of the parts' means is the mean over the rows
            x = tensor_from(inputs[part], case.dtype, device)
            forward = forward_of(wrapped, case.knobs)
            output = forward(input=x) if case.knobs.keyword_input else forward(x)
            loss = loss_of(output, tensor_from(targets[part], case.dtype, device)) / len(parts)
            loss.backward()  # type: ignore[no-untyped-call]
        total += loss.item()
    clip_gradients(wrapped.parameters(), case.clipping)
    optimizer.step()
    after_step(wrapped, case)
    return total


def parallelize(
    model: nn.Sequential,
    case: ParityCase,
    ctx: RankContext,
    *,
    before_fully_shard: Callable[[nn.Sequential], None] | None = None,
    **fsdp_options: Any,
) -> tuple[nn.Module, int]:
    """Apply the layout; the module to call and this rank's data-parallel index.

    ``before_fully_shard`` is applied to the model after tensor parallelism and before
    ``fully_shard`` (compiling its blocks, say). ``fsdp_options`` go to every
    ``fully_shard`` call (``reshard_after_forward``, ``offload_policy``,
    ``shard_placement_fn``)."""
    if case.layout in ("ddp", "zero"):
        options = dict(case.wrapper_options)
        if options.get("init_sync", True):
            _start_apart(model, ctx.rank)
        ddp = DistributedDataParallel(model, **ddp_kwargs(model, options, ctx))
        comm_hooks.register(ddp, case.comm_hook)
        return ddp, ctx.rank
    if case.layout in TP_LAYOUTS:
        return model, _tensor_parallel(model, case, ctx, fsdp_options, before_fully_shard)
    names = ("replicate", "shard") if case.layout == "hsdp" else None
    flatten = case.knobs.flatten
    mesh = (
        ctx.mesh_of(MeshCase(parent=flatten, how="flattened", axes=(0, 1)))
        if flatten is not None
        else ctx.mesh(case.mesh_shape, names)
    )
    if before_fully_shard is not None:
        before_fully_shard(model)
    _fully_shard(model, case, mesh, fsdp_options)
    return model, ctx.rank


def _start_apart(model: nn.Module, rank: int) -> None:
    """Shift every parameter of ranks other than 0: DDP's constructor must broadcast rank
    0's parameters, so training still starts from the one-device model (the caller skips
    it where ``init_sync=False``: the seeded model then starts equal on every rank, as
    DDP's docs require)."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(rank)


def _tensor_parallel(
    model: nn.Sequential,
    case: ParityCase,
    ctx: RankContext,
    options: dict[str, Any],
    before_fully_shard: Callable[[nn.Sequential], None] | None,
) -> int:
    """Colwise/Rowwise over the last mesh axis, fully_shard over the others (1-D for
    fsdp_tp, (replicate, shard) for hsdp_tp); this rank's data-parallel index (the mesh is
    row-major with tp last)."""
    if case.layout == "fsdp_tp":
        mesh = ctx.mesh(case.mesh_shape, ("dp", "tp"))
        dp_mesh = mesh["dp"]
    else:
        mesh = ctx.mesh(case.mesh_shape, ("replicate", "shard", "tp"))
        dp_mesh = mesh["replicate", "shard"]
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if before_fully_shard is not None:
        before_fully_shard(model)
    _fully_shard(model, case, dp_mesh, options)
    return ctx.rank // case.mesh_shape[-1]


def _fully_shard(
    model: nn.Sequential, case: ParityCase, mesh: Any, options: dict[str, Any]
) -> None:
    """Each Linear (checkpointed when the case says so), then the root, with the case's
    policies, options and knobs."""
    options = {**dict(case.wrapper_options), **options}
    if case.knobs.reshard_to is not None:
        options["reshard_after_forward"] = case.knobs.reshard_to
    layers = checkpointed(model, case.knobs)
    add_forward_method(model, case.knobs)
    for layer, policy in zip(layers, layer_policies(case, len(layers)), strict=True):
        fully_shard(layer, mesh=mesh, mp_policy=policy, **options)
    fully_shard(model, mesh=mesh, mp_policy=root_policy(case), **options)
    set_knobs(model, layers, case.knobs)


def optimizer_for(model: nn.Module, case: ParityCase) -> Any:
    """The configured optimizer over ``model``'s parameters (ZeRO's for the zero layout)."""
    groups = param_groups(model, case.optim)
    if case.layout != "zero":
        return build_optimizer(case.optim, groups)
    optimizer_class = getattr(torch.optim, case.optim.name)
    kwargs = optimizer_kwargs(case.optim)
    return ZeroRedundancyOptimizer(groups, optimizer_class=optimizer_class, **kwargs)


def data_parallel_ranks(case: ParityCase) -> list[int]:
    """One rank per data-parallel index: they hold the distinct losses."""
    if case.layout in TP_LAYOUTS:
        return [d * case.mesh_shape[-1] for d in range(case.data_parallel)]
    return list(range(case.data_parallel))
