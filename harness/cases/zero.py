"""Cases of the ZeroRedundancyOptimizer properties that are the ZeRO suite's own (the shared
training cases live in ``harness.cases.training``): plain, picklable values."""

from __future__ import annotations

from dataclasses import dataclass

from harness.cases.training import OptimConfig
from harness.errors import check_int, require


@dataclass(frozen=True)
class FrozenGroupsCase:
    """Free-standing seeded float64 parameters in parameter groups, some not requiring
    gradients (``requires_grad=False``, no gradient), stepped by ZeRO and by the same
    ``torch.optim`` optimizer on one device with seeded gradients that are the same on every
    rank (as if already averaged); from step ``switch`` on, ``refrozen`` (when set) says
    which parameters are frozen instead."""

    groups: tuple[tuple[tuple[int, ...], ...], ...]
    """Each group's parameter shapes."""
    frozen: tuple[tuple[bool, ...], ...]
    refrozen: tuple[tuple[bool, ...], ...] | None
    switch: int
    optim: OptimConfig
    lr_scales: tuple[float, ...]
    """Each group's lr is ``optim.lr`` times its scale."""
    steps: int
    bucket_view: bool
    """``parameters_as_bucket_view``."""
    seed: int

    def __post_init__(self) -> None:
        check_int("steps", self.steps, 1)
        require(bool(self.groups), "groups", self.groups, "at least one group")
        shape = [len(g) for g in self.groups]
        require([len(f) for f in self.frozen] == shape, "frozen", self.frozen, "a flag per param")
        if self.refrozen is not None:
            same = [len(f) for f in self.refrozen] == shape
            require(same, "refrozen", self.refrozen, "a flag per parameter")
        require(
            len(self.lr_scales) == len(self.groups), "lr_scales", self.lr_scales, "one per group"
        )
        require(0 <= self.switch < self.steps, "switch", self.switch, f"in [0, {self.steps})")

    def frozen_at(self, step: int) -> tuple[tuple[bool, ...], ...]:
        """Which parameters are frozen during ``step``."""
        if self.refrozen is not None and step >= self.switch:
            return self.refrozen
        return self.frozen

    def call(self) -> str:
        change = f", from step {self.switch} frozen {self.refrozen}" if self.refrozen else ""
        return (
            f"ZeroRedundancyOptimizer(groups of shapes {self.groups}, lr x {self.lr_scales}, "
            f"frozen {self.frozen}{change}, {self.optim.describe()}, "
            f"parameters_as_bucket_view={self.bucket_view}), {self.steps} step(s)"
        )
