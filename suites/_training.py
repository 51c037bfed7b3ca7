"""Rank functions that train an MLP under each data/tensor-parallel layout.

Every layout trains the same seeded MLP with the same optimizer on the same global batches
as ``harness.optim.reference_run``; each data-parallel rank takes its rows of the batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from harness.cases import TP_LAYOUTS, ParityCase
from harness.context import RankContext
from harness.dtensor import tensor_from, to_numpy
from harness.models import Centering, build_centered_mlp, build_mlp
from harness.optim import (
    Trained,
    build_optimizer,
    build_scheduler,
    loss_of,
    named_full_params,
    param_groups,
    rows_of,
    step_batch,
)
from harness.parity import assert_close, assert_equal_values


def train_on_rank(ctx: RankContext, case: ParityCase) -> Trained:
    """Train under ``case.layout``; this rank's losses and every full parameter."""
    model = build_mlp(case, ctx.device)
    wrapped, dp_rank = parallelize(model, case, ctx)
    return train_steps(ctx, case, wrapped, optimizer_for(model, case), dp_rank)


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
    return {n: _full(p) for n, p in named_full_params(model)}


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
    ``case.sync_each_micro_batch``), clipped to ``case.clip_norm`` when set; its loss (the
    mean over its rows)."""
    inputs, targets = step_batch(case, step)
    rows = rows_of(case, dp_rank)
    optimizer.zero_grad()
    total = 0.0
    parts = np.array_split(np.arange(rows.start, rows.stop), case.micro_batches)
    for number, part in enumerate(parts):
        with _gradient_sync(wrapped, case.sync_each_micro_batch or number == len(parts) - 1):
            # equal parts: the mean of the parts' means is the mean over the rows
            loss = loss_of(
                wrapped(tensor_from(inputs[part], case.dtype, device)),
                tensor_from(targets[part], case.dtype, device),
            ) / len(parts)
            loss.backward()
        total += loss.item()
    if case.clip_norm is not None:
        torch.nn.utils.clip_grad_norm_(
            wrapped.parameters(), case.clip_norm, norm_type=case.clip_norm_type
        )
    optimizer.step()
    return total


@contextlib.contextmanager
def _gradient_sync(wrapped: nn.Module, enabled: bool) -> Iterator[None]:
    """Within it, fully_shard and DDP modules sync gradients across data-parallel ranks only
    if ``enabled`` (anything else syncs every time, which sums the same gradients)."""
    if isinstance(wrapped, FSDPModule):
        wrapped.set_requires_gradient_sync(enabled)
        yield
    elif isinstance(wrapped, DistributedDataParallel) and not enabled:
        with wrapped.no_sync():
            yield
    else:
        yield


def _full(param: torch.Tensor) -> Any:
    """The whole parameter on every rank (a collective for a DTensor)."""
    return to_numpy(param.full_tensor() if isinstance(param, DTensor) else param)


def parallelize(
    model: nn.Sequential, case: ParityCase, ctx: RankContext, **fsdp_options: Any
) -> tuple[nn.Module, int]:
    """Apply the layout; the module to call and this rank's data-parallel index.

    ``fsdp_options`` go to every ``fully_shard`` call (``reshard_after_forward``,
    ``offload_policy``, ``shard_placement_fn``)."""
    if case.layout in ("ddp", "zero"):
        _start_apart(model, ctx.rank)
        return DistributedDataParallel(model, **dict(case.wrapper_options)), ctx.rank
    if case.layout in TP_LAYOUTS:
        return model, _tensor_parallel(model, case, ctx, fsdp_options)
    names = ("replicate", "shard") if case.layout == "hsdp" else None
    _fully_shard(model, case, ctx.mesh(case.mesh_shape, names), fsdp_options)
    return model, ctx.rank


def _start_apart(model: nn.Module, rank: int) -> None:
    """Shift every parameter of ranks other than 0: DDP's constructor must broadcast rank
    0's parameters, so training still starts from the one-device model."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(rank)


def _tensor_parallel(
    model: nn.Sequential, case: ParityCase, ctx: RankContext, options: dict[str, Any]
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
    _fully_shard(model, case, dp_mesh, options)
    return ctx.rank // case.mesh_shape[-1]


def _fully_shard(
    model: nn.Sequential, case: ParityCase, mesh: Any, options: dict[str, Any]
) -> None:
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if case.mixed_precision
        else MixedPrecisionPolicy()
    )
    options = {**dict(case.wrapper_options), **options}
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy, **options)
    fully_shard(model, mesh=mesh, mp_policy=policy, **options)


def optimizer_for(model: nn.Module, case: ParityCase) -> Any:
    """The configured optimizer over ``model``'s parameters (ZeRO's for the zero layout)."""
    groups = param_groups(model, case.optim)
    if case.layout != "zero":
        return build_optimizer(case.optim, groups)
    optimizer_class = getattr(torch.optim, case.optim.name)
    return ZeroRedundancyOptimizer(groups, optimizer_class=optimizer_class, **case.optim.kwargs())


def data_parallel_ranks(case: ParityCase) -> list[int]:
    """One rank per data-parallel index: they hold the distinct losses."""
    if case.layout in TP_LAYOUTS:
        return [d * case.mesh_shape[-1] for d in range(case.data_parallel)]
    return list(range(case.data_parallel))


def assert_trained_like(
    reference: Trained,
    trained: list[Trained],
    case: ParityCase,
    *,
    rtol: float,
    atol: float,
    why: str,
) -> None:
    """Every step's loss (the mean over data-parallel ranks) and every rank's final
    parameters equal the single-device reference within ``rtol``/``atol`` (``why``)."""
    call = case.call()
    for step, expected in enumerate(reference.losses):
        losses = [trained[r].losses[step] for r in data_parallel_ranks(case)]
        assert_close(
            np.array(sum(losses) / len(losses)),
            np.array(expected),
            rtol=rtol,
            atol=atol,
            dtype=case.dtype,
            what=f"loss of step {step}",
            why=why,
            call=call,
            record_as=f"loss/{case.dtype}",
        )
    for rank, result in enumerate(trained):
        _assert_same_params(result, reference, case, rank, "", rtol, atol, why, call)


def assert_same_training(
    got: list[Trained],
    want: list[Trained],
    case: ParityCase,
    *,
    rtol: float,
    atol: float,
    why: str,
    against: str,
    call: str,
) -> None:
    """Rank by rank, the same losses at every step and the same final parameters as
    ``want`` (another layout trained on the same rows: ``against``)."""
    for rank, (result, expected) in enumerate(zip(got, want, strict=True)):
        assert_close(
            np.array(result.losses),
            np.array(expected.losses),
            rtol=rtol,
            atol=atol,
            dtype=case.dtype,
            what=f"losses on rank {rank} (against {against})",
            why=why,
            call=call,
            record_as=f"loss/{case.dtype}",
        )
        suffix = f" (against {against})"
        _assert_same_params(result, expected, case, rank, suffix, rtol, atol, why, call)


def _assert_same_params(
    result: Trained,
    expected: Trained,
    case: ParityCase,
    rank: int,
    suffix: str,
    rtol: float,
    atol: float,
    why: str,
    call: str,
) -> None:
    """The same parameter names as ``expected`` and each final parameter close to it."""
    assert_equal_values(
        sorted(result.params), sorted(expected.params), what=f"parameter names on rank {rank}"
    )
    for name, value in expected.params.items():
        assert_close(
            result.params[name],
            value,
            rtol=rtol,
            atol=atol,
            dtype=case.dtype,
            what=f"{name} after {case.steps} step(s) on rank {rank}{suffix}",
            why=why,
            call=call,
            record_as=f"param/{case.dtype}",
        )


def ddp_forward_buffers_on_rank(ctx: RankContext, case: ParityCase) -> list[np.ndarray]:
    """Train ``case.steps`` steps of a centered MLP under DistributedDataParallel (each rank
    starting from buffers of its own); the running buffer at the start of every forward."""
    model = build_centered_mlp(case, ctx.device)
    centering = model[0]
    assert isinstance(centering, Centering)
    with torch.no_grad():
        centering.center.add_(ctx.rank)
    wrapped, dp_rank = parallelize(model, case, ctx)
    seen: list[np.ndarray] = []
    model.register_forward_pre_hook(lambda module, args: seen.append(to_numpy(centering.center)))
    optimizer = optimizer_for(model, case)
    for step in range(case.steps):
        train_step(wrapped, optimizer, case, dp_rank, step, ctx.device)
    return seen
