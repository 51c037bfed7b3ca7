"""Rank functions of the checkpoint-loads suite on DCP's coordination options
(``process_group``, ``use_collectives``, ``no_dist``) and on the state-dict functions
called one by one with their options (``get_/set_model_state_dict``,
``get_/set_optimizer_state_dict`` against ``get_/set_state_dict``).

Models are ``suites.checks.loads``' (untrained, a fresh one from another seed) or, where an
optimizer is needed, ``suites.checks.state_dict``'s ``build``. Values go back as numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from harness import RankContext
from harness.cases.load_options import ApiOptionsCase, CoordinationCase, RankLocalReshardCase
from suites.checks.loads import Loaded, Values, error_text, model_of, values_of
from suites.checks.state_dict import FullState, build, full_state
from suites.checks.state_dict_full import copied, plain


def _group(how: str) -> dict[str, Any]:
    """``dcp.save``/``dcp.load``'s keyword arguments of a coordination (a collective where
    it makes a group: every rank calls it)."""
    if how == "default_group":
        return {"process_group": dist.group.WORLD}
    if how == "new_group":
        return {"process_group": dist.new_group(list(range(dist.get_world_size())))}
    if how == "rank_local":
        return {"use_collectives": False}
    if how == "no_dist":
        return {"no_dist": True}
    return {}


def coordinated_save_on_rank(ctx: RankContext, case: CoordinationCase, directory: str) -> Values:
    """``dcp.save`` of the model's state dict, coordinated as the case says; the values."""
    model = model_of(ctx, case.reshard.save)
    dcp_save(get_model_state_dict(model), checkpoint_id=directory, **_group(case.save_how))
    return values_of(model)


def coordinated_load_on_rank(ctx: RankContext, case: CoordinationCase, directory: str) -> Loaded:
    """``dcp.load`` into the loading model's own state dict, coordinated as the case says,
    then set; what it raised and the values before and after."""
    return _load(ctx, case.reshard.load, directory, _group(case.load_how))


def rank_local_save_on_rank(ctx: RankContext, case: RankLocalReshardCase, directory: str) -> Values:
    model = model_of(ctx, case.save)
    dcp_save(get_model_state_dict(model), checkpoint_id=directory, use_collectives=False)
    return values_of(model)


def rank_local_load_on_rank(ctx: RankContext, case: RankLocalReshardCase, directory: str) -> Loaded:
    return _load(ctx, case.load, directory, {})


def _load(ctx: RankContext, case: Any, directory: str, how: dict[str, Any]) -> Loaded:
    model = model_of(ctx, case)
    fresh = values_of(model)
    try:
        state_dict = get_model_state_dict(model)
        dcp_load(state_dict, checkpoint_id=directory, **how)
        set_model_state_dict(model, state_dict)
        error = None
    except BaseException as exc:  # CheckpointException is a BaseException
        error = error_text(exc)
    dtypes = {n: str(p.dtype).removeprefix("torch.") for n, p in model.named_parameters()}
    return Loaded(error, fresh, values_of(model), dtypes)


# --- the functions one by one -------------------------------------------------------------


@dataclass(frozen=True)
class ApiSeen:
    """The state dicts ``get_state_dict`` gave and those of the two functions one by one
    (model, optimizer; plain values, keys in order); the trained state and the states
    ``set_state_dict`` and the two set functions left in fresh models (None for a
    submodule's state dicts, which are not the model's)."""

    joint: tuple[Any, Any]
    separate: tuple[Any, Any]
    trained: FullState
    set_jointly: FullState | None
    set_separately: FullState | None


def api_options_on_rank(ctx: RankContext, case: ApiOptionsCase) -> ApiSeen:
    sharded = build(ctx, case.case)
    sharded.train(ctx, 0, case.case.train.steps)
    model, optimizer = sharded.model, sharded.optimizer
    options = StateDictOptions(
        full_state_dict=case.full,
        cpu_offload=case.cpu_offload,
        flatten_optimizer_state_dict=case.flatten_optimizer,
        dsd_fqn_modifiers=case.modifiers,
    )
    subs = None if case.submodule is None else {model.get_submodule(str(case.submodule))}
    joint = get_state_dict(model, optimizer, submodules=subs, options=options)
    model_sd = get_model_state_dict(model, submodules=subs, options=options)
    optim_sd = get_optimizer_state_dict(model, optimizer, submodules=subs, options=options)
    trained = full_state(model, optimizer)
    seen = (plain(joint[0]), plain(joint[1])), (plain(model_sd), plain(optim_sd))
    if subs is not None:
        return ApiSeen(*seen, trained, None, None)
    first = build(ctx, case.case, fresh=True)
    set_state_dict(
        first.model,
        first.optimizer,
        model_state_dict=copied(joint[0]),
        optim_state_dict=copied(joint[1]),
        options=options,
    )
    second = build(ctx, case.case, fresh=True)
    set_model_state_dict(second.model, copied(model_sd), options=options)
    set_optimizer_state_dict(second.model, second.optimizer, copied(optim_sd), options=options)
    return ApiSeen(
        *seen,
        trained,
        full_state(first.model, first.optimizer),
        full_state(second.model, second.optimizer),
    )
