"""Rank functions of the HSDP suite: the MLP hybrid-sharded by FSDP1 or fully_shard, its
full-shard twin, the collectives of one step, FSDP1's groups, sync_module_states, errors.

"Units" are what FSDP shards together: an FSDP1 instance's flat parameter, a fully_shard
parameter group. Every Linear is a unit; the root holds no parameter of its own under
``hybrid`` wrapping, and the first Linear's under ``mixed`` wrapping (where it is fully
sharded over the world, as upstream fully shards the embedding and output projection).
A ``tied`` case shares the first and last Linears' weight: the root's unit holds both
Linears, as upstream's root holds its tied embedding and output projection."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, StateDictType, fully_shard
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

from harness import RankContext
from harness.cases.hsdp import DEFAULT_GROUPS, GroupErrorCase, HSDPCase, SyncCase
from harness.torchkit import internals
from harness.torchkit.collectives import CountKey, counting
from harness.torchkit.dtensor import tensor_from, to_numpy
from harness.torchkit.models import build_mlp
from harness.torchkit.optim import (
    Trained,
    build_optimizer,
    loss_of,
    param_groups,
    reference_run,
    rows_of,
    step_batch,
)
from harness.torchkit.training import dtensor_full_params, train_steps

MESH_NAMES = ("replicate", "shard")
# The non-hybrid twin of each hybrid strategy: the same resharding after forward.
_FULL_TWIN = {"HYBRID_SHARD": "FULL_SHARD", "_HYBRID_SHARD_ZERO2": "SHARD_GRAD_OP"}


def _groups_argument(case: HSDPCase | SyncCase, mesh: Any) -> dict[str, Any]:
    if case.groups == DEFAULT_GROUPS:
        return {}
    if case.groups == "device_mesh":
        return {"device_mesh": mesh}
    return {"process_group": (mesh.get_group("shard"), mesh.get_group("replicate"))}


def _fsdp1(model: nn.Sequential, case: HSDPCase, ctx: RankContext, *, hybrid: bool) -> nn.Module:
    """FSDP1 units per ``case.wrapping``; ``hybrid=False`` gives the full-shard twin."""
    options: dict[str, Any] = {"device_id": ctx.device, "use_orig_params": case.use_orig_params}
    if hybrid:
        mesh = ctx.mesh(case.mesh_shape, MESH_NAMES)
        options |= _groups_argument(case, mesh)
        strategy = ShardingStrategy[case.strategy]
    else:
        strategy = ShardingStrategy[_FULL_TWIN[case.strategy]]
    own = _own(model, case)
    if case.wrapping == "hybrid":
        chosen = {id(model[index]) for index in own}
        policy = CustomPolicy(lambda module: id(module) in chosen)
        return FSDP(model, sharding_strategy=strategy, auto_wrap_policy=policy, **options)
    for index in own:
        model[index] = FSDP(model[index], sharding_strategy=strategy, **options)
    root_options = {k: v for k, v in options.items() if k in ("device_id", "use_orig_params")}
    return FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, **root_options)


def _fully_shard(
    model: nn.Sequential, case: HSDPCase, ctx: RankContext, *, hybrid: bool
) -> nn.Module:
    """fully_shard units per ``case.wrapping``; ``hybrid=False`` uses the world mesh."""
    world = ctx.mesh((ctx.world_size,))
    mesh = ctx.mesh(case.mesh_shape, MESH_NAMES) if hybrid else world
    reshard = case.strategy == "HYBRID_SHARD"
    for index in _own(model, case):
        fully_shard(model[index], mesh=mesh, reshard_after_forward=reshard)
    root_mesh = mesh if case.wrapping == "hybrid" else world
    fully_shard(model, mesh=root_mesh, reshard_after_forward=reshard)
    return model


def _linears(model: nn.Sequential) -> list[int]:
    return [i for i, layer in enumerate(model) if isinstance(layer, nn.Linear)]


def _own(model: nn.Sequential, case: HSDPCase) -> list[int]:
    """Module indices of the Linears wrapped on their own (``case.own_units``)."""
    linears = _linears(model)
    return [linears[position] for position in case.own_units]


def build_model(case: HSDPCase, device: torch.device) -> nn.Sequential:
    """The case's MLP, its first and last Linear sharing one weight when ``case.tied``."""
    model = build_mlp(case.training, device)
    if case.tied:
        linears = _linears(model)
        model[linears[-1]].weight = model[linears[0]].weight
    return model


def wrap(case: HSDPCase, ctx: RankContext, *, hybrid: bool = True) -> nn.Module:
    model = build_model(case, ctx.device)
    parallelize = _fsdp1 if case.api == "fsdp1" else _fully_shard
    return parallelize(model, case, ctx, hybrid=hybrid)


def tied_reference(case: HSDPCase) -> Trained:
    """``reference_run`` of the case's model, tied where the case ties."""
    return reference_run(case.training, build=lambda _, device: build_model(case, device))


def _fsdp1_full_params(model: nn.Module) -> dict[str, np.ndarray]:
    # Inside summon_full_params FSDP1 names parameters as the unwrapped model does. Clone
    # first: numpy() pins the storage, which FSDP1 frees (resizes) when it reshards.
    with FSDP.summon_full_params(model, writeback=False):
        return {name: to_numpy(p.detach().clone()) for name, p in model.named_parameters()}


def optimizer_of(wrapped: nn.Module, case: HSDPCase) -> torch.optim.Optimizer:
    """``case.training.optim`` over the wrapped model's parameters."""
    optim = case.training.optim
    # Without use_orig_params FSDP1 exposes one flat parameter per unit: one group.
    groups = (
        param_groups(wrapped, optim)
        if optim.second_group is not None
        else [{"params": list(wrapped.parameters())}]
    )
    return build_optimizer(optim, groups)


def _train(case: HSDPCase, ctx: RankContext, *, hybrid: bool) -> Trained:
    wrapped = wrap(case, ctx, hybrid=hybrid)
    optimizer = optimizer_of(wrapped, case)
    return train_steps(
        ctx, case.training, wrapped, optimizer, ctx.rank, full_params=full_params_of(case)
    )


def full_params_of(case: HSDPCase) -> Callable[[nn.Module], dict[str, np.ndarray]]:
    """How to read the full parameters of a model ``case.api`` wrapped."""
    return _fsdp1_full_params if case.api == "fsdp1" else dtensor_full_params


def hybrid_and_full_on_rank(ctx: RankContext, case: HSDPCase) -> tuple[Trained, Trained]:
    """The same training hybrid-sharded and fully sharded over the world (same API,
    wrapping and resharding), each rank on its own rows of every batch."""
    return _train(case, ctx, hybrid=True), _train(case, ctx, hybrid=False)


def one_step_collectives_on_rank(ctx: RankContext, case: HSDPCase) -> dict[CountKey, int]:
    """The collectives one forward and backward of the hybrid model issues on this rank."""
    wrapped = wrap(case, ctx)
    inputs, targets = step_batch(case.training, 0)
    rows = rows_of(case.training, ctx.rank)
    dtype = case.training.dtype
    with counting() as counts:
        loss = loss_of(
            wrapped(tensor_from(inputs[rows], dtype, ctx.device)),
            tensor_from(targets[rows], dtype, ctx.device),
        )
        loss.backward()
    return dict(counts)


UnitGroups = tuple[str, tuple[int, ...], tuple[int, ...] | None, int, int | None]
"""(strategy name, shard group ranks, replicate group ranks, id of each group object)."""


def fsdp1_groups_on_rank(ctx: RankContext, case: HSDPCase) -> list[UnitGroups]:
    """Every FSDP1 instance's strategy and groups, outermost first."""
    wrapped = wrap(case, ctx)
    found = []
    for unit in FSDP.fsdp_modules(wrapped):
        shard = unit.process_group
        replicate = internals.fsdp1_replicate_group(unit)
        found.append(
            (
                unit.sharding_strategy.name,
                tuple(torch.distributed.get_process_group_ranks(shard)),
                None
                if replicate is None
                else tuple(torch.distributed.get_process_group_ranks(replicate)),
                id(shard),
                None if replicate is None else id(replicate),
            )
        )
    return found


def sync_module_states_on_rank(ctx: RankContext, case: SyncCase) -> dict[str, np.ndarray]:
    """Rank r builds its MLP from ``seed + r``; FSDP1 hybrid-shards it with
    sync_module_states=True. The full parameters this rank then holds."""
    model = build_mlp(replace(case, seed=case.seed + ctx.rank), ctx.device)
    mesh = ctx.mesh(case.mesh_shape, MESH_NAMES)
    wrapped = FSDP(
        model,
        sharding_strategy=ShardingStrategy[case.strategy],
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        sync_module_states=True,
        device_id=ctx.device,
        use_orig_params=case.use_orig_params,
        **_groups_argument(case, mesh),
    )
    return _fsdp1_full_params(wrapped)


def initial_params(case: SyncCase) -> dict[str, np.ndarray]:
    """Rank 0's parameters before wrapping (built in the driver)."""
    model = build_mlp(case, torch.device("cpu"))
    return {name: to_numpy(p) for name, p in model.named_parameters()}


def group_error_on_rank(ctx: RankContext, case: GroupErrorCase) -> tuple[str, str, str]:
    """The exception FSDP1 raises for hybrid sharding given ``case.given`` (none: manual
    wrapping without groups): its type, its message, and the type of what was given."""
    model = build_mlp(_Shape(case.dims), ctx.device)
    strategy = ShardingStrategy[case.strategy]
    options: dict[str, Any] = {"device_id": ctx.device}
    if case.given is not None:
        options |= {"auto_wrap_policy": ModuleWrapPolicy({nn.Linear}), **_single(ctx, case)}
    given = options.get("process_group", options.get("device_mesh"))
    try:
        FSDP(model, sharding_strategy=strategy, **options)
    except Exception as exc:  # the check is which exception, with which message
        return type(exc).__name__, str(exc), str(type(given))
    return "no exception", "", str(type(given))


def _single(ctx: RankContext, case: GroupErrorCase) -> dict[str, Any]:
    mesh = ctx.mesh(case.mesh_shape, MESH_NAMES)
    world = ctx.mesh((ctx.world_size,))
    if case.given == "1-D mesh":
        return {"device_mesh": world}
    groups: dict[str, Any] = {
        "world group": world.get_group(),
        "shard group": mesh.get_group("shard"),
        "replicate group": mesh.get_group("replicate"),
        "three groups": (world.get_group(),) * 3,
    }
    return {"process_group": groups[str(case.given)]}


@dataclass(frozen=True)
class _Shape:
    """The MLP of an error case: never trained, so any seed and dtype."""

    dims: tuple[int, ...]
    bias: bool = True
    dtype: str = "float64"
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class SaveLoadResult:
    """This rank's view: the full parameters when saved and right after the load, the
    loaded model's training after the load, and the same training never interrupted."""

    saved: dict[str, np.ndarray]
    loaded: dict[str, np.ndarray]
    resumed: Trained
    uninterrupted: Trained


def _state_dicts(model: nn.Module, optimizer: Any, case: HSDPCase) -> tuple[Any, Any]:
    if case.api == "fsdp1":
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            return model.state_dict(), FSDP.optim_state_dict(model, optimizer)
    return get_state_dict(model, optimizer)


def _load(model: nn.Module, optimizer: Any, saved: tuple[Any, Any], case: HSDPCase) -> None:
    model_sd, optim_sd = saved
    if case.api == "fsdp1":
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            model.load_state_dict(model_sd)
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, optim_sd))
        return
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _saved_after_training(ctx: RankContext, case: HSDPCase) -> tuple[Trained, tuple[Any, Any]]:
    model = wrap(case, ctx)
    optimizer = optimizer_of(model, case)
    full = full_params_of(case)
    trained = train_steps(ctx, case.training, model, optimizer, ctx.rank, full_params=full)
    return trained, _state_dicts(model, optimizer, case)


def save_load_on_rank(ctx: RankContext, case: HSDPCase, steps_after: int) -> SaveLoadResult:
    full = full_params_of(case)
    whole = dataclasses.replace(case.training, steps=case.training.steps + steps_after)
    model = wrap(case, ctx)
    uninterrupted = train_steps(
        ctx, whole, model, optimizer_of(model, case), ctx.rank, full_params=full
    )
    before, saved = _saved_after_training(ctx, case)
    other_weights = dataclasses.replace(case.training, seed=case.training.seed + 1)
    fresh = wrap(dataclasses.replace(case, training=other_weights), ctx)
    fresh_optimizer = optimizer_of(fresh, case)
    _load(fresh, fresh_optimizer, saved, case)
    loaded = full(fresh)
    after = dataclasses.replace(case.training, steps=steps_after)
    resumed = train_steps(
        ctx,
        after,
        fresh,
        fresh_optimizer,
        ctx.rank,
        full_params=full,
        first_step=case.training.steps,
    )
    return SaveLoadResult(before.params, loaded, resumed, uninterrupted)


def device_id_on_rank(ctx: RankContext, case: HSDPCase, give: bool) -> tuple[str, str]:
    """FSDP1 hybrid sharding of a CPU-built MLP (every Linear its own unit), given
    ``device_id=ctx.device`` or not: ("ok", the device types its parameters then hold) or
    (exception type, message)."""
    model = build_model(case, torch.device("cpu"))
    mesh = ctx.mesh(case.mesh_shape, MESH_NAMES)
    options = _groups_argument(case, mesh) | ({"device_id": ctx.device} if give else {})
    try:
        wrapped = FSDP(
            model,
            sharding_strategy=ShardingStrategy[case.strategy],
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            use_orig_params=case.use_orig_params,
            **options,
        )
    except Exception as exc:  # the check is which exception, with which message
        return type(exc).__name__, str(exc)
    return "ok", ",".join(sorted({p.device.type for p in wrapped.parameters()}))
