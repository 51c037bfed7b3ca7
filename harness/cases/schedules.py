"""What a training step does around ``optimizer.step()``: the learning-rate schedule stepped
after it, and the gradients clipped before it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.errors import check_one_of, require
from specs.placements import Placement

SCHEDULERS = (
    *("StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR"),
    *("CosineAnnealingLR", "LambdaLR", "SequentialLR", "OneCycleLR", "ReduceLROnPlateau"),
)
"""The ``torch.optim.lr_scheduler`` schedulers a training run steps."""
LR_LAMBDAS = ("inverse_step", "halve_after_two")
"""The factors a ``LambdaLR`` is given, by name (``torchkit.schedules``): a case holds
no callable, so it pickles to rank processes."""
MOMENTUM_CYCLED = ("SGD", "Adam", "AdamW", "RMSprop", "Adamax", "NAdam", "RAdam")
"""The optimizers with a ``momentum`` or ``betas`` that ``OneCycleLR(cycle_momentum=True)``
cycles; it refuses the others."""


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
