"""DistributedDataParallel.join with uneven inputs: each rank's training under the join
context, and the one-device arithmetic its docs give (a joined rank's shadow all-reduces
contribute zeros; the sum is divided by the initial world size, or by the ranks still
training; with ``throw_on_early_termination`` every rank raises once one runs out)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from harness import RankContext
from harness.cases.training import JoinCase
from harness.torchkit.dtensor import tensor_from, to_numpy
from harness.torchkit.models import build_mlp
from harness.torchkit.optim import loss_of

EXHAUSTED = "exhausted"
"""A word of both errors ``throw_on_early_termination`` raises: "Rank r exhausted all
inputs." on the rank that ran out, "Detected at least one rank that exhausted inputs" on
the others."""


@dataclass(frozen=True)
class JoinRun:
    """One rank's run: its parameters after each of its steps, after the join context,
    and the error the context raised (None if none)."""

    steps: list[list[np.ndarray]]
    final: list[np.ndarray]
    error: str | None


@dataclass(frozen=True)
class JoinExpected:
    """What the docs' arithmetic gives: the parameters after each global step, and the
    steps every rank takes (all of its own, or, where one throws, the steps every rank
    had inputs for)."""

    trajectory: list[list[np.ndarray]]
    steps_of: list[int]
    throws: bool


def _batch(case: JoinCase, index: int, rank: int, device: torch.device) -> list[torch.Tensor]:
    """Seeded inputs and targets of ``rank``'s batch ``index`` (epochs repeat them)."""
    rng = np.random.default_rng([case.seed, index % case.batches_of(rank), rank])
    x = rng.uniform(-1.0, 1.0, size=(2, case.dims[0]))
    y = rng.uniform(-1.0, 1.0, size=(2, case.dims[-1]))
    return [tensor_from(x, case.dtype, device), tensor_from(y, case.dtype, device)]


def _params(model: nn.Module) -> list[np.ndarray]:
    return [to_numpy(p) for p in model.parameters()]


def ddp_join_on_rank(ctx: RankContext, case: JoinCase) -> JoinRun:
    """SGD on this rank's batches under ``ddp.join(**case.join_options())``."""
    model = build_mlp(case, ctx.device)
    ddp = DistributedDataParallel(model)
    sgd = torch.optim.SGD(ddp.parameters(), lr=case.lr)
    steps: list[list[np.ndarray]] = []
    error = None
    try:
        with ddp.join(**case.join_options()):
            for index in range(case.epochs * case.batches_of(ctx.rank)):
                x, y = _batch(case, index, ctx.rank, ctx.device)
                sgd.zero_grad()
                loss_of(ddp(x), y).backward()
                sgd.step()
                steps.append(_params(model))
    except RuntimeError as exc:
        if EXHAUSTED not in str(exc):
            raise
        error = str(exc)
    return JoinRun(steps, _params(model), error)


def join_reference(case: JoinCase, world_size: int) -> JoinExpected:
    """The join docs' arithmetic on one device: at each step the ranks with a batch left
    each add their gradient, the joined ones zeros, and the sum is divided by
    ``world_size`` (``divide_by_initial_world_size``) or by the ranks still training; SGD
    steps with it. Where one rank runs out and ``throw_on_early_termination`` is set, every
    rank stops after the steps all of them had inputs for."""
    device = torch.device("cpu")
    model = build_mlp(case, device)
    counts = [case.epochs * case.batches_of(rank) for rank in range(world_size)]
    throws = case.throw_on_early_termination and min(counts) < max(counts)
    total = min(counts) if throws else max(counts)
    trajectory = []
    for index in range(total):
        active = [rank for rank in range(world_size) if index < counts[rank]]
        divisor = world_size if case.divide_by_initial_world_size else len(active)
        grads = [np.zeros_like(p) for p in _params(model)]
        for rank in active:
            model.zero_grad()
            x, y = _batch(case, index, rank, device)
            loss_of(model(x), y).backward()
            for grad, param in zip(grads, model.parameters(), strict=True):
                assert param.grad is not None, "every parameter of an MLP gets a gradient"
                grad += to_numpy(param.grad) / divisor
        with torch.no_grad():
            for param, grad in zip(model.parameters(), grads, strict=True):
                param.sub_(case.lr * torch.from_numpy(grad))
        trajectory.append(_params(model))
    steps_of = [min(count, total) for count in counts]
    return JoinExpected(trajectory, steps_of, throws)
