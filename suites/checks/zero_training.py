"""Rank functions that train MLPs with ZeroRedundancyOptimizer against a local optimizer:
parameter groups, a subgroup, DDP with state-dict cross-loading, Join, DDP overlap hooks."""

from __future__ import annotations

import copy
import functools
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import (
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
)
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from harness import RankContext
from harness.cases.training import JoinCase, OverlapCase, ParityCase
from harness.torchkit import devices
from harness.torchkit.dtensor import tensor_from, to_numpy
from harness.torchkit.models import build_mlp
from harness.torchkit.optim import build_optimizer, loss_of, param_groups
from suites.checks.zero import optimizer_class


def _params(model: nn.Module) -> list[np.ndarray]:
    return [to_numpy(p) for p in model.parameters()]


def _batch(
    case: Any, step: int, rank: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded inputs and targets of ``rank`` at ``step`` (every rank its own)."""
    rng = np.random.default_rng([case.seed, step, rank])
    x = rng.uniform(-1.0, 1.0, size=(2, case.dims[0]))
    y = rng.uniform(-1.0, 1.0, size=(2, case.dims[-1]))
    return tensor_from(x, case.dtype, device), tensor_from(y, case.dtype, device)


def groups_three_ways_on_rank(ctx: RankContext, case: ParityCase) -> list[list[list[np.ndarray]]]:
    """The same data on every rank, three optimizers: ZeRO with both parameter groups up
    front, ZeRO given the second group afterwards, and the local optimizer. Parameters of
    each after every step."""
    models = [build_mlp(case, ctx.device) for _ in range(3)]
    upfront = ZeroRedundancyOptimizer(
        param_groups(models[0], case.optim),
        optimizer_class=optimizer_class(case.optim),
        **case.optim.kwargs(),
    )
    first, *rest = param_groups(models[1], case.optim)
    added = ZeroRedundancyOptimizer(
        first["params"], optimizer_class=optimizer_class(case.optim), **case.optim.kwargs()
    )
    for group in rest:
        added.add_param_group(group)
    local = build_optimizer(case.optim, param_groups(models[2], case.optim))
    history: list[list[list[np.ndarray]]] = []
    for step in range(case.steps):
        x, y = _batch(case, step, 0, ctx.device)
        for model, optimizer in zip(models, (upfront, added, local), strict=True):
            optimizer.zero_grad()
            loss_of(model(x), y).backward()
            optimizer.step()
        history.append([_params(m) for m in models])
    return history


def subgroup_on_rank(ctx: RankContext, case: ParityCase) -> list[np.ndarray] | None:
    """ZeRO over the even ranks only (group ranks differ from global ranks); the same data
    on each of them. Parameters after training, or None on the odd ranks."""
    members = list(range(0, ctx.world_size, 2))
    group = dist.new_group(ranks=members)
    if ctx.rank not in members:
        return None
    model = build_mlp(case, ctx.device)
    zero = ZeroRedundancyOptimizer(
        param_groups(model, case.optim),
        optimizer_class=optimizer_class(case.optim),
        process_group=group,
        **case.optim.kwargs(),
    )
    for step in range(case.steps):
        x, y = _batch(case, step, 0, ctx.device)
        zero.zero_grad()
        loss_of(model(x), y).backward()
        zero.step()
    return _params(model)


def local_reference(case: ParityCase) -> list[np.ndarray]:
    """The same training as ``subgroup_on_rank`` with the local optimizer on one device."""
    device = torch.device("cpu")
    model = build_mlp(case, device)
    optimizer = build_optimizer(case.optim, param_groups(model, case.optim))
    for step in range(case.steps):
        x, y = _batch(case, step, 0, device)
        optimizer.zero_grad()
        loss_of(model(x), y).backward()
        optimizer.step()
    return _params(model)


def ddp_cross_load_on_rank(ctx: RankContext, case: ParityCase) -> list[dict[str, Any]]:
    """DDP + ZeRO against DDP + the local optimizer, each rank its own data; in the second
    half of the steps the first parameter's ``requires_grad`` toggles; at the end each
    optimizer loads the other's state dict for a step, then its own again for a step. The
    losses and both models' parameters after every step."""
    sharded_model = build_mlp(case, ctx.device)
    local_model = copy.deepcopy(sharded_model)
    sharded = DistributedDataParallel(sharded_model, find_unused_parameters=True)
    local = DistributedDataParallel(local_model, find_unused_parameters=True)
    zero = ZeroRedundancyOptimizer(
        sharded_model.parameters(),
        optimizer_class=optimizer_class(case.optim),
        **case.optim.kwargs(),
    )
    plain = build_optimizer(case.optim, [{"params": list(local_model.parameters())}])
    steps: list[dict[str, Any]] = []

    def step(index: int) -> None:
        x, y = _batch(case, index, ctx.rank, ctx.device)
        losses = []
        for model, optimizer in ((sharded, zero), (local, plain)):
            optimizer.zero_grad()
            loss = loss_of(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        steps.append(
            {"losses": losses, "sharded": _params(sharded_model), "local": _params(local_model)}
        )

    for index in range(case.steps):
        step(index)
        if index >= case.steps // 2:
            for model in (sharded_model, local_model):
                next(model.parameters()).requires_grad_(bool(index % 2))
    own_local = copy.deepcopy(plain.state_dict())
    zero.consolidate_state_dict(to=0)
    shared = [zero.state_dict() if ctx.rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    own_zero = shared[0]
    assert own_zero is not None, "broadcast from rank 0, which holds the state"
    # Copies: ZeRO.load_state_dict empties other ranks' entries of its argument in place
    # (spec zero.load_state_dict.keeps_argument).
    plain.load_state_dict(copy.deepcopy(own_zero))
    zero.load_state_dict(copy.deepcopy(own_local))
    step(case.steps)
    plain.load_state_dict(copy.deepcopy(own_local))
    zero.load_state_dict(copy.deepcopy(own_zero))
    step(case.steps + 1)
    return steps


# --- Join with uneven inputs -------------------------------------------------------------


class _GradientSetter(Joinable):
    """After a rank joins, keeps setting the gradients the last rank recorded, so ZeRO's
    own join hook steps with them (upstream's test does the same)."""

    def __init__(self, zero: ZeroRedundancyOptimizer, grads: list[list[torch.Tensor]]) -> None:
        super().__init__()
        self.zero, self.grads, self.index = zero, grads, 0
        self.params = [p for group in zero.param_groups for p in group["params"]]

    def join_hook(self, **kwargs: Any) -> JoinHook:
        setter = self

        class SetGrads(JoinHook):
            def main_hook(self) -> None:
                for param, grad in zip(setter.params, setter.grads[setter.index], strict=True):
                    param.grad = grad.detach().clone()
                setter.index += 1

        return SetGrads()

    @property
    def join_device(self) -> torch.device:
        device: torch.device = self.params[0].device
        return device

    @property
    def join_process_group(self) -> Any:
        return dist.group.WORLD


def join_on_rank(
    ctx: RankContext, case: JoinCase
) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
    """Rank r has ``inputs + r`` batches. DDP with Adam under ``ddp.join()`` records, on the
    last rank, the gradients and parameters of every iteration; ZeRO under ``Join`` then
    steps with those gradients. (ZeRO parameters, DDP parameters) at every iteration."""
    model = build_mlp(case, ctx.device)
    zero_model = copy.deepcopy(model)
    ddp = DistributedDataParallel(model)
    local = torch.optim.Adam(ddp.parameters(), lr=case.lr)
    zero = ZeroRedundancyOptimizer(zero_model.parameters(), torch.optim.Adam, lr=case.lr)
    batches = [_batch(case, i, ctx.rank, ctx.device) for i in range(case.inputs + ctx.rank)]
    last = ctx.world_size - 1
    grads, params = [], []
    with ddp.join():
        for _ in range(case.epochs):
            for x, y in batches:
                loss_of(ddp(x), y).backward()
                if ctx.rank == last:
                    grads.append([p.grad.detach().clone() for p in ddp.parameters()])  # type: ignore[union-attr]
                local.step()
                if ctx.rank == last:
                    params.append([p.detach().clone() for p in ddp.parameters()])
    shared = [(grads, params)]
    dist.broadcast_object_list(shared, src=last)
    grads, params = shared[0]
    after_join = case.epochs * (ctx.world_size - ctx.rank - 1)
    setter = _GradientSetter(zero, grads[len(grads) - after_join :])
    seen = []
    with Join([setter, zero]):
        iteration = 0
        for _ in range(case.epochs):
            for _batch_pair in batches:
                Join.notify_join_context(setter)
                for param, grad in zip(zero_model.parameters(), grads[iteration], strict=True):
                    param.grad = grad.detach().clone()
                zero.step()
                seen.append((_params(zero_model), [to_numpy(p) for p in params[iteration]]))
                iteration += 1
    return seen


# --- DDP communication hooks stepping ZeRO -------------------------------------------------


def overlap_on_rank(
    ctx: RankContext, case: OverlapCase
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """DDP whose communication hook runs ZeRO's step (``hook_with_zero_step`` or the
    interleaved one) against DDP with a local SGD, the same inputs on every rank.
    (parameters before, overlapped parameters after, local parameters after)."""
    lr, momentum, decay = 0.01, 0.9, 0.001
    model = build_mlp(case, ctx.device)
    before = _params(model)
    views = case.gradient_as_bucket_view
    overlapped = DistributedDataParallel(copy.deepcopy(model), gradient_as_bucket_view=views)
    local = DistributedDataParallel(copy.deepcopy(model), gradient_as_bucket_view=views)
    if case.static_graph:
        overlapped._set_static_graph()
        local._set_static_graph()
    zero = ZeroRedundancyOptimizer(
        overlapped.parameters(),
        optimizer_class=torch.optim.SGD,
        overlap_with_ddp=True,
        lr=lr,
        momentum=momentum,
        weight_decay=decay,
    )
    hook = hook_with_zero_step_interleaved if case.interleaved else hook_with_zero_step
    overlapped.register_comm_hook(
        None, hook(allreduce_hook, overlapped, zero, shard_buckets=case.shard_buckets)
    )
    sgd = torch.optim.SGD(local.parameters(), lr=lr, momentum=momentum, weight_decay=decay)
    inputs = [_batch(case, i, 0, ctx.device)[0] for i in range(case.inputs)]
    warmup = 3 if case.static_graph else 2  # buckets must be rebuilt before ZeRO steps
    for index in range(warmup):
        overlapped(inputs[index % len(inputs)]).sum().backward()
    for x in inputs:
        zero.zero_grad()
        overlapped(x).sum().backward()
    for x in inputs:
        sgd.zero_grad()
        local(x).sum().backward()
        sgd.step()
    dist.barrier()
    return before, _params(overlapped.module), _params(local.module)


# --- model parallel across two GPUs per rank ----------------------------------------------


class _TwoDevices(nn.Module):
    """Linear, ReLU, Linear with the layers on two devices."""

    def __init__(self, local: nn.Sequential, first: torch.device, second: torch.device) -> None:
        super().__init__()
        self.first, self.second = first, second
        self.net0 = copy.deepcopy(local[0]).to(first)
        self.net1 = copy.deepcopy(local[2]).to(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.net0(x.to(self.first)))
        out: torch.Tensor = self.net1(hidden.to(self.second))
        return out


def _abs_sum_loss(model: nn.Module, optimizer: Any, x: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad()
    loss: torch.Tensor = model(x).abs().sum()
    loss.backward()
    return loss


def model_parallel_on_rank(
    ctx: RankContext, case: JoinCase
) -> list[tuple[float, float, list[np.ndarray], list[np.ndarray]]]:
    """Rank r splits the model over accelerator devices 2r and 2r+1; DDP + ZeRO(Adam) against
    a local model with Adam on device 2r. (loss, local loss, parameters, local parameters)
    per step."""
    kind = devices.accelerator_type()
    first, second = torch.device(kind, 2 * ctx.rank), torch.device(kind, 2 * ctx.rank + 1)
    dims = (*case.dims[:2], case.dims[-1])
    spec = JoinCase(dims, case.inputs, case.epochs, case.lr, case.seed, dtype="float32")
    local = build_mlp(spec, first)
    split = DistributedDataParallel(_TwoDevices(local, first, second))
    zero = ZeroRedundancyOptimizer(split.parameters(), optimizer_class=torch.optim.Adam, lr=case.lr)
    adam = torch.optim.Adam(local.parameters(), lr=case.lr)
    steps = []
    for epoch in range(case.epochs):
        for index in range(case.inputs):
            x, _ = _batch(spec, epoch * case.inputs + index, 0, first)
            loss = zero.step(closure=functools.partial(_abs_sum_loss, split, zero, x))  # type: ignore[arg-type]
            local_loss = adam.step(closure=functools.partial(_abs_sum_loss, local, adam, x))
            steps.append((float(loss), float(local_loss), _params(split.module), _params(local)))
    return steps
