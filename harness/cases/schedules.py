"""What a training step does around ``optimizer.step()``: the learning-rate schedule stepped
after it, and the gradients clipped before it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.cases import seeded_arrays
from harness.errors import check_int, check_one_of, require
from specs.placements import Placement

SCHEDULERS = (
    *("StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR"),
    *("CosineAnnealingLR", "LambdaLR", "SequentialLR", "OneCycleLR", "ReduceLROnPlateau"),
)
"""The ``torch.optim.lr_scheduler`` schedulers a training run steps."""


def _inverse_step(epoch: int) -> float:
    return 1.0 / (epoch + 1)


def _halve_after_two(epoch: int) -> float:
    return 1.0 if epoch < 2 else 0.5


LAMBDA_FACTORS: dict[str, Callable[[int], float]] = {
    "inverse_step": _inverse_step,
    "halve_after_two": _halve_after_two,
}
"""The functions a ``LambdaLR`` is given (its factor of the initial lr at each epoch), by
name: a case holds the name, not the callable, so it pickles to rank processes."""
LR_LAMBDAS = tuple(LAMBDA_FACTORS)
MOMENTUM_CYCLED = ("SGD", "Adam", "AdamW", "RMSprop", "Adamax", "NAdam", "RAdam")
"""The optimizers with a ``momentum`` or ``betas`` that ``OneCycleLR(cycle_momentum=True)``
cycles; it refuses the others."""
SCHEDULED_OPTIMIZERS = (*MOMENTUM_CYCLED, "Adagrad")
"""The optimizers a ``ScheduleCase`` steps: those, and one without a momentum."""
TENSOR_LR = ("SGD", "Adam", "AdamW")
"""The optimizers whose documentation says their lr may be a tensor."""
RESUMABLE = tuple(name for name in SCHEDULERS if name != "ReduceLROnPlateau")
"""The schedulers a resumed run rebuilds with ``last_epoch``: ``ReduceLROnPlateau`` has none
(its state is its ``state_dict``)."""
PER_GROUP = {
    "OneCycleLR": ("max_lr", "base_momentum", "max_momentum"),
    "ReduceLROnPlateau": ("min_lr",),
    "LambdaLR": ("lr_lambda",),
}
"""The options of a scheduler that may be given as one value per parameter group."""


@dataclass(frozen=True)
class Schedule:
    """A scheduler of ``name`` with ``options`` (keyword arguments but the optimizer),
    stepped once after every optimizer step. ``SequentialLR`` runs ``parts`` in turn, the
    next from each of ``options``' ``milestones``; ``ReduceLROnPlateau`` is stepped with a
    metric that never improves after the first step (the same on every rank, unlike a rank's
    own loss), so it cuts the lr every ``patience + 1`` steps."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    parts: tuple[Schedule, ...] = ()

    def __post_init__(self) -> None:
        check_one_of("name", self.name, SCHEDULERS)
        sequential = self.name == "SequentialLR"
        require(sequential or not self.parts, "parts", self.parts, "() unless SequentialLR")
        milestones = len(dict(self.options).get("milestones", ())) if sequential else 0
        enough = not sequential or len(self.parts) == milestones + 1 >= 2
        require(enough, "parts", self.parts, "one more than the milestones, at least two")

    def describe(self) -> str:
        options = [f"{k}={v}" for k, v in self.options]
        options += [f"[{', '.join(part.describe() for part in self.parts)}]"] if self.parts else []
        return f"{self.name}({', '.join(options)})"


CLIPS = ("norm", "value", "total_norm")
"""``clip_grad_norm_``; ``clip_grad_value_``; ``get_total_norm`` of the gradients handed
to ``clip_grads_with_norm_`` (the two halves of ``clip_grad_norm_``, as a loop that logs the
norm calls them)."""


@dataclass(frozen=True, kw_only=True)
class Clipping:
    """The gradients of all parameters clipped before each optimizer step, by ``how``
    (``CLIPS``) to ``bound`` (the total norm's maximum, or each element's magnitude)."""

    how: str
    bound: float
    norm_type: float = 2.0
    foreach: bool | None = None
    error_if_nonfinite: bool = False

    def __post_init__(self) -> None:
        check_one_of("how", self.how, CLIPS)
        require(self.bound > 0, "bound", self.bound, "> 0")
        by_value = self.how == "value"
        plain = self.norm_type == 2.0 and not self.error_if_nonfinite
        require(not by_value or plain, "how", self.how, "a norm clip where norm options are set")

    def describe(self) -> str:
        foreach = f", foreach={self.foreach}" if self.foreach is not None else ""
        if self.how == "value":
            return f"clip_grad_value_({self.bound}{foreach})"
        nonfinite = ", error_if_nonfinite=True" if self.error_if_nonfinite else ""
        norm = f"norm_type={self.norm_type}{nonfinite}{foreach}"
        if self.how == "norm":
            return f"clip_grad_norm_({self.bound}, {norm})"
        return f"clip_grads_with_norm_({self.bound}, get_total_norm({norm}))"


NONFINITE = ("inf", "nan")
"""The non-finite values a clip case can put into a gradient."""


@dataclass(frozen=True, kw_only=True)
class ClipCase:
    """Seeded gradients of ``shapes`` (times ``scale``), plain tensors on every rank or
    DTensors laid out by ``placements`` (one tuple per gradient, one placement per axis of
    ``mesh_shape``), clipped once by ``clipping``. ``nonfinite`` puts inf or nan into
    gradient ``at[0]`` at flat index ``at[1]``."""

    mesh_shape: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    placements: tuple[tuple[Placement, ...], ...] | None
    dtype: str
    seed: int
    clipping: Clipping
    scale: float = 1.0
    nonfinite: str | None = None
    at: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        check_one_of("dtype", self.dtype, ("float32", "float64"))
        require(bool(self.shapes), "shapes", self.shapes, "at least one gradient")
        if self.nonfinite is None:
            return
        check_one_of("nonfinite", self.nonfinite, NONFINITE)
        index, flat = self.at
        fits = 0 <= index < len(self.shapes) and 0 <= flat < math.prod(self.shapes[index])
        require(fits, "at", self.at, f"an element of one of the gradients {self.shapes}")

    def grads(self) -> list[np.ndarray]:
        """The gradients, rounded to ``dtype`` and held in float64."""
        rng = np.random.default_rng([self.seed, 7])
        grads = [self.scale * rng.uniform(-1.0, 1.0, size=shape) for shape in self.shapes]
        if self.nonfinite is not None:
            index, flat = self.at
            grads[index].reshape(-1)[flat] = math.inf if self.nonfinite == "inf" else math.nan
        return [np.asarray(g, dtype=self.dtype).astype(np.float64) for g in grads]

    def call(self) -> str:
        layout = (
            "plain tensors"
            if self.placements is None
            else (f"DTensors on mesh {self.mesh_shape} with placements {list(self.placements)}")
        )
        poisoned = f", {self.nonfinite} at gradient {self.at[0]}[{self.at[1]}]"
        return (
            f"{self.clipping.describe()} of {self.dtype} gradients {list(self.shapes)} "
            f"(scale {self.scale}) as {layout}{poisoned if self.nonfinite else ''}"
        )


@dataclass(frozen=True, kw_only=True)
class ScheduleCase:
    """Seeded parameters of ``shapes`` (plain tensors on every rank, or DTensors laid out by
    ``placements``, one tuple per parameter over ``mesh_shape``) in ``len(lrs)`` parameter
    groups (parameter ``i`` in group ``i % len(lrs)``; group ``g``'s initial lr ``lrs[g]``, a
    0-d tensor where ``tensor_lr``), and for each of ``schedules`` an ``optimizer`` over them
    with that scheduler (several optimizers, each scheduled on its own, as a model's parts
    are). ``steps`` times: every ``optimizer.step()``, then every scheduler's ``step()``
    (``ReduceLROnPlateau``'s with ``metrics[t]``). The parameters have no gradients: each
    ``optimizer.step()`` skips them and is there for the documented order, optimizer before
    scheduler; what a step computes is ``optim.step.matches_spec``'s, and a DTensor step of
    shapes the sharding propagation has not seen would triple an example's cost."""

    mesh_shape: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    placements: tuple[tuple[Placement, ...], ...] | None
    dtype: str
    seed: int
    optimizer: str
    lrs: tuple[float, ...]
    schedules: tuple[Schedule, ...]
    steps: int
    metrics: tuple[float, ...] = ()
    tensor_lr: bool = False
    resume_after: int | None = None
    """Resume every optimizer and scheduler after this many steps, as a run restored from a
    checkpoint does: a new optimizer over the same parameters loaded with the old one's
    ``state_dict()``, then the scheduler built anew with ``last_epoch=resume_after - 1``
    (its constructor's own step brings it to epoch ``resume_after``, keeping the loaded lrs:
    pytorch/pytorch#102261). None: never."""

    def __post_init__(self) -> None:
        check_one_of("dtype", self.dtype, ("float32", "float64"))
        check_one_of("optimizer", self.optimizer, SCHEDULED_OPTIMIZERS)
        if self.resume_after is not None:
            inside = 1 <= self.resume_after < self.steps
            require(inside, "resume_after", self.resume_after, f"None or in [1, {self.steps})")
            for schedule in self.schedules:
                check_one_of("schedules' names", schedule.name, RESUMABLE)
        check_int("steps", self.steps)
        require(bool(self.schedules), "schedules", self.schedules, "at least one")
        require(bool(self.lrs), "lrs", self.lrs, "one initial lr per group, at least one")
        groups = len(self.lrs)
        enough = len(self.shapes) >= groups
        require(enough, "shapes", self.shapes, f"a parameter for each of the {groups} groups")
        laid_out = self.placements is None or len(self.placements) == len(self.shapes)
        require(laid_out, "placements", self.placements, "None or one per parameter")
        plateau = any(s.name == "ReduceLROnPlateau" for s in self.schedules)
        one_each = len(self.metrics) == (self.steps if plateau else 0)
        require(one_each, "metrics", self.metrics, "one per step for ReduceLROnPlateau, else ()")
        takes = not self.tensor_lr or self.optimizer in TENSOR_LR
        require(takes, "tensor_lr", self.tensor_lr, f"False but for {TENSOR_LR}")
        for schedule in self.schedules:
            self._check(schedule, groups)

    def _check(self, schedule: Schedule, groups: int) -> None:
        one_cycle = schedule.name == "OneCycleLR"
        cycles = one_cycle and dict(schedule.options).get("cycle_momentum", True)
        has = not cycles or self.optimizer in MOMENTUM_CYCLED
        require(has, "optimizer", self.optimizer, f"one of {MOMENTUM_CYCLED} to cycle")
        for each in (schedule, *schedule.parts):
            for name, value in each.options:
                if isinstance(value, tuple) and name in PER_GROUP.get(each.name, ()):
                    require(len(value) == groups, name, value, f"one value per group, {groups}")

    def group_of(self, index: int) -> int:
        """The parameter group of parameter ``index``."""
        return index % len(self.lrs)

    def params(self) -> list[np.ndarray]:
        """The initial parameters, rounded to ``dtype`` and held in float64."""
        return seeded_arrays((self.seed, 0), self.shapes, self.dtype)

    def call(self) -> str:
        layout = (
            "plain tensors"
            if self.placements is None
            else f"DTensors on mesh {self.mesh_shape} with placements {list(self.placements)}"
        )
        lrs = [f"tensor({lr})" if self.tensor_lr else lr for lr in self.lrs]
        metrics = f", metrics {list(self.metrics)}" if self.metrics else ""
        if self.resume_after is not None:
            metrics += (
                f", resumed after step {self.resume_after} (optimizer.load_state_dict, then "
                f"the scheduler built with last_epoch={self.resume_after - 1})"
            )
        return (
            f"{self.steps} step(s) of {[s.describe() for s in self.schedules]}{metrics}, each "
            f"over an {self.optimizer} with group lrs {lrs} ({self.dtype} params "
            f"{list(self.shapes)} as {layout}, param i in group i % {len(self.lrs)})"
        )


def changes_lr_at(schedule: Schedule, epoch: int) -> bool:
    """Whether a ``StepLR``, ``MultiStepLR`` or ``ConstantLR`` changes the lr on reaching
    ``epoch`` (a decay, or the end of the constant factor): the epochs where a scheduler
    rebuilt with ``last_epoch=epoch - 1`` applies that change a second time in torch 2.13
    (the constructor's step; pytorch/pytorch#102261 was fixed for the others only). False
    for every other scheduler."""
    options = dict(schedule.options)
    if schedule.name == "StepLR":
        return epoch % int(options["step_size"]) == 0
    if schedule.name == "MultiStepLR":
        return epoch in options["milestones"]
    if schedule.name == "ConstantLR":
        return epoch == int(options.get("total_iters", 5))  # ConstantLR's default
    return False


REPEATS_ITS_CHANGE = ("StepLR", "MultiStepLR", "ConstantLR")
"""The schedulers ``changes_lr_at`` speaks of."""
