"""Checks of DDP's 16-bit communication hooks: the gradients one backward leaves on every
rank, and what one device computes of them by the hook's own arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from harness import RankContext
from harness.cases.training import ParityCase
from harness.parity import assert_equal_values, failure
from harness.torchkit.dtensor import tensor_from, to_numpy
from harness.torchkit.models import build_mlp
from harness.torchkit.optim import loss_of, rows_of, step_batch
from harness.torchkit.training import parallelize

_SIXTEEN_BITS = {"float16": torch.float16, "bfloat16": torch.bfloat16}
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
"""Half the spacing of the dtype's numbers just above 1: a sum rounded to it moves by at
most this much of its magnitude."""
SUBNORMAL_SPACING = {"float16": 2.0**-24, "bfloat16": 2.0**-133}
"""The spacing of the dtype's smallest numbers: a rounding below its normal range moves by
at most half of it, whatever the magnitude."""


def hooked_grads_on_rank(ctx: RankContext, case: ParityCase) -> dict[str, np.ndarray]:
    """One forward and backward of this rank's rows of step 0 under DDP with the case's
    hook; every parameter's gradient as the hook left it."""
    model = build_mlp(case, ctx.device)
    wrapped, dp_rank = parallelize(model, case, ctx)
    grads = _backward(wrapped, model, case, dp_rank, ctx.device)
    return {name: to_numpy(grad) for name, grad in grads.items()}


def _backward(
    call: nn.Module, model: nn.Module, case: ParityCase, dp_rank: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """``call`` (``model``, or a wrapper of it) forward and backward on data-parallel rank
    ``dp_rank``'s rows of step 0; ``model``'s gradients by name."""
    inputs, targets = step_batch(case, 0)
    rows = rows_of(case, dp_rank)
    output = call(tensor_from(inputs[rows], case.dtype, device))
    loss_of(output, tensor_from(targets[rows], case.dtype, device)).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@dataclass(frozen=True)
class RoundedMean:
    """Per parameter, the exact sum of the ranks' contributions as the hook makes them
    (each rank's gradient rounded to ``dtype``, then divided by the world size in it), and
    the sum of their magnitudes, which bounds the rounding of summing them in ``dtype``."""

    dtype: str
    ranks: int
    sums: dict[str, np.ndarray]
    magnitudes: dict[str, np.ndarray]

    def bound(self, name: str) -> np.ndarray:
        """How far a sum of the ranks' contributions rounded to ``dtype`` after each
        addition, in any order, may lie from the exact sum (the classic bound of recursive
        summation, plus half a subnormal spacing per rounding)."""
        u, tiny = UNIT_ROUNDOFF[self.dtype], SUBNORMAL_SPACING[self.dtype]
        return (self.ranks - 1) * u * self.magnitudes[name] + self.ranks * tiny


def rounded_mean(case: ParityCase) -> RoundedMean:
    """What the case's rounding hook must leave, computed on one device from each
    data-parallel rank's own gradient (rank 0's initial parameters, which DDP broadcasts)."""
    dtype = case.comm_hook.dtype if case.comm_hook is not None else None
    assert dtype is not None, f"{case.comm_hook} is no rounding hook"
    ranks, device = case.data_parallel, torch.device("cpu")
    sums: dict[str, np.ndarray] = {}
    magnitudes: dict[str, np.ndarray] = {}
    for rank in range(ranks):
        model = build_mlp(case, device)
        for name, grad in _backward(model, model, case, rank, device).items():
            contribution = grad.to(_SIXTEEN_BITS[dtype]).div_(ranks).double().numpy()
            sums[name] = sums.get(name, 0.0) + contribution
            magnitudes[name] = magnitudes.get(name, 0.0) + np.abs(contribution)
    return RoundedMean(dtype, ranks, sums, magnitudes)


def assert_within_rounding(got: np.ndarray, want: RoundedMean, name: str, *, what: str) -> None:
    """``got`` lies within the rounding bound of the exact sum of the contributions."""
    __tracebackhide__ = True
    exact, bound = want.sums[name], want.bound(name)
    assert_equal_values(got.shape, exact.shape, what=f"shape of {what}")
    outside = ~(np.abs(got.astype(np.float64) - exact) <= bound)
    if outside.any():
        index = tuple(int(i) for i in np.argwhere(outside)[0])
        raise failure(
            f"{what}: got {got[index].item()!r} at index {index}, should be "
            f"{exact[index].item()!r} within {bound[index].item():.3g} (a {want.dtype} sum of "
            f"{want.ranks} rank(s)' contributions rounded after each addition); "
            f"{int(outside.sum())} of {got.size} elements outside"
        )
