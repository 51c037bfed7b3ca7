"""Rank functions of the state-dict suite for torch.distributed.checkpoint (DCP): save on
one World, load on another, and the phases of a resumed run against uninterrupted training.

The driver makes every checkpoint directory and removes it: all ranks of every World must
agree on the path, and ranks never draw or invent anything themselves.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from harness import RankContext
from harness.cases.state_dict import ResumeCase, StateDictCase
from specs.resume import Phase
from suites.checks.state_dict import FullState, Sharded, build, full_state
from suites.checks.state_dict_full import FULL


def save(sharded: Sharded, directory: str) -> None:
    """``dcp.save`` of the model and optimizer state dicts (sharded, keyed by name)."""
    model_sd, optim_sd = get_state_dict(sharded.model, sharded.optimizer)
    dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)


def load(sharded: Sharded, directory: str) -> None:
    """``dcp.load`` into the model's and optimizer's own state dicts (DCP reshards to their
    layout), then set them."""
    model_sd, optim_sd = get_state_dict(sharded.model, sharded.optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp_load(state, checkpoint_id=directory)
    set_state_dict(
        sharded.model,
        sharded.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )


def dcp_save_on_rank(ctx: RankContext, case: StateDictCase, directory: str) -> FullState:
    """Train, save; the state saved."""
    sharded = build(ctx, case)
    sharded.train(ctx, 0, case.train.steps)
    save(sharded, directory)
    return full_state(sharded.model, sharded.optimizer)


def dcp_load_on_rank(ctx: RankContext, case: StateDictCase, directory: str) -> FullState:
    """A fresh model and optimizer (another seed and lr) loaded from ``directory``."""
    sharded = build(ctx, case, fresh=True)
    load(sharded, directory)
    return full_state(sharded.model, sharded.optimizer)


def dcp_load_error_on_rank(ctx: RankContext, case: StateDictCase, directory: str) -> str | None:
    """Load ``directory`` into a fresh model and optimizer; what the load raised, if anything."""
    sharded = build(ctx, case, fresh=True)
    try:
        load(sharded, directory)
    except (Exception, CheckpointException) as exc:  # a BaseException, wrapping every rank's
        return f"{type(exc).__name__}: {exc}"
    return None


# --- resume --------------------------------------------------------------------------------


def checkpoint_dir(root: str, index: int) -> str:
    return os.path.join(root, f"checkpoint-{index}")


def resumed_phase_on_rank(ctx: RankContext, case: ResumeCase, phase: Phase, root: str) -> FullState:
    """Run one phase of the resumed run (``specs.resume.plan``); the state it ends in."""
    mine = case.at(ctx.world_size)
    sharded = _restored(ctx, mine, phase.restore, root)
    for action in phase.actions:
        first, stop = action.steps
        if action.kind == "train":
            sharded.train(ctx, first, stop)
        elif action.kind == "checkpoint":
            assert action.checkpoint is not None
            save(sharded, checkpoint_dir(root, action.checkpoint))
        else:
            sharded = _restored(ctx, mine, action.checkpoint, root)
    return full_state(sharded.model, sharded.optimizer)


def _restored(ctx: RankContext, case: StateDictCase, index: int | None, root: str) -> Sharded:
    """A new model and optimizer: the seeded initial ones, or loaded from checkpoint
    ``index`` (built fresh first, so whatever the load leaves out shows)."""
    if index is None:
        return build(ctx, case)
    sharded = build(ctx, case, fresh=True)
    load(sharded, checkpoint_dir(root, index))
    return sharded


def uninterrupted_on_rank(
    ctx: RankContext, case: ResumeCase, first: int, stop: int, start: FullState | None
) -> FullState:
    """Uninterrupted training of steps ``first..stop-1`` on this World, from the seeded
    initial state or handed ``start`` (the state another World ended in): set as a full
    state dict, in memory, no checkpoint involved."""
    mine = case.at(ctx.world_size)
    if start is None:
        sharded = build(ctx, mine)
    else:
        sharded = build(ctx, mine, fresh=True)
        model_sd, optim_sd = _full_state_dicts(start, ctx.device)
        set_state_dict(
            sharded.model,
            sharded.optimizer,
            model_state_dict=model_sd,
            optim_state_dict=optim_sd,
            options=FULL,
        )
    sharded.train(ctx, first, stop)
    return full_state(sharded.model, sharded.optimizer)


def _full_state_dicts(
    state: FullState, device: torch.device
) -> tuple[dict[str, Any], dict[str, Any]]:
    def tensor(value: Any) -> Any:
        if not isinstance(value, np.ndarray):
            return value
        values = torch.from_numpy(value.copy())
        return values.to(device) if values.ndim else values  # optimizers keep steps on CPU

    model_sd = {name: tensor(v) for name, v in state.params.items()}
    optim_state = {
        name: {k: tensor(v) for k, v in entry.items()} for name, entry in state.optim.items()
    }
    return model_sd, {"state": optim_state, "param_groups": [dict(g) for g in state.groups]}
