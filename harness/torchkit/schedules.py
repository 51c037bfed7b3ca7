"""The lr schedule and the gradient clipping of a training step (``cases.schedules``), as
torch builds and applies them: the same calls on one device and on every rank."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from harness.cases.schedules import Clipping, Schedule
from harness.cases.training import OptimConfig

_NO_IMPROVEMENT = 1.0
"""The metric ``ReduceLROnPlateau`` is stepped with: the same every step, so none after the
first improves on it."""


def _inverse_step(step: int) -> float:
    return 1.0 / (step + 1)


def _halve_after_two(step: int) -> float:
    return 1.0 if step < 2 else 0.5


LR_LAMBDAS: dict[str, Callable[[int], float]] = {
    "inverse_step": _inverse_step,
    "halve_after_two": _halve_after_two,
}


class Scheduled:
    """A built scheduler, stepped after each optimizer step (``ReduceLROnPlateau`` with a
    metric)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self) -> None:
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.scheduler.step(_NO_IMPROVEMENT)
        else:
            self.scheduler.step()


def build_scheduler(config: OptimConfig, optimizer: torch.optim.Optimizer) -> Scheduled | None:
    """The scheduler of ``config.scheduler`` over ``optimizer``, or None."""
    if config.scheduler is None:
        return None
    return Scheduled(_build(config.scheduler, optimizer))


def _build(schedule: Schedule, optimizer: torch.optim.Optimizer) -> Any:
    cls = getattr(torch.optim.lr_scheduler, schedule.name)
    options = dict(schedule.options)
    if "lr_lambda" in options:
        options["lr_lambda"] = LR_LAMBDAS[options["lr_lambda"]]
    if schedule.parts:
        options["schedulers"] = [_build(part, optimizer) for part in schedule.parts]
    return cls(optimizer, **options)


def clip_gradients(
    parameters: Iterable[torch.Tensor], clipping: Clipping | None
) -> torch.Tensor | None:
    """Clip the gradients of ``parameters`` as ``clipping`` says (nothing for None); the
    total norm a norm clip measured (None for a clip by value)."""
    if clipping is None:
        return None
    params = list(parameters)
    if clipping.how == "value":
        torch.nn.utils.clip_grad_value_(params, clipping.bound, foreach=clipping.foreach)
        return None
    norm = (clipping.norm_type, clipping.error_if_nonfinite, clipping.foreach)
    if clipping.how == "norm":
        return torch.nn.utils.clip_grad_norm_(params, clipping.bound, *norm)
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, *norm)
    torch.nn.utils.clip_grads_with_norm_(params, clipping.bound, total, foreach=clipping.foreach)
    return total
