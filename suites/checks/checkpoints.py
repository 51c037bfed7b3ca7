"""Rank functions of the checkpoints suite: DCP saves and loads under drawn options, async
saves while training goes on, and DCP state dicts holding an lr scheduler and a user
``Stateful``. The driver makes and removes every directory."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from harness import RankContext
from harness.cases.checkpoints import AsyncCase, AsyncFailureCase, OptionsCase, StatefulCase
from harness.cases.state_dict import StateDictCase
from harness.torchkit import checkpoints as kit
from harness.torchkit.models import build_mlp
from harness.torchkit.optim import optimizer_kwargs
from harness.torchkit.schedules import Scheduled, build_schedule
from harness.torchkit.training import parallelize, train_step
from suites.checks.loads import FailingWriter
from suites.checks.state_dict import (
    FRESH_LR_FACTOR,
    FullState,
    Sharded,
    build,
    fsdp_options,
    full_state,
)
from suites.checks.state_dict_dcp import load, save

# --- options -------------------------------------------------------------------------------


def _state(
    sharded: Sharded, chosen: tuple[tuple[str, Any], ...], own: dict[str, Any] | None = None
) -> dict[str, Any]:
    options = kit.state_dict_options(chosen)
    model_sd, optim_sd = get_state_dict(sharded.model, sharded.optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    return state if own is None else state | {"progress": own}


RankValues = tuple[list[float], str]
"""A rank's own plain values in a checkpoint: its losses so far and its name."""


def _own(losses: list[float], ctx: RankContext) -> dict[str, Any]:
    """This rank's own values under keys every rank shares (a user's per-rank progress): DCP
    saves one rank's, which every rank loads."""
    progress = torch.tensor(losses, dtype=torch.float64)
    return {"losses": progress, "name": f"rank {ctx.rank} of {ctx.world_size}"}


def _own_values(own: dict[str, Any]) -> RankValues:
    return [float(x) for x in own["losses"].tolist()], str(own["name"])


@dataclass(frozen=True)
class OptionsSaved:
    state: FullState
    own: RankValues
    refusal: str | None
    """What the save over an earlier checkpoint raised (None: it wrote, or none was there)."""
    error: str | None
    """What the save the load reads raised."""


def _saved(directory: str, options: Any, planner: DefaultSavePlanner, state: Any) -> str | None:
    try:
        dcp_save(state, storage_writer=kit.writer(options, directory), planner=planner)
    except (Exception, CheckpointException) as exc:  # a BaseException, wrapping every rank's
        return f"{type(exc).__name__}: {exc}"
    return None


def options_directory(case: OptionsCase, root: str) -> str:
    """Where the checkpoint the load reads is: beside the earlier one where the save over it
    is refused."""
    return os.path.join(root, "retried") if case.refused else root


def options_save_on_rank(ctx: RankContext, case: OptionsCase, directory: str) -> OptionsSaved:
    """Train, save with the case's options (with plan caching, a first save through the
    planner elsewhere and a step before the second); the save goes over an earlier checkpoint
    of other values in the same directory where the case says, and, refused, into
    ``options_directory``. The state saved, this rank's own values, what the saves raised."""
    options, save_case = case.options, case.reshard.save
    sharded = build(ctx, save_case)
    losses = sharded.train(ctx, 0, save_case.train.steps)
    planner = kit.save_planner(options, ctx.rank, ctx.world_size)
    if case.rewrite == "over_earlier":
        save(build(ctx, save_case, fresh=True), directory)
    if case.cached:
        first = os.path.join(directory, "first")
        state = _state(sharded, options.save_options, _own(losses, ctx))
        dcp_save(state, storage_writer=kit.writer(options, first), planner=planner)
        step = save_case.train.steps
        losses += sharded.train(ctx, step, step + 1)
    own = _own(losses, ctx)
    state = _state(sharded, options.save_options, own)
    error = _saved(directory, options, planner, state)
    refusal = None
    if case.rewrite == "over_earlier" and error is not None and not options.overwrite:
        refusal, error = error, _saved(options_directory(case, directory), options, planner, state)
    saved = full_state(sharded.model, sharded.optimizer)
    return OptionsSaved(saved, _own_values(own), refusal, error)


def options_load_on_rank(
    ctx: RankContext, case: OptionsCase, directory: str
) -> tuple[FullState, RankValues]:
    """A fresh model and optimizer loaded with the case's options; the state loaded and the
    per-rank values read."""
    options = case.options
    sharded = build(ctx, case.reshard.load, fresh=True)
    own = {"losses": torch.zeros(case.saved_steps, dtype=torch.float64), "name": ""}
    state = _state(sharded, options.load_options, own)
    reader = kit.reader(options_directory(case, directory))
    dcp_load(state, storage_reader=reader, planner=kit.load_planner(options))
    setting = kit.state_dict_options(options.load_options)
    if setting.broadcast_from_rank0:
        # one set_state_dict call hangs where rank 0 alone holds the values (spec
        # state_dict.full.broadcast_from_rank0_joint): the two calls that work
        set_model_state_dict(sharded.model, state["model"], options=setting)
        set_optimizer_state_dict(sharded.model, sharded.optimizer, state["optim"], options=setting)
    else:
        set_state_dict(
            sharded.model,
            sharded.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=setting,
        )
    return full_state(sharded.model, sharded.optimizer), _own_values(state["progress"])


def unflattened_on_rank(
    ctx: RankContext, case: StateDictCase, directory: str
) -> tuple[FullState, FullState]:
    """Save and load with ``flatten_state_dict=False`` on both planners; the state saved and
    the state loaded into a fresh model."""
    sharded = build(ctx, case)
    sharded.train(ctx, 0, case.train.steps)
    saved = full_state(sharded.model, sharded.optimizer)
    dcp_save(_state(sharded, ()), checkpoint_id=directory, planner=DefaultSavePlanner(False))
    fresh = build(ctx, case, fresh=True)
    state = _state(fresh, ())
    dcp_load(state, checkpoint_id=directory, planner=DefaultLoadPlanner(False))
    set_state_dict(
        fresh.model,
        fresh.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    return saved, full_state(fresh.model, fresh.optimizer)


# --- async ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class AsyncStates:
    at_call: FullState
    loaded: FullState
    after: FullState
    straight: FullState
    """Training through the same steps without a save."""


@torch.no_grad()
def _negate_parameters(model: torch.nn.Module) -> None:
    for parameter in model.parameters():
        parameter.neg_()


def async_on_rank(ctx: RankContext, case: AsyncCase, directory: str) -> AsyncStates:
    train = case.case.train
    sharded = build(ctx, case.case)
    sharded.train(ctx, 0, train.steps)
    at_call = full_state(sharded.model, sharded.optimizer)
    stager = kit.stager(case.staging)
    try:
        where: dict[str, Any] = (
            {"storage_writer": FileSystemWriter(directory)}
            if case.storage_writer
            else {"checkpoint_id": directory}
        )
        response = dcp_async_save(
            _state(sharded, ()),
            **where,
            planner=DefaultSavePlanner() if case.planner else None,
            process_group=kit.checkpoint_group(),
            async_checkpointer_type=AsyncCheckpointerType(case.checkpointer),
            async_stager=stager,
            use_collectives=case.use_collectives,
        )
        if isinstance(response, AsyncSaveResponse):
            # async staging: the docs ask to wait for staging before changing the state
            response.staging_completion.result()
            response = response.upload_completion
        if case.in_place:
            _negate_parameters(sharded.model)
            response.result()
            _negate_parameters(sharded.model)  # exact: back to the state at the call
        sharded.train(ctx, train.steps, train.steps + case.after)
        response.result()
    finally:
        if stager is not None:
            stager.close()
    after = full_state(sharded.model, sharded.optimizer)
    straight = build(ctx, case.case)
    straight.train(ctx, 0, train.steps + case.after)
    fresh = build(ctx, case.case, fresh=True)
    load(fresh, directory)
    return AsyncStates(
        at_call,
        full_state(fresh.model, fresh.optimizer),
        after,
        full_state(straight.model, straight.optimizer),
    )


@dataclass(frozen=True)
class AsyncFailure:
    raised: str | None
    """What the async save raised: at the call, or from its future's ``result()`` (None:
    neither)."""
    earlier: FullState
    """The state the earlier checkpoint holds."""
    loaded: FullState
    """The earlier checkpoint loaded into a fresh model after the failed save."""


def _failing_writer(ctx: RankContext, case: AsyncFailureCase, directory: str) -> FileSystemWriter:
    if case.failure == "overwrite":
        return FileSystemWriter(directory, overwrite=False)
    return FailingWriter(os.path.join(directory, "failed"), fails=ctx.rank == case.failing_rank)


def async_failure_on_rank(ctx: RankContext, case: AsyncFailureCase, directory: str) -> AsyncFailure:
    """Train, ``dcp.save`` into ``directory``, train a step, ``dcp.async_save`` through the
    case's failing writer and wait for it; then load ``directory`` into a fresh model."""
    train = case.case.train
    sharded = build(ctx, case.case)
    sharded.train(ctx, 0, train.steps)
    save(sharded, directory)
    earlier = full_state(sharded.model, sharded.optimizer)
    sharded.train(ctx, train.steps, train.steps + 1)
    stager = kit.stager(()) if case.default_stager else None
    raised = None
    try:
        response = dcp_async_save(
            _state(sharded, ()),
            storage_writer=_failing_writer(ctx, case, directory),
            process_group=kit.checkpoint_group(),
            async_stager=stager,
        )
        if isinstance(response, AsyncSaveResponse):  # DefaultStager's async staging
            response.staging_completion.result()
            response = response.upload_completion
        response.result()
    except (Exception, CheckpointException) as exc:  # a BaseException, wrapping every rank's
        raised = f"{type(exc).__name__}: {exc}"
    finally:
        if stager is not None:
            stager.close()
    fresh = build(ctx, case.case, fresh=True)
    load(fresh, directory)
    return AsyncFailure(raised, earlier, full_state(fresh.model, fresh.optimizer))


# --- stateful ------------------------------------------------------------------------------


@dataclass
class Run:
    sharded: Sharded
    scheduler: Scheduled
    position: kit.DataPosition


@dataclass(frozen=True)
class StatefulRun:
    lrs: list[list[float]]
    """Each group's lr after each step."""
    position: dict[str, Any]
    state: FullState
    replaced: tuple[str, ...] = ()
    """The top-level entries ``dcp.load`` replaced in the state dict it was given, where it
    loads in place (tensors copied into, ``Stateful`` objects' ``load_state_dict`` called)."""


def _run(ctx: RankContext, case: StatefulCase, *, fresh: bool = False) -> Run:
    train = case.case.train
    if fresh:
        train = replace(train, seed=(train.seed + 1) % 2**32)
    model = build_mlp(train, ctx.device)
    params = dict(model.named_parameters())
    for name in case.frozen:
        params[name].requires_grad_(False)
    wrapped, dp_rank = parallelize(model, train, ctx, **fsdp_options(case.case))
    named = dict(wrapped.named_parameters())
    factor = FRESH_LR_FACTOR if fresh else 1.0
    groups = [
        {"params": [named[n] for n in group], "lr": lr * factor}
        for group, lr in zip(case.groups, case.lrs, strict=True)
    ]
    cls = getattr(torch.optim, train.optim.name)
    optimizer = cls(groups, **optimizer_kwargs(train.optim))
    # the case's own batches: the fresh seed initialises the model, never the data
    sharded = Sharded(wrapped, optimizer, dp_rank, case.case)
    return Run(sharded, build_schedule(case.schedule, optimizer), kit.DataPosition())


def _train(ctx: RankContext, run: Run, stop: int, lrs: list[list[float]]) -> None:
    sharded = run.sharded
    while run.position.step < stop:
        step = run.position.next_step()
        train_step(
            sharded.model, sharded.optimizer, sharded.case.train, sharded.dp_rank, step, ctx.device
        )
        run.scheduler.step()
        lrs.append([float(g["lr"]) for g in sharded.optimizer.param_groups])


def _finished(run: Run, lrs: list[list[float]]) -> StatefulRun:
    sharded = run.sharded
    return StatefulRun(lrs, run.position.state_dict(), full_state(sharded.model, sharded.optimizer))


def uninterrupted_on_rank(ctx: RankContext, case: StatefulCase) -> StatefulRun:
    run, lrs = _run(ctx, case), list[list[float]]()
    _train(ctx, run, case.case.train.steps, lrs)
    return _finished(run, lrs)


def _dcp_state(run: Run) -> dict[str, Any]:
    """Model and optimizer by get_state_dict; the scheduler and the data position as the
    ``Stateful`` objects they are (DCP calls their state_dict / load_state_dict)."""
    model_sd, optim_sd = get_state_dict(run.sharded.model, run.sharded.optimizer)
    return {
        "model": model_sd,
        "optim": optim_sd,
        "scheduler": run.scheduler.scheduler,
        "data": run.position,
    }


def resumed_on_rank(ctx: RankContext, case: StatefulCase, directory: str) -> StatefulRun:
    run, lrs = _run(ctx, case), list[list[float]]()
    _train(ctx, run, case.save_at, lrs)
    dcp_save(_dcp_state(run), checkpoint_id=directory)
    resumed = _run(ctx, case, fresh=True)
    state = _dcp_state(resumed)
    given = dict(state)
    dcp_load(state, checkpoint_id=directory)
    replaced = tuple(key for key, value in given.items() if state.get(key) is not value)
    set_state_dict(
        resumed.sharded.model,
        resumed.sharded.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    _train(ctx, resumed, case.case.train.steps, lrs)
    return replace(_finished(resumed, lrs), replaced=replaced)
