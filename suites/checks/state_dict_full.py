"""Rank functions of the state-dict suite for torch.distributed.checkpoint.state_dict's
get/set functions (full and sharded, model and optimizer), CPU offload and HSDP groups."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from harness import RankContext
from harness.cases.state_dict import StateDictCase
from harness.cases.training import ParityCase
from harness.errors import check_one_of
from harness.torchkit.dtensor import to_numpy, torch_dtype
from harness.torchkit.models import build_mlp
from harness.torchkit.training import optimizer_for, parallelize, train_step
from suites.checks.state_dict import (
    FullState,
    LoadedStates,
    Sharded,
    _full,
    build,
    fresh_training,
    full_state,
    loaded_states,
)

FULL = StateDictOptions(full_state_dict=True)
FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)
FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
SET_FULL = ("full", "broadcast", "broadcast_joint", "module_load")
"""How a full state dict goes back in (see ``set_full_on_rank``)."""


def trained(ctx: RankContext, case: StateDictCase) -> Sharded:
    sharded = build(ctx, case)
    sharded.train(ctx, 0, case.train.steps)
    return sharded


def _tensors(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every tensor in a nested state dict, by path."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in _tensors(v, f"{path}[{k!r}]")]
    if isinstance(value, list | tuple):
        return [t for i, v in enumerate(value) for t in _tensors(v, f"{path}[{i}]")]
    return []


def plain(value: Any) -> Any:
    """Tensors as numpy (DTensors gathered), containers kept: comparable in the driver."""
    if isinstance(value, torch.Tensor):
        return _full(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    return value


def copied(value: Any) -> Any:
    """A state dict with every tensor copied, as saving and loading it would. Set in memory,
    it would alias the original's tensors (Optimizer.load_state_dict keeps the tensors it is
    given), and the original's next step would move the fresh optimizer's state too."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: copied(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(copied(v) for v in value)
    return value


# --- full state dict --------------------------------------------------------------------


def gather_on_rank(
    ctx: RankContext, case: StateDictCase
) -> tuple[list[str], dict[str, Any], set[str]]:
    """Upstream's rank-0 full state dict: ``full_tensor()`` of every sharded state-dict value
    on every rank, kept (on CPU) by rank 0 only. (keys, values, devices of what is kept)."""
    sharded = build(ctx, case)
    kept: dict[str, torch.Tensor] = {}
    values = {}
    for key, value in sharded.model.state_dict().items():
        full = value.full_tensor()
        values[key] = to_numpy(full)
        if ctx.rank == 0:
            kept[key] = full.cpu()
    return list(values), values, {t.device.type for t in kept.values()}


@dataclass(frozen=True)
class FullView:
    """What ``get_state_dict(full_state_dict=True, cpu_offload=True)`` gave one rank, against
    the state read from the model and optimizer themselves."""

    model: dict[str, Any]
    optim: dict[str, Any]
    kinds: set[tuple[str, str]]
    """(type, device) of every tensor in both dicts."""
    expected: FullState


def full_get_on_rank(ctx: RankContext, case: StateDictCase) -> FullView:
    sharded = trained(ctx, case)
    model_sd, optim_sd = get_state_dict(sharded.model, sharded.optimizer, options=FULL_ON_CPU)
    kinds = {(type(t).__name__, t.device.type) for _, t in _tensors([model_sd, optim_sd])}
    return FullView(
        plain(model_sd), plain(optim_sd), kinds, full_state(sharded.model, sharded.optimizer)
    )


def set_full_on_rank(ctx: RankContext, case: StateDictCase, how: str) -> LoadedStates:
    """A full state dict of a trained model and optimizer set into fresh ones:

    - ``full``: every rank holds it, ``set_state_dict(full_state_dict=True)``;
    - ``broadcast``: rank 0 holds it (others empty dicts), ``set_model_state_dict`` and
      ``set_optimizer_state_dict`` with ``broadcast_from_rank0=True``;
    - ``broadcast_joint``: the same with one ``set_state_dict`` call;
    - ``module_load``: every rank holds it, the model's own ``load_state_dict`` (the
      optimizer's through ``set_optimizer_state_dict``).

    The states as ``loaded_states`` gives them."""
    check_one_of("how", how, SET_FULL)
    original = trained(ctx, case)
    every_rank = how in ("full", "module_load")
    taking, setting = (FULL, FULL) if every_rank else (FULL_ON_CPU, FROM_RANK0)
    model_sd, optim_sd = copied(get_state_dict(original.model, original.optimizer, options=taking))
    fresh = build(ctx, case, fresh=True)
    if how in ("full", "broadcast_joint"):  # one set_state_dict call
        set_state_dict(
            fresh.model,
            fresh.optimizer,
            model_state_dict=model_sd,
            optim_state_dict=optim_sd,
            options=setting,
        )
    else:
        if how == "broadcast":
            set_model_state_dict(fresh.model, model_sd, options=setting)
        else:
            fresh.model.load_state_dict(model_sd)
        set_optimizer_state_dict(fresh.model, fresh.optimizer, optim_sd, options=setting)
    return loaded_states(ctx, original, fresh)


# --- optimizer state --------------------------------------------------------------------


@dataclass(frozen=True)
class OptimView:
    """The sharded, FQN-keyed optimizer state dict of a trained model, and the states of the
    original and of a fresh optimizer it was set into (each also after the next step)."""

    state_keys: list[str]
    group_params: list[list[str]]
    placements_as_params: bool
    """Every tensor of a parameter's shape is a DTensor placed like the parameter."""
    states: LoadedStates


def optim_fqn_on_rank(ctx: RankContext, case: StateDictCase) -> OptimView:
    original = trained(ctx, case)
    optim_sd: Any = get_optimizer_state_dict(original.model, original.optimizer)
    params = dict(original.model.named_parameters())
    placed = all(
        isinstance(v, DTensor) and v.placements == params[k].placements  # type: ignore[attr-defined]
        for k, entry in optim_sd["state"].items()
        for v in entry.values()
        if isinstance(v, torch.Tensor) and v.shape == params[k].shape
    )
    fresh = build(ctx, case, fresh=True)
    fresh.model.load_state_dict(original.model.state_dict())
    set_optimizer_state_dict(fresh.model, fresh.optimizer, copied(optim_sd))
    return OptimView(
        state_keys=list(optim_sd["state"]),
        group_params=[list(g["params"]) for g in optim_sd["param_groups"]],
        placements_as_params=placed,
        states=loaded_states(ctx, original, fresh),
    )


@dataclass(frozen=True)
class SideEffect:
    """Two identical runs, one of which took the optimizer state dict before its first step:
    that run's state just before and just after taking it, and both runs' state after
    training."""

    before_taking: FullState
    after_taking: FullState
    plain: FullState
    taken: FullState


def side_effect_on_rank(ctx: RankContext, case: StateDictCase) -> SideEffect:
    runs = [build(ctx, case), build(ctx, case)]
    before = full_state(runs[1].model, runs[1].optimizer)
    get_optimizer_state_dict(runs[1].model, runs[1].optimizer)
    after = full_state(runs[1].model, runs[1].optimizer)
    for run in runs:
        run.train(ctx, 0, case.train.steps)
    trained = [full_state(run.model, run.optimizer) for run in runs]
    return SideEffect(before, after, *trained)


def hyperparameters_on_rank(
    ctx: RankContext, case: StateDictCase
) -> tuple[list[dict[str, Any]], ...]:
    """Each parameter group's hyper-parameters before and after taking the optimizer state
    dict, once before the first step and once after ``case.train.steps`` steps."""
    sharded = build(ctx, case)
    snapshots = []
    for first, stop in ((0, 0), (0, case.train.steps)):
        sharded.train(ctx, first, stop)
        snapshots.append(full_state(sharded.model, sharded.optimizer).groups)
        get_optimizer_state_dict(sharded.model, sharded.optimizer)
        snapshots.append(full_state(sharded.model, sharded.optimizer).groups)
    return tuple(snapshots)


@dataclass(frozen=True)
class WrappedStateView:
    """``get_state_dict`` of a trained DDP model and its optimizer: the keys, and the state
    (by the unwrapped names) of the model and of a fresh one ``set_state_dict`` loaded."""

    model_keys: list[str]
    optim_keys: list[str]
    group_params: list[list[str]]
    states: tuple[FullState, FullState]


def ddp_state_dict_on_rank(ctx: RankContext, case: ParityCase) -> WrappedStateView:
    runs = []
    for train in (case, fresh_training(case)):
        model = build_mlp(train, ctx.device)
        wrapped, _ = parallelize(model, train, ctx)
        runs.append((model, wrapped, optimizer_for(model, train)))
    (model, wrapped, optimizer), (fresh_model, fresh_wrapped, fresh_optimizer) = runs
    for step in range(case.steps):
        train_step(wrapped, optimizer, case, ctx.rank, step, ctx.device)
    model_sd, optim_sd_typed = get_state_dict(wrapped, optimizer)
    optim_sd: Any = optim_sd_typed
    set_state_dict(
        fresh_wrapped,
        fresh_optimizer,
        model_state_dict=copied(model_sd),
        optim_state_dict=copied(optim_sd),
    )
    return WrappedStateView(
        model_keys=list(model_sd),
        optim_keys=list(optim_sd["state"]),
        group_params=[list(g["params"]) for g in optim_sd["param_groups"]],
        states=(full_state(model, optimizer), full_state(fresh_model, fresh_optimizer)),
    )


# --- HSDP groups and sharded save/load ------------------------------------------------------


def hsdp_on_rank(
    ctx: RankContext, case: StateDictCase
) -> tuple[dict[str, list[int]], LoadedStates]:
    """The ranks of each parameter's replicate and shard groups, and a sharded model and
    optimizer state dict set into a fresh HSDP model (states as ``loaded_states``)."""
    original = trained(ctx, case)
    groups = {}
    for name, param in original.model.named_parameters():
        assert isinstance(param, DTensor)
        for axis in ("replicate", "shard"):
            group = param.device_mesh[axis].get_group()
            groups[f"{name} {axis}"] = dist.get_process_group_ranks(group)
    model_sd, optim_sd = copied(get_state_dict(original.model, original.optimizer))
    fresh = build(ctx, case, fresh=True)
    set_state_dict(
        fresh.model, fresh.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd
    )
    return groups, loaded_states(ctx, original, fresh)


# --- CPU offload ------------------------------------------------------------------------------


def offload_on_rank(
    ctx: RankContext, case: StateDictCase
) -> tuple[list[str], FullState, FullState, dict[str, Any]]:
    """The same training offloaded (``case.offload``) and not: (devices of the offloaded
    state dict's local pieces, offloaded state, plain state, parameters of a fresh offloaded
    model the offloaded state dict was loaded into)."""
    offloaded = trained(ctx, case)
    reference = trained(ctx, replace(case, offload=False, pin_memory=False))
    state_dict = offloaded.model.state_dict()
    devices = sorted({v.to_local().device.type for v in state_dict.values()})
    fresh = build(ctx, case, fresh=True)
    fresh.model.load_state_dict(state_dict)
    return (
        devices,
        full_state(offloaded.model, offloaded.optimizer),
        full_state(reference.model, reference.optimizer),
        {n: _full(p) for n, p in fresh.model.named_parameters()},
    )


def pinned_on_rank(ctx: RankContext, case: StateDictCase) -> dict[str, bool]:
    """Whether each parameter's local piece is in pinned host memory, after training the
    case (``CPUOffloadPolicy(pin_memory=True)``) and in a fresh offloaded model its state
    dict was loaded into; keyed ``trained NAME`` and ``loaded NAME``."""
    original = trained(ctx, case)
    fresh = build(ctx, case, fresh=True)
    fresh.model.load_state_dict(original.model.state_dict())
    return {
        f"{when} {name}": param.to_local().is_pinned()  # type: ignore[attr-defined]
        for when, sharded in (("trained", original), ("loaded", fresh))
        for name, param in sharded.model.named_parameters()
    }


def meta_load_on_rank(
    ctx: RankContext, case: StateDictCase, cpu_state_dict: bool
) -> dict[str, Any]:
    """Upstream's offload check: a model built on the meta device, ``fully_shard`` with CPU
    offload, each parameter loaded on its own (``strict=False, assign=True``) from a DTensor
    of the seeded values (on CPU, or on the rank's device), then a forward and the state
    dict. What happened: the error, or the state dict's devices and full values."""
    with torch.device("meta"):
        model = build_mlp(case.train, torch.device("meta"))
    mesh = ctx.mesh(case.train.mesh_shape)
    policy = CPUOffloadPolicy(pin_memory=case.pin_memory)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    values = build_mlp(case.train, torch.device("cpu")).state_dict()
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor)
        piece = distribute_tensor(values[name].to(ctx.device), param.device_mesh, param.placements)
        model.load_state_dict(
            {name: piece.cpu() if cpu_state_dict else piece}, strict=False, assign=True
        )
    dtype = torch_dtype(case.train.dtype)
    inputs = torch.zeros((case.train.batch_per_rank, case.train.dims[0]), dtype=dtype)
    try:
        model(inputs.to(ctx.device)).sum()
    except RuntimeError as exc:
        return {"error": str(exc)}
    state_dict = model.state_dict()
    return {
        "devices": sorted({v.device.type for v in state_dict.values()}),
        "values": {k: _full(v) for k, v in state_dict.items()},
        "expected": {k: to_numpy(v) for k, v in values.items()},
    }
