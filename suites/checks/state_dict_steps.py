"""Rank functions of the state_dict_steps suite: a module graph under ``fully_shard`` trained
by a stateful optimizer, its model and optimizer state dict taken at a point inside a step,
the run resumed from it in a fresh model and optimizer, against training never interrupted.

A step is ``zero_grad(); loss = mse(model(x), y); loss.backward(); optimizer.step()`` on this
rank's rows of the step's batch (``graph_batch``, from the case's seed: a fresh model built
from another seed trains on the batches the original would see). The fresh optimizer has
ten times the lr and more weight decay, so that a load that leaves anything out shows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from harness import RankContext
from harness.cases.state_dict import TIED_GROUP_ORDERS, MidStepCase, TiedAfterForwardCase
from harness.torchkit.dtensor import full_array, tensor_from, to_numpy
from harness.torchkit.module_graphs import BuiltGraph, build_graph, graph_batch
from specs.resume import initialises_optimizer, resume_step
from suites.checks.fsdp_graphs import roots_of
from suites.checks.state_dict import (
    FRESH_LR_FACTOR,
    FRESH_WEIGHT_DECAY,
    FullState,
    full_state,
)
from suites.checks.state_dict_full import copied

HSDP_NAMES = ("replicate", "shard")


@dataclass(frozen=True)
class Run:
    """What a run of steps leaves: this rank's loss of each step it ran, the parameters,
    optimizer state and groups (``full_state``), and every buffer's full value by name."""

    losses: tuple[float, ...]
    state: FullState
    buffers: dict[str, np.ndarray]


@dataclass
class _Training:
    built: BuiltGraph
    optimizer: torch.optim.Optimizer


def _mesh(ctx: RankContext, mesh_shape: tuple[int, ...]) -> DeviceMesh:
    """The case's 1-D mesh, or its 2-D one with HSDP's axis names."""
    return ctx.mesh(mesh_shape, HSDP_NAMES if len(mesh_shape) == 2 else None)


def build(ctx: RankContext, case: MidStepCase, *, fresh: bool = False) -> _Training:
    """The case's graph with its plan applied on its mesh, and its optimizer; ``fresh``:
    initialised from another seed, the optimizer with another lr and weight decay."""
    graph = replace(case.graph, seed=(case.graph.seed + 1) % 2**32) if fresh else case.graph
    built = build_graph(graph, ctx.device)
    mesh = _mesh(ctx, case.mesh_shape)
    options: dict[str, Any] = {}
    if case.reshard_after_forward is not None:
        options["reshard_after_forward"] = case.reshard_after_forward
    for wrap in built.graph.wraps:
        fully_shard(roots_of(built, wrap.nodes), mesh=mesh, **options)
    kwargs: dict[str, Any] = dict(case.optimizer_options)
    if fresh:
        kwargs["lr"] *= FRESH_LR_FACTOR
        kwargs["weight_decay"] += FRESH_WEIGHT_DECAY
    if case.tensor_lr:
        kwargs["lr"] = torch.tensor(kwargs["lr"])
    optimizer = getattr(torch.optim, case.optimizer)(built.root.parameters(), **kwargs)
    return _Training(built, optimizer)


Hook = Callable[[int, str], None]
"""Called at every point of every step with (step, point)."""


def _steps(ctx: RankContext, case: MidStepCase, training: _Training, first: int, at: Hook) -> Run:
    """Steps ``first..`` of the case on this rank's rows, calling ``at`` at every point."""
    built, optimizer, graph, size = training.built, training.optimizer, case.graph, ctx.world_size
    rows = slice(ctx.rank * graph.batch_per_rank, (ctx.rank + 1) * graph.batch_per_rank)
    losses = []
    for step in range(first, graph.steps):
        at(step, "between_steps")
        optimizer.zero_grad(set_to_none=case.set_to_none)
        at(step, "after_zero_grad")
        x, y = (tensor_from(a[rows], "float64", ctx.device) for a in graph_batch(graph, size, step))
        loss = F.mse_loss(built.root(x), y)
        at(step, "after_forward")
        loss.backward()
        at(step, "after_backward")
        optimizer.step()
        losses.append(float(loss.item()))
    buffers = {name: full_array(b) for name, b in built.root.named_buffers()}
    return Run(tuple(losses), full_state(built.root, optimizer), buffers)


def _nothing(step: int, point: str) -> None:
    del step, point


def uninterrupted_on_rank(ctx: RankContext, case: MidStepCase) -> Run:
    """Every step, no state dict taken."""
    return _steps(ctx, case, build(ctx, case), 0, _nothing)


def _initialises(case: MidStepCase, step: int, point: str) -> bool:
    """Whether a state dict taken there creates the optimizer's state (a stateful optimizer
    at step 0 before its backward): spec state_dict.optim.get_has_no_side_effect's deviation,
    not this suite's."""
    return not case.stateless and initialises_optimizer(step, point)


def interrupted_on_rank(ctx: RankContext, case: MidStepCase, directory: str) -> tuple[Run, Run]:
    """Every step, the state dict taken at the case's point (a copy kept in memory, or
    saved with DCP under ``directory``) and at its probe points (dropped); then a fresh
    model and optimizer loaded from it run the steps from ``specs.resume.resume_step`` on.
    (The original run, the resumed)."""
    original = build(ctx, case)
    kept: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def take(step: int, point: str) -> None:
        if (step, point) != (case.at_step, case.point):
            if point in case.probe_points and not _initialises(case, step, point):
                get_state_dict(original.built.root, original.optimizer)  # dropped
            return
        model_sd, optim_sd = get_state_dict(original.built.root, original.optimizer)
        if case.via == "dcp":
            dcp_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
        else:  # copied: set in memory, the state dict would alias the original's tensors
            kept.append(copied((model_sd, optim_sd)))

    continued = _steps(ctx, case, original, 0, take)
    fresh = build(ctx, case, fresh=True)
    if case.via == "dcp":
        model_sd, optim_sd = get_state_dict(fresh.built.root, fresh.optimizer)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        dcp_load(state, checkpoint_id=directory)
        kept.append((state["model"], state["optim"]))
    model_sd, optim_sd = kept[0]
    set_state_dict(
        fresh.built.root, fresh.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd
    )
    first = resume_step(case.at_step, case.point)
    return continued, _steps(ctx, case, fresh, first, _nothing)


@dataclass(frozen=True)
class Entry:
    """What a tensor is, told without reading values its storage does not hold: its
    class, its mesh's shape and placements (a DTensor), whether its storage holds its
    (local) elements, and those elements when it does."""

    kind: str
    mesh_shape: tuple[int, ...] | None
    placements: str | None
    stored: bool
    local: np.ndarray | None

    def described(self) -> tuple[str, tuple[int, ...] | None, str | None, bool]:
        return (self.kind, self.mesh_shape, self.placements, self.stored)


def entry(value: torch.Tensor) -> Entry:
    """``value`` as an ``Entry``. A plain tensor whose storage an FSDP reshard freed keeps
    its shape: reading it would read freed memory (a SIGSEGV, or garbage)."""
    local = value.to_local() if isinstance(value, DTensor) else value
    needed = (local.storage_offset() + local.numel()) * local.element_size()
    stored = local.numel() == 0 or local.untyped_storage().nbytes() >= needed
    values = to_numpy(local) if stored else None
    if isinstance(value, DTensor):
        mesh, placements = tuple(value.device_mesh.shape), repr(value.placements)
        return Entry("DTensor", mesh, placements, stored, values)
    return Entry(type(value).__name__, None, None, stored, values)


def tied_after_forward_on_rank(
    ctx: RankContext, case: TiedAfterForwardCase
) -> dict[tuple[str, ...], tuple[dict[str, Entry], dict[str, Entry]]]:
    """For each order of the tied group (``TIED_GROUP_ORDERS``), the case's tied pair after
    one forward: each entry of its state dict, and each parameter (every name of the tied
    one) as it is once the state dict is taken."""
    return {order: _tied_after_forward(ctx, case, order) for order in TIED_GROUP_ORDERS}


def _tied_after_forward(
    ctx: RankContext, case: TiedAfterForwardCase, order: tuple[str, ...]
) -> tuple[dict[str, Entry], dict[str, Entry]]:
    generator = torch.Generator().manual_seed(case.seed)
    first = nn.Linear(case.width, case.width, bias=False, device=ctx.device)
    second = nn.Linear(case.width, case.width, device=ctx.device)
    with torch.no_grad():
        for param in (first.weight, second.bias):
            param.copy_(torch.randn(param.shape, generator=generator))
    second.weight = first.weight
    model = nn.Sequential(first, second)
    mesh = _mesh(ctx, case.mesh_shape)
    holders: dict[str, nn.Module] = {"first": first, "second": second}
    group = [holders[name] for name in order]
    fully_shard(group, mesh=mesh, reshard_after_forward=case.reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=case.reshard_after_forward)
    model(torch.ones(2, case.width, device=ctx.device))
    taken: dict[str, Any] = (
        model.state_dict() if case.via == "state_dict" else get_model_state_dict(model)
    )
    held = model.named_parameters(remove_duplicate=False)
    return {k: entry(v) for k, v in taken.items()}, {k: entry(p) for k, p in held}
