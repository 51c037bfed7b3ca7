"""The lr schedule and the gradient clipping of a training step (``cases.schedules``), as
torch builds and applies them: the same calls on one device and on every rank."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from harness.cases.schedules import LAMBDA_FACTORS, Clipping, Schedule
from harness.cases.training import OptimConfig

_NO_IMPROVEMENT = 1.0
"""The metric ``ReduceLROnPlateau`` is stepped with where the caller gives none: the same
every step, so none after the first improves on it."""


class Scheduled:
    """A built scheduler, stepped after each optimizer step (``ReduceLROnPlateau`` with a
    metric)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self, metric: float = _NO_IMPROVEMENT) -> None:
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.scheduler.step(metric)
        else:
            self.scheduler.step()


def build_scheduler(config: OptimConfig, optimizer: torch.optim.Optimizer) -> Scheduled | None:
    """The scheduler of ``config.scheduler`` over ``optimizer``, or None."""
    if config.scheduler is None:
        return None
    return build_schedule(config.scheduler, optimizer)


def build_schedule(
    schedule: Schedule, optimizer: torch.optim.Optimizer, *, last_epoch: int | None = None
) -> Scheduled:
    """``schedule`` built over ``optimizer`` (its ``lr_lambda`` names made the functions of
    ``cases.schedules.LAMBDA_FACTORS``, one or one per group); ``last_epoch`` given to the
    scheduler itself (a ``SequentialLR``'s parts are built as new) where it is not None."""
    return Scheduled(_build(schedule, optimizer, last_epoch))


def _build(
    schedule: Schedule, optimizer: torch.optim.Optimizer, last_epoch: int | None = None
) -> Any:
    cls = getattr(torch.optim.lr_scheduler, schedule.name)
    options = dict(schedule.options)
    if "lr_lambda" in options:
        named = options["lr_lambda"]
        per_group = isinstance(named, tuple)
        options["lr_lambda"] = (
            [LAMBDA_FACTORS[name] for name in named] if per_group else LAMBDA_FACTORS[named]
        )
    if schedule.parts:
        options["schedulers"] = [_build(part, optimizer) for part in schedule.parts]
    if last_epoch is not None:
        options["last_epoch"] = last_epoch
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
