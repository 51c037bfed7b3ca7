"""Checks of DDP's 16-bit communication hooks: the gradients one backward leaves on every
rank, and what one device computes of them by the hook's own arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

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
    inputs, targets = step_batch(case, 0)
    rows = rows_of(case, dp_rank)
    output = wrapped(tensor_from(inputs[rows], case.dtype, ctx.device))
    loss_of(output, tensor_from(targets[rows], case.dtype, ctx.device)).backward()
    return {n: to_numpy(p.grad) for n, p in model.named_parameters() if p.grad is not None}


@dataclass(frozen=True)
class RoundedMean:
    """Per parameter, the exact sum of the ranks' contributions as the hook makes them
    (each rank's gradient rounded to ``dtype``, then divided by the world size in it), and
    the sum of their magnitudes, which bounds the rounding of summing them in ``dtype``."""

    dtype: str
    sums: dict[str, np.ndarray]
    magnitudes: dict[str, np.ndarray]

    def bound(self, name: str, ranks: int) -> np.ndarray:
        """How far a sum of ``ranks`` contributions rounded to ``dtype`` after each addition,
        in any order, may lie from the exact sum (the classic bound of recursive
        summation, plus half a subnormal spacing per rounding)."""
        u, tiny = UNIT_ROUNDOFF[self.dtype], SUBNORMAL_SPACING[self.dtype]
        return (ranks - 1) * u * self.magnitudes[name] + ranks * tiny


def rounded_mean(case: ParityCase, dtype: str) -> RoundedMean:
    """What the hook must leave, computed on one device from each data-parallel rank's own
    gradient (rank 0's initial parameters, which DDP broadcasts)."""
    ranks = case.data_parallel
    sums: dict[str, np.ndarray] = {}
    magnitudes: dict[str, np.ndarray] = {}
    for rank in range(ranks):
        for name, grad in _local_grads(case, rank).items():
            contribution = grad.to(_SIXTEEN_BITS[dtype]).div_(ranks).double().numpy()
            sums[name] = sums.get(name, 0.0) + contribution
            magnitudes[name] = magnitudes.get(name, 0.0) + np.abs(contribution)
    return RoundedMean(dtype, sums, magnitudes)


def _local_grads(case: ParityCase, rank: int) -> dict[str, torch.Tensor]:
    device = torch.device("cpu")
    model = build_mlp(case, device)
    inputs, targets = step_batch(case, 0)
    rows = rows_of(case, rank)
    output = model(tensor_from(inputs[rows], case.dtype, device))
    loss_of(output, tensor_from(targets[rows], case.dtype, device)).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_within_rounding(
    got: np.ndarray, want: RoundedMean, name: str, ranks: int, *, what: str
) -> None:
    """``got`` lies within the rounding bound of the exact sum of the contributions."""
    __tracebackhide__ = True
    exact, bound = want.sums[name], want.bound(name, ranks)
    assert_equal_values(got.shape, exact.shape, what=f"shape of {what}")
    outside = ~(np.abs(got.astype(np.float64) - exact) <= bound)
    if outside.any():
        index = tuple(int(i) for i in np.argwhere(outside)[0])
        raise failure(
            f"{what}: got {got[index].item()!r} at index {index}, should be "
            f"{exact[index].item()!r} within {bound[index].item():.3g} (a {want.dtype} sum of "
            f"{ranks} rank(s)' contributions rounded after each addition); "
            f"{int(outside.sum())} of {got.size} elements outside"
        )
