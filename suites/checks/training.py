"""Checks of the optimizer-parity suite: rank functions that train an MLP under a layout
(``harness.torchkit.training``) or step an optimizer on plain or DTensor parameters, and the
assertions that compare them with the single-device reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from harness import RankContext
from harness.cases.schedules import ClipCase, ScheduleCase
from harness.cases.training import ParityCase, StepCase
from harness.parity import assert_close, assert_equal_values
from harness.torchkit.dtensor import full_array, tensor_from, to_numpy, to_torch_placements
from harness.torchkit.models import (
    Centering,
    build_centered_mlp,
    build_dropout_mlp,
    build_mlp,
)
from harness.torchkit.optim import (
    Trained,
    build_optimizer,
)
from harness.torchkit.schedules import Scheduled, build_schedule, clip_gradients
from harness.torchkit.training import (
    data_parallel_ranks,
    optimizer_for,
    parallelize,
    train_step,
    train_steps,
)
from specs.optimizers import OptimizerModel

PARITY_TOLERANCE = {"float64": (1e-10, 1e-12), "float32": (1e-3, 1e-6)}  # (rtol, atol)
"""A parallel training run against one device's (``assert_trained_like``)."""
PARITY_WHY = "per-rank gradients are averaged in another order than one global mean"


def train_on_rank(ctx: RankContext, case: ParityCase) -> Trained:
    """Train under ``case.layout``; this rank's losses and every full parameter."""
    model = build_mlp(case, ctx.device)
    wrapped, dp_rank = parallelize(model, case, ctx)
    return train_steps(ctx, case, wrapped, optimizer_for(model, case), dp_rank)


def checkpointed_dropout_on_rank(ctx: RankContext, case: ParityCase) -> list[Trained]:
    """A dropout model trained under ``case.layout`` without activation checkpointing, then
    with the case's, this rank's generator seeded alike before each: their losses and
    parameters.

    Only where each rank has a generator of its own (rank processes, or a world of one
    rank thread): rank threads share one, and dropout's masks would depend on how they
    interleave."""
    runs = []
    for checkpoint in (None, case.knobs.checkpoint):
        run = replace(case, knobs=replace(case.knobs, checkpoint=checkpoint))
        torch.manual_seed(case.seed * 7919 + ctx.rank)
        model = build_dropout_mlp(run, ctx.device, case.dropout)
        wrapped, dp_rank = parallelize(model, run, ctx)
        runs.append(train_steps(ctx, run, wrapped, optimizer_for(model, run), dp_rank))
    return runs


def assert_trained_like(
    reference: Trained,
    trained: list[Trained],
    case: ParityCase,
    *,
    rtol: float,
    atol: float,
    why: str,
) -> None:
    """Every step's loss (the mean over data-parallel ranks) and every rank's final
    parameters equal the single-device reference within ``rtol``/``atol`` (``why``)."""
    __tracebackhide__ = True
    tolerance = _Tolerance(case.dtype, rtol, atol, why)
    for step, expected in enumerate(reference.losses):
        losses = [trained[r].losses[step] for r in data_parallel_ranks(case)]
        mean = np.array(sum(losses) / len(losses))
        tolerance.assert_close(mean, np.array(expected), f"loss of step {step}", "loss")
    for rank, result in enumerate(trained):
        _assert_same_params(result, reference, case, rank, "", tolerance)


def assert_same_training(
    got: list[Trained],
    want: list[Trained],
    case: ParityCase,
    *,
    rtol: float,
    atol: float,
    why: str,
    against: str,
) -> None:
    """Rank by rank, the same losses at every step and the same final parameters as
    ``want`` (another layout trained on the same rows: ``against``)."""
    __tracebackhide__ = True
    tolerance = _Tolerance(case.dtype, rtol, atol, why)
    suffix = f" (against {against})"
    for rank, (result, expected) in enumerate(zip(got, want, strict=True)):
        losses, expected_losses = np.array(result.losses), np.array(expected.losses)
        tolerance.assert_close(losses, expected_losses, f"losses on rank {rank}{suffix}", "loss")
        _assert_same_params(result, expected, case, rank, suffix, tolerance)


@dataclass(frozen=True)
class _Tolerance:
    """The tolerance a caller states (``why``: why it is not zero) for one dtype; what it
    compares is recorded for the report as ``<kind>/<dtype>``."""

    dtype: str
    rtol: float
    atol: float
    why: str

    def assert_close(self, got: np.ndarray, want: np.ndarray, what: str, kind: str) -> None:
        __tracebackhide__ = True
        assert_close(
            got,
            want,
            rtol=self.rtol,
            atol=self.atol,
            dtype=self.dtype,
            what=what,
            why=self.why,
            record_as=f"{kind}/{self.dtype}",
        )


def _assert_same_params(
    result: Trained,
    expected: Trained,
    case: ParityCase,
    rank: int,
    suffix: str,
    tolerance: _Tolerance,
) -> None:
    """The same parameter names as ``expected`` and each final parameter close to it."""
    __tracebackhide__ = True
    assert_equal_values(
        sorted(result.params), sorted(expected.params), what=f"parameter names on rank {rank}"
    )
    for name, value in expected.params.items():
        what = f"{name} after {case.steps} step(s) on rank {rank}{suffix}"
        tolerance.assert_close(result.params[name], value, what, "param")


def ddp_forward_buffers_on_rank(ctx: RankContext, case: ParityCase) -> list[np.ndarray]:
    """Train ``case.steps`` steps of a centered MLP under DistributedDataParallel (each rank
    starting from buffers of its own); the running buffer at the start of every forward."""
    model = build_centered_mlp(case, ctx.device)
    centering = model[0]
    assert isinstance(centering, Centering)
    with torch.no_grad():
        centering.center.add_(ctx.rank)
    wrapped, dp_rank = parallelize(model, case, ctx)
    seen: list[np.ndarray] = []
    model.register_forward_pre_hook(lambda module, args: seen.append(to_numpy(centering.center)))
    optimizer = optimizer_for(model, case)
    for step in range(case.steps):
        train_step(wrapped, optimizer, case, dp_rank, step, ctx.device)
    return seen


def _laid_out(
    ctx: RankContext, case: StepCase | ClipCase | ScheduleCase, index: int, array: np.ndarray
) -> torch.Tensor:
    tensor = tensor_from(array, case.dtype, ctx.device)
    if case.placements is None:
        return tensor
    mesh = ctx.mesh(case.mesh_shape)
    return distribute_tensor(tensor, mesh, to_torch_placements(case.placements[index]))


@dataclass(frozen=True)
class Stepped:
    """Every parameter, whole, after the steps; and every gradient, whole, as the last step
    left it (None where the parameter had none)."""

    params: list[np.ndarray]
    grads: list[np.ndarray | None]


def step_on_rank(ctx: RankContext, case: StepCase) -> Stepped:
    """``case.steps`` steps, each handed its gradients (a collective per DTensor to gather
    the results)."""
    params: list[torch.Tensor] = [
        torch.nn.Parameter(_laid_out(ctx, case, i, a)) for i, a in enumerate(case.params())
    ]
    if dict(case.optim.options).get("differentiable", False):
        # autograd records a differentiable step: it may not update a leaf in place
        params = [param.clone() for param in params]
    optimizer = build_optimizer(case.optim, [{"params": params}])
    for step in range(case.steps):
        for i, (param, grad) in enumerate(zip(params, case.given_grads(step), strict=True)):
            param.grad = None if grad is None else _laid_out(ctx, case, i, grad)
        optimizer.step()
    grads = [None if p.grad is None else full_array(p.grad) for p in params]
    return Stepped([full_array(p.detach()) for p in params], grads)


@dataclass(frozen=True)
class Differentiated:
    """A differentiable run's parameters after its steps, and the gradient of its loss with
    respect to the initial parameters and to the first step's gradients."""

    params: list[np.ndarray]
    param_grads: list[np.ndarray | None]
    grad_grads: list[np.ndarray | None]


def differentiable_steps_on_rank(ctx: RankContext, case: StepCase) -> Differentiated:
    """``case.steps`` differentiable steps on DTensor parameters (every result whole: a
    collective per DTensor)."""
    return _differentiable_steps(case, lambda i, a: _laid_out(ctx, case, i, a))


def differentiable_steps_reference(case: StepCase, device_type: str) -> Differentiated:
    """The same steps on one device of ``device_type``: the ranks' own, so that both sides
    run the same kernels."""
    device = torch.device(device_type)
    return _differentiable_steps(case, lambda i, a: tensor_from(a, case.dtype, device))


def _differentiable_steps(
    case: StepCase, make: Callable[[int, np.ndarray], torch.Tensor]
) -> Differentiated:
    leaves = [make(i, a).requires_grad_() for i, a in enumerate(case.params())]
    params = [leaf.clone() for leaf in leaves]
    optimizer = build_optimizer(case.optim, [{"params": params}])
    first_grads: list[torch.Tensor] = []
    for step in range(case.steps):
        for i, (param, grad) in enumerate(zip(params, case.grads(step), strict=True)):
            leaf = make(i, grad).requires_grad_()
            first_grads += [leaf] if step == 0 else []
            param.grad = leaf.clone()
        optimizer.step()
    weights = case.weights()
    weighted = [(p * make(i, weights[i])).sum() for i, p in enumerate(params)]
    loss = torch.stack([_whole(term) for term in weighted]).sum()
    loss.backward()
    return Differentiated(
        params=[full_array(p.detach()) for p in params],
        param_grads=[_grad(leaf) for leaf in leaves],
        grad_grads=[_grad(leaf) for leaf in first_grads],
    )


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _grad(leaf: torch.Tensor) -> np.ndarray | None:
    """The leaf's whole gradient (a collective per DTensor), None where autograd gave none
    (torch's SGD detaches the first momentum buffer from the first gradient)."""
    return None if leaf.grad is None else full_array(leaf.grad)


def step_model(case: StepCase) -> list[np.ndarray]:
    """The spec model (``specs.optimizers``) fed the same parameters and gradients."""
    model = OptimizerModel(case.optim.name, case.optim.lr, dict(case.optim.options))
    params = case.params()
    for step in range(case.steps):
        model.step(params, case.given_grads(step))
    return params


@dataclass(frozen=True)
class Clipped:
    """A rank's gradients, whole, after clipping, and the total norm the clip returned
    (None for a clip by value); or the error the clip raised."""

    grads: list[np.ndarray]
    total: np.ndarray | None
    error: str | None = None


def clip_on_rank(ctx: RankContext, case: ClipCase) -> Clipped:
    """``case.clipping`` of the case's gradients, laid out as the case says (a collective
    per DTensor to gather the results)."""
    params = []
    for index, grad in enumerate(case.grads()):
        param = torch.nn.Parameter(_laid_out(ctx, case, index, np.zeros_like(grad)))
        param.grad = _laid_out(ctx, case, index, grad)
        params.append(param)
    try:
        total = clip_gradients(params, case.clipping)
    except RuntimeError as error:
        return Clipped([], None, f"{type(error).__name__}: {error}")
    whole = None if total is None else full_array(total)
    return Clipped([full_array(p.grad) for p in params if p.grad is not None], whole)


@dataclass(frozen=True)
class LrTrace:
    """One scheduled optimizer on one rank: each group's momentum (``momentum``, or
    ``betas[0]``; None where the optimizer has neither) before its scheduler was built, and
    each group's lr and momentum once it was (``lrs[0]``) and after each step."""

    unscheduled: tuple[float | None, ...]
    lrs: list[tuple[float, ...]]
    momenta: list[tuple[float | None, ...]]


def schedules_on_rank(ctx: RankContext, case: ScheduleCase) -> list[LrTrace]:
    """An optimizer and its scheduler for each of ``case.schedules``, over the same
    parameters (without gradients), stepped ``case.steps`` times."""
    params = [torch.nn.Parameter(_laid_out(ctx, case, i, a)) for i, a in enumerate(case.params())]
    optimizers, schedulers, traces = [], [], []
    for schedule in case.schedules:
        optimizer = _grouped_optimizer(case, params)
        unscheduled = _momenta(optimizer)
        schedulers.append(build_schedule(schedule, optimizer))
        optimizers.append(optimizer)
        traces.append(LrTrace(unscheduled, [_lrs(optimizer)], [_momenta(optimizer)]))
    for step in range(case.steps):
        for optimizer in optimizers:
            optimizer.step()
        for optimizer, scheduler, trace in zip(optimizers, schedulers, traces, strict=True):
            if case.metrics:
                scheduler.step(case.metrics[step])
            else:
                scheduler.step()
            trace.lrs.append(_lrs(optimizer))
            trace.momenta.append(_momenta(optimizer))
        if step + 1 == case.resume_after:
            optimizers, schedulers = _resumed(case, params, optimizers)
    return traces


def _resumed(
    case: ScheduleCase, params: list[torch.nn.Parameter], optimizers: list[torch.optim.Optimizer]
) -> tuple[list[torch.optim.Optimizer], list[Scheduled]]:
    """New optimizers loaded with the old ones' state dicts, then their schedulers built
    with ``last_epoch`` one short of the steps taken (``ScheduleCase.resume_after``)."""
    assert case.resume_after is not None, "only a resumed case is resumed"
    resumed, schedulers = [], []
    for schedule, old in zip(case.schedules, optimizers, strict=True):
        optimizer = _grouped_optimizer(case, params)
        optimizer.load_state_dict(old.state_dict())
        resumed.append(optimizer)
        schedulers.append(build_schedule(schedule, optimizer, last_epoch=case.resume_after - 1))
    return resumed, schedulers


def _grouped_optimizer(
    case: ScheduleCase, params: list[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    groups = [
        {
            "params": [p for i, p in enumerate(params) if case.group_of(i) == group],
            "lr": torch.tensor(lr) if case.tensor_lr else lr,
        }
        for group, lr in enumerate(case.lrs)
    ]
    # torch refuses a tensor lr to foreach kernels that are not capturable (the default on
    # an accelerator); the single-tensor ones take it on every device
    options = {"foreach": False} if case.tensor_lr else {}
    optimizer: torch.optim.Optimizer = getattr(torch.optim, case.optimizer)(groups, **options)
    return optimizer


def _lrs(optimizer: torch.optim.Optimizer) -> tuple[float, ...]:
    return tuple(float(group["lr"]) for group in optimizer.param_groups)


def _momenta(optimizer: torch.optim.Optimizer) -> tuple[float | None, ...]:
    return tuple(
        float(group["betas"][0])
        if "betas" in group
        else (float(group["momentum"]) if "momentum" in group else None)
        for group in optimizer.param_groups
    )
