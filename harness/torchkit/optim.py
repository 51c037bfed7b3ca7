"""Optimizers from an ``OptimConfig``, and the single-device reference training loop.

The reference is the library's own single-device implementation: the same model, the same
``torch.optim`` optimizer and the *global* batch on one device (CUDA when present: the
library's own CUDA kernels, foreach and fused; else CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from harness.cases.knobs import Precision
from harness.cases.training import OptimConfig, ParityCase
from harness.torchkit import devices
from harness.torchkit.checkpointing import WRAPPED_ATTRIBUTE
from harness.torchkit.dtensor import tensor_from, to_numpy, torch_dtype
from harness.torchkit.models import build_mlp
from harness.torchkit.schedules import build_scheduler, clip_gradients


def param_groups(model: nn.Module, config: OptimConfig) -> list[dict[str, Any]]:
    """One group, or two when ``config.second_group`` is set and the model has more than
    one layer: the last Linear's parameters get the second group's hyper-parameters."""
    named = list(model.named_parameters())
    last = _last_linear_prefix(named)
    rest = [p for n, p in named if not n.startswith(last)]
    tail = [p for n, p in named if n.startswith(last)]
    if config.second_group is None or not rest or not tail:
        return [{"params": [p for _, p in named]}]
    return [{"params": rest}, {"params": tail, **dict(config.second_group)}]


def _last_linear_prefix(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    last_weight = [n for n, p in named if n.endswith("weight")][-1]
    return last_weight.removesuffix("weight")


def optimizer_kwargs(config: OptimConfig) -> dict[str, Any]:
    """The constructor's keyword arguments, the lr a 0-d tensor where the config says so."""
    kwargs = config.kwargs()
    if config.tensor_lr:
        kwargs["lr"] = torch.tensor(config.lr)
    return kwargs


def build_optimizer(config: OptimConfig, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    cls = getattr(torch.optim, config.name)
    optimizer: torch.optim.Optimizer = cls(groups, **optimizer_kwargs(config))
    return optimizer


def step_batch(case: ParityCase, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets of the global batch of ``step``; data-parallel rank ``d`` trains on
    rows ``d*b:(d+1)*b``."""
    rng = np.random.default_rng([case.seed, step])
    rows = case.data_parallel * case.batch_per_rank
    return (
        rng.uniform(-1.0, 1.0, size=(rows, case.dims[0])),
        rng.uniform(-1.0, 1.0, size=(rows, case.dims[-1])),
    )


def rows_of(case: ParityCase, dp_rank: int) -> slice:
    return slice(dp_rank * case.batch_per_rank, (dp_rank + 1) * case.batch_per_rank)


@dataclass(frozen=True)
class Trained:
    """What a training run produced: the loss of every step and the final parameters."""

    losses: tuple[float, ...]
    params: dict[str, np.ndarray]


def loss_of(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, targets.to(output.dtype))


def reference_device() -> torch.device:
    """The accelerator this torch sees, else the CPU."""
    return torch.device(devices.accelerator_type())


def describe_reference(case: ParityCase) -> str:
    """Which single-device implementation the reference ran (goes into the record)."""
    device = reference_device()
    return f"{device.type}: torch.optim.{case.optim.name}({case.optim.impl})"


ModelBuilder = Callable[[ParityCase, torch.device], nn.Module]


def reference_run(case: ParityCase, build: ModelBuilder = build_mlp) -> Trained:
    """The same training on one device over the global batch (see the module docstring) of
    the model ``build`` makes; gradients multiplied by ``case.gradient_scale`` (a divide
    factor's effect)."""
    device = reference_device()
    model = build(case, device)
    optimizer = build_optimizer(case.optim, param_groups(model, case.optim))
    scheduler = build_scheduler(case.optim, optimizer)
    losses = []
    for step in range(case.steps):
        inputs, targets = step_batch(case, step)
        optimizer.zero_grad()
        if case.precision is not None:
            losses.append(_mixed_precision_grads(model, case, inputs, targets, build))
        else:
            x, y = tensor_from(inputs, case.dtype, device), tensor_from(targets, case.dtype, device)
            loss = loss_of(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            losses.append(loss.item())
            _scale_grads(model, case.gradient_scale)
        clip_gradients(model.parameters(), case.clipping)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return Trained(tuple(losses), {n: to_numpy(p) for n, p in model.named_parameters()})


def _scale_grads(model: nn.Module, scale: float) -> None:
    if scale != 1.0:
        for param in model.parameters():
            assert param.grad is not None
            param.grad.mul_(scale)


def _mixed_precision_grads(
    model: nn.Module,
    case: ParityCase,
    inputs: np.ndarray,
    targets: np.ndarray,
    build: ModelBuilder,
) -> float:
    """What FSDP's mixed-precision policies compute, on one device: each data-parallel
    rank's forward and backward of each micro-batch on a copy of the parameters, each Linear
    in its own compute dtype (casting its input to it), the model's inputs cast to the
    root's dtype where it casts them (``cast_forward_inputs``) and its output to the root's
    output dtype; each micro-batch's gradients cast to the reduce dtype, then reduced as
    FSDP reduces them: summed across ranks and divided by the divide factor (the
    data-parallel size by default) after each micro-batch where the Linears sync each
    (``reduces_each_micro_batch``) and accumulated, else accumulated per rank and reduced
    once, onto the parameters. Returns the mean of the ranks' losses (as the driver averages
    the ranks' own)."""
    precision = case.precision
    assert precision is not None
    device = next(model.parameters()).device
    reduce_dtype = torch_dtype(precision.reduce_dtype)
    per_rank: list[list[torch.Tensor]] = []
    losses = []
    for dp_rank in range(case.data_parallel):
        replica = build(case, device)
        replica.load_state_dict(model.state_dict())
        rows = rows_of(case, dp_rank)
        loss_sum = 0.0
        per_rank.append([])
        parts = np.array_split(np.arange(rows.start, rows.stop), case.micro_batches)
        for part in parts:
            x = tensor_from(inputs[part], case.dtype, device)
            output = _cast_forward(replica, precision, x)
            loss = loss_of(output, tensor_from(targets[part], case.dtype, device)) / len(parts)
            loss.backward()  # type: ignore[no-untyped-call]
            grads = torch.cat([p.grad.to(reduce_dtype).flatten() for p in replica.parameters()])  # type: ignore[union-attr]
            per_rank[-1].append(grads)
            replica.zero_grad(set_to_none=True)
            loss_sum += loss.item()
        losses.append(loss_sum)
    factor = case.knobs.divide_factor or case.data_parallel
    if reduces_each_micro_batch(case):
        reduced = [_reduced(list(micro), case) / factor for micro in zip(*per_rank, strict=True)]
        _set_flat_grads(model, _summed(reduced))
    else:
        _set_flat_grads(model, _reduced([_summed(grads) for grads in per_rank], case) / factor)
    return sum(losses) / len(losses)


def _reduced(by_rank: list[torch.Tensor], case: ParityCase) -> torch.Tensor:
    """The data-parallel ranks' sum in FSDP's order: HSDP reduce-scatters within each
    replica's shard group, then all-reduces the replicas' sums; one flat sum otherwise."""
    size = case.shard_size
    if case.layout != "hsdp" or size == len(by_rank):
        return _summed(by_rank)
    replicas = [by_rank[at : at + size] for at in range(0, len(by_rank), size)]
    return _summed([_summed(replica) for replica in replicas])


def reduces_each_micro_batch(case: ParityCase) -> bool:
    """Whether fully_shard's Linears reduce-scatter after every micro-batch: the case syncs
    each, or holds the sync with ``recurse=False`` (on the root's own group only)."""
    return case.micro_batches > 1 and (case.sync_each_micro_batch or not case.knobs.recurse)


def _summed(tensors: list[torch.Tensor]) -> torch.Tensor:
    total = tensors[0]
    for tensor in tensors[1:]:
        total = total + tensor
    return total


def _cast_forward(replica: nn.Module, precision: Precision, x: torch.Tensor) -> torch.Tensor:
    if precision.input_dtype is not None:
        x = x.to(torch_dtype(precision.input_dtype))
    dtypes = iter(precision.layer_dtypes)
    for layer in replica.children():
        if isinstance(layer, nn.Linear):
            dtype = torch_dtype(next(dtypes))
            layer.to(dtype)
            x = x.to(dtype)
        x = layer(x)
    if precision.output_dtype is not None:
        x = x.to(torch_dtype(precision.output_dtype))
    return x


def _set_flat_grads(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for param in model.parameters():
        count = param.numel()
        param.grad = flat[offset : offset + count].view_as(param).to(param.dtype)
        offset += count


CHECKPOINT_PREFIX = f"{WRAPPED_ATTRIBUTE}."
"""What a checkpointing wrapper puts into the names of the parameters it wraps."""


def named_full_params(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters by the unsharded model's names (DDP's ``module.`` prefix and
    ``checkpoint_wrapper``'s removed)."""
    for name, param in model.named_parameters():
        yield name.removeprefix("module.").replace(CHECKPOINT_PREFIX, ""), param
