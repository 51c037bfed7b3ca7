"""Rank function of the HSDP save/load checks: train a hybrid-sharded model, take its
sharded model and optimizer state dicts, load them into a hybrid model built with other
weights, train that on, and compare with the same training never interrupted.

FSDP1 saves with ``StateDictType.SHARDED_STATE_DICT`` and ``FSDP.optim_state_dict``, as
upstream's test_hsdp_save_load_state_dict; fully_shard through
``torch.distributed.checkpoint.state_dict`` (DTensor shards). The state dicts stay in
memory, as upstream's do, and the saved model is dropped once loaded: what the loaded one
shares with it (optimizer state the load does not copy) is then the loaded one's alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType

from harness.context import RankContext
from harness.optim import Trained
from harness.parallel_cases import HSDPCase
from suites._hsdp_training import full_params_of, optimizer_of, wrap
from suites._training import train_steps


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
