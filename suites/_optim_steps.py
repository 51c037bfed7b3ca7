"""Rank function for the optimizer-step property: torch.optim on plain or DTensor
parameters, stepped with the case's gradients, gathered back to full arrays."""

from __future__ import annotations

import numpy as np
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from harness.cases import StepCase
from harness.context import RankContext
from harness.dtensor import tensor_from, to_numpy, to_torch_placements
from harness.optim import build_optimizer
from specs.optimizers import OptimizerModel


def _laid_out(ctx: RankContext, case: StepCase, index: int, array: np.ndarray) -> torch.Tensor:
    tensor = tensor_from(array, case.dtype, ctx.device)
    if case.placements is None:
        return tensor
    mesh = ctx.mesh(case.mesh_shape)
    return distribute_tensor(tensor, mesh, to_torch_placements(case.placements[index]))


def step_on_rank(ctx: RankContext, case: StepCase) -> list[np.ndarray]:
    """Every parameter, whole, after ``case.steps`` steps (a collective per DTensor)."""
    params = [torch.nn.Parameter(_laid_out(ctx, case, i, a)) for i, a in enumerate(case.params())]
    optimizer = build_optimizer(case.optim, [{"params": params}])
    for step in range(case.steps):
        for i, (param, grad) in enumerate(zip(params, case.grads(step), strict=True)):
            param.grad = _laid_out(ctx, case, i, grad)
        optimizer.step()
    return [to_numpy(p.full_tensor() if isinstance(p, DTensor) else p) for p in params]


def step_model(case: StepCase) -> list[np.ndarray]:
    """The spec model (``specs.optimizers``) fed the same parameters and gradients."""
    model = OptimizerModel(case.optim.name, case.optim.lr, dict(case.optim.options))
    params = case.params()
    for step in range(case.steps):
        model.step(params, case.grads(step))
    return params
