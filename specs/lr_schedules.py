"""Learning-rate schedules as the ``torch.optim.lr_scheduler`` documentation states them, per
parameter group, in float64.

A schedule is followed from its construction (step 0) through ``steps`` calls of ``step()``;
the lr of group ``g`` at step ``t``, from the group's initial lr ``base`` (closed forms;
torch's chainable schedulers reach the same values by multiplying a factor per step):

- ``StepLR``: ``base * gamma ** (t // step_size)``; ``MultiStepLR``: ``base * gamma ** n``,
  ``n`` the milestones at or before ``t`` (one counted as often as it is listed);
  ``ExponentialLR``: ``base * gamma ** t``.
- ``ConstantLR``: ``base * factor`` before ``total_iters``, ``base`` from then on;
  ``LinearLR``: ``base * (start + (end - start) * min(t, total_iters) / total_iters)``.
- ``CosineAnnealingLR``: ``eta_min + (base - eta_min) * (1 + cos(pi * t / T_max)) / 2``, no
  restarts (``T_cur = t``).
- ``LambdaLR``: ``base * lr_lambda(t)``, one function for every group or one per group.
- ``SequentialLR``: scheduler ``k`` runs on the interval from milestone ``k - 1`` (0 for the
  first) to milestone ``k``, counting its own steps from 0 at its start; a scheduler whose
  interval is empty (a milestone 0, or one listed twice) never runs.
- ``OneCycleLR``: from ``max_lr / div_factor`` up to ``max_lr``, then down to
  ``initial / final_div_factor`` at step ``total_steps - 1``, the first phase ending at step
  ``pct_start * total_steps - 1``; with ``three_phase`` the second phase mirrors the first
  (back to the initial lr at step ``2 * pct_start * total_steps - 2``) and a third anneals to
  the minimum. Each phase anneals by cosine (``end + (start - end) * (1 + cos(pi * pct)) / 2``)
  or linearly over the fraction ``pct`` of the phase done. With ``cycle_momentum`` the momentum
  (``betas[0]`` for Adam-like optimizers) goes the other way: from ``max_momentum`` down to
  ``base_momentum`` and back (and stays at ``max_momentum`` in a third phase). The group's own
  lr plays no part.
- ``ReduceLROnPlateau``: stepped with a metric; a metric that is better than the best so far by
  more than the threshold (``best * (1 -+ threshold)`` in ``rel`` mode, ``best -+ threshold``
  in ``abs`` mode, for ``min`` and ``max`` mode) becomes the best, any other is a bad epoch;
  bad epochs during a cooldown are not counted; more than ``patience`` bad epochs in a row
  multiply each group's lr by ``factor``, no lower than its ``min_lr``, unless that lowers it
  by ``eps`` or less, and start a cooldown of ``cooldown`` steps.

Options left out take the documented defaults. ``max_lr``, ``base_momentum``,
``max_momentum``, ``min_lr`` and ``lr_lambda`` may also be given one per group.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from harness.errors import check_int, check_one_of, fail, require

_DEFAULTS: dict[str, dict[str, Any]] = {
    "StepLR": {"step_size": None, "gamma": 0.1},
    "MultiStepLR": {"milestones": None, "gamma": 0.1},
    "ConstantLR": {"factor": 1.0 / 3, "total_iters": 5},
    "LinearLR": {"start_factor": 1.0 / 3, "end_factor": 1.0, "total_iters": 5},
    "ExponentialLR": {"gamma": None},
    "CosineAnnealingLR": {"T_max": None, "eta_min": 0.0},
    "LambdaLR": {"lr_lambda": None},
    "SequentialLR": {"milestones": None},
    "OneCycleLR": {
        **{"max_lr": None, "total_steps": None, "epochs": None, "steps_per_epoch": None},
        **{"pct_start": 0.3, "anneal_strategy": "cos", "cycle_momentum": True},
        **{"base_momentum": 0.85, "max_momentum": 0.95, "div_factor": 25.0},
        **{"final_div_factor": 1e4, "three_phase": False},
    },
    "ReduceLROnPlateau": {
        **{"mode": "min", "factor": 0.1, "patience": 10, "threshold": 1e-4},
        **{"threshold_mode": "rel", "cooldown": 0, "min_lr": 0.0, "eps": 1e-8},
    },
}
"""Each scheduler's options (but the optimizer) and their documented defaults; None where
the option has none (it must be given), or for ``OneCycleLR``'s length, which is
``total_steps`` or ``epochs * steps_per_epoch``."""
SCHEDULERS = tuple(_DEFAULTS)
"""The schedulers modelled."""
_CLOSED_FORM = (
    *("StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR"),
    *("CosineAnnealingLR", "LambdaLR"),
)
_REQUIRED = {
    **{name: tuple(k for k, v in d.items() if v is None) for name, d in _DEFAULTS.items()},
    "OneCycleLR": ("max_lr",),
}
"""The options each scheduler must be given."""
_PER_GROUP = ("max_lr", "base_momentum", "max_momentum", "min_lr", "lr_lambda")

LrLambda = Callable[[int], float]


class Described(Protocol):
    """A scheduler as a case describes it: its name, its options but the optimizer (the
    ``lr_lambda`` of ``LambdaLR`` by name), the schedulers a ``SequentialLR`` runs in turn."""

    @property
    def name(self) -> str: ...

    @property
    def options(self) -> tuple[tuple[str, Any], ...]: ...

    @property
    def parts(self) -> Sequence[Described]: ...


@dataclass(frozen=True)
class Trajectory:
    """Each group's lr at construction (``lrs[0]``) and after each ``step()`` (``lrs[t]``);
    the momentum ``OneCycleLR(cycle_momentum=True)`` sets alike, else None."""

    lrs: list[tuple[float, ...]]
    momenta: list[tuple[float, ...]] | None


def trajectory(
    schedule: Described,
    lrs: Sequence[float],
    steps: int,
    *,
    metrics: Sequence[float] = (),
    lr_lambdas: Mapping[str, LrLambda] | None = None,
) -> Trajectory:
    """The lrs of groups whose initial lrs are ``lrs`` under ``schedule`` stepped ``steps``
    times (``ReduceLROnPlateau`` with ``metrics``, one a step); ``lr_lambdas``: the
    functions a ``LambdaLR``'s ``lr_lambda`` names."""
    check_int("steps", steps, minimum=0)
    require(bool(lrs), "lrs", lrs, "one initial lr per group, at least one group")
    options = _options(schedule, len(lrs))
    plateau = schedule.name == "ReduceLROnPlateau"
    require(plateau or not metrics, "metrics", metrics, "() but for ReduceLROnPlateau")
    if plateau:
        require(len(metrics) == steps, "metrics", metrics, f"one per step, {steps}")
        return Trajectory(_plateau(options, list(lrs), metrics), None)
    if schedule.name == "OneCycleLR":
        return _one_cycle(options, len(lrs), steps)
    functions = dict(lr_lambdas or {})
    return Trajectory(
        [_lrs_at(schedule, options, lrs, t, functions) for t in range(steps + 1)], None
    )


def _options(schedule: Described, groups: int) -> dict[str, Any]:
    """``schedule``'s options over its defaults, every per-group option checked."""
    check_one_of("name", schedule.name, SCHEDULERS)
    defaults = _DEFAULTS[schedule.name]
    given = dict(schedule.options)
    if unknown := sorted(set(given) - set(defaults)):
        fail("options", given, f"options {schedule.name} takes ({sorted(defaults)}), not {unknown}")
    options = {**defaults, **given}
    required = [k for k, v in options.items() if v is None and k in _REQUIRED[schedule.name]]
    require(not required, "options", given, f"{schedule.name}'s {required} given")
    for name in _PER_GROUP:
        value = options.get(name)
        if isinstance(value, tuple | list):
            require(len(value) == groups, name, value, f"one value per group, {groups}")
    sequential = schedule.name == "SequentialLR"
    require(sequential or not schedule.parts, "parts", schedule.parts, "() unless SequentialLR")
    if sequential:
        milestones = list(options["milestones"])
        require(milestones == sorted(milestones), "milestones", milestones, "in order")
        enough = len(schedule.parts) == len(milestones) + 1
        require(enough, "parts", schedule.parts, "one more than the milestones")
        for part in schedule.parts:
            check_one_of("part", part.name, _CLOSED_FORM)
    return options


def _per_group(value: Any, group: int) -> Any:
    return value[group] if isinstance(value, tuple | list) else value


def _lrs_at(
    schedule: Described,
    options: Mapping[str, Any],
    lrs: Sequence[float],
    t: int,
    functions: Mapping[str, LrLambda],
) -> tuple[float, ...]:
    """Every group's lr at step ``t`` of a closed-form schedule or a ``SequentialLR``."""
    if schedule.name == "SequentialLR":
        milestones = list(options["milestones"])
        active = bisect_right(milestones, t)
        start = milestones[active - 1] if active else 0
        part = schedule.parts[active]
        part_options = _options(part, len(lrs))
        return _lrs_at(part, part_options, lrs, t - start, functions)
    return tuple(
        _closed_form(schedule.name, options, base, t, group, functions)
        for group, base in enumerate(lrs)
    )


def _closed_form(
    name: str,
    options: Mapping[str, Any],
    base: float,
    t: int,
    group: int,
    functions: Mapping[str, LrLambda],
) -> float:
    if name == "StepLR":
        return float(base * options["gamma"] ** (t // options["step_size"]))
    if name == "MultiStepLR":
        return float(base * options["gamma"] ** sum(m <= t for m in options["milestones"]))
    if name == "ExponentialLR":
        return float(base * options["gamma"] ** t)
    if name == "ConstantLR":
        return float(base * options["factor"] if t < options["total_iters"] else base)
    if name == "LinearLR":
        start, end, total = options["start_factor"], options["end_factor"], options["total_iters"]
        return float(base * (start + (end - start) * min(t, total) / total))
    if name == "CosineAnnealingLR":
        eta_min = options["eta_min"]
        return float(
            eta_min + (base - eta_min) * (1 + math.cos(math.pi * t / options["T_max"])) / 2
        )
    lr_lambda = _per_group(options["lr_lambda"], group)
    if lr_lambda not in functions:
        fail("lr_lambda", lr_lambda, f"one of the lr_lambdas given ({sorted(functions)})")
    return float(base * functions[lr_lambda](t))


def _one_cycle(options: Mapping[str, Any], groups: int, steps: int) -> Trajectory:
    total = options["total_steps"]
    if total is None:
        require(
            options["epochs"] is not None and options["steps_per_epoch"] is not None,
            "options",
            dict(options),
            "total_steps, or epochs and steps_per_epoch",
        )
        total = options["epochs"] * options["steps_per_epoch"]
    require(steps < total, "steps", steps, f"< total_steps={total} (the cycle's last step)")
    check_one_of("anneal_strategy", options["anneal_strategy"], ("cos", "linear"))
    pct_start = options["pct_start"]
    ends = [pct_start * total - 1, total - 1.0]
    if options["three_phase"]:
        ends = [pct_start * total - 1, 2 * pct_start * total - 2, total - 1.0]
    anneal = _anneal(options["anneal_strategy"])
    lr_rows, momentum_rows = [], []
    for t in range(steps + 1):
        phase, pct = _phase_at(ends, t)
        lr_row, momentum_row = [], []
        for group in range(groups):
            top = _per_group(options["max_lr"], group)
            initial = top / options["div_factor"]
            lowest = initial / options["final_div_factor"]
            low_m = _per_group(options["base_momentum"], group)
            high_m = _per_group(options["max_momentum"], group)
            if options["three_phase"]:
                lr_points = [initial, top, initial, lowest]
                momentum_points = [high_m, low_m, high_m, high_m]
            else:
                lr_points, momentum_points = [initial, top, lowest], [high_m, low_m, high_m]
            lr_row.append(anneal(lr_points[phase], lr_points[phase + 1], pct))
            momentum_row.append(anneal(momentum_points[phase], momentum_points[phase + 1], pct))
        lr_rows.append(tuple(lr_row))
        momentum_rows.append(tuple(momentum_row))
    return Trajectory(lr_rows, momentum_rows if options["cycle_momentum"] else None)


def _phase_at(ends: Sequence[float], t: int) -> tuple[int, float]:
    """The phase step ``t`` falls in (the last one past its end) and the fraction of it done."""
    start = 0.0
    for phase, end in enumerate(ends):
        if t <= end or phase == len(ends) - 1:
            return phase, (t - start) / (end - start)
        start = end
    fail("ends", ends, "at least one phase")


def _anneal(strategy: str) -> Callable[[float, float, float], float]:
    if strategy == "cos":
        return lambda start, end, pct: end + (start - end) / 2 * (1 + math.cos(math.pi * pct))
    return lambda start, end, pct: start + (end - start) * pct


def _plateau(
    options: Mapping[str, Any], lrs: list[float], metrics: Sequence[float]
) -> list[tuple[float, ...]]:
    mode, threshold_mode = options["mode"], options["threshold_mode"]
    check_one_of("mode", mode, ("min", "max"))
    check_one_of("threshold_mode", threshold_mode, ("rel", "abs"))
    threshold = options["threshold"]
    best = math.inf if mode == "min" else -math.inf
    bad, cooldown_left = 0, 0
    rows = [tuple(lrs)]
    for metric in metrics:
        if _better(metric, best, mode, threshold_mode, threshold):
            best, bad = metric, 0
        else:
            bad += 1
        if cooldown_left > 0:
            cooldown_left -= 1
            bad = 0
        if bad > options["patience"]:
            for group, lr in enumerate(lrs):
                lowered = max(lr * options["factor"], _per_group(options["min_lr"], group))
                if lr - lowered > options["eps"]:
                    lrs[group] = lowered
            cooldown_left, bad = options["cooldown"], 0
        rows.append(tuple(lrs))
    return rows


def _better(metric: float, best: float, mode: str, threshold_mode: str, threshold: float) -> bool:
    if threshold_mode == "rel":
        bound = best * (1 - threshold) if mode == "min" else best * (1 + threshold)
    else:
        bound = best - threshold if mode == "min" else best + threshold
    return metric < bound if mode == "min" else metric > bound
