"""Small models the suites train, built identically on every rank from a seed."""

from __future__ import annotations

import itertools
import math
from typing import Protocol

import numpy as np
import torch
from torch import nn

from harness.cases import MLPCase
from harness.dtensor import torch_dtype


@torch.no_grad()
def seeded_init_(module: nn.Module, seed: int) -> nn.Module:
    """Overwrite every parameter and buffer from an explicit generator seeded with ``seed``.

    Rank threads share torch's global RNG, so constructors' default init can differ between
    ranks; values drawn here, in registration order, never do.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tensors = itertools.chain(module.named_parameters(), module.named_buffers())
    for _, tensor in tensors:
        fan_in = tensor.shape[-1] if tensor.ndim > 1 else max(1, tensor.numel())
        bound = 1.0 / math.sqrt(max(1, fan_in))
        values = torch.empty(tensor.shape, dtype=torch.float64).uniform_(
            -bound, bound, generator=generator
        )
        tensor.copy_(values)
    return module


class MLPShape(Protocol):
    """What ``build_mlp`` reads from a case."""

    @property
    def dims(self) -> tuple[int, ...]: ...
    @property
    def bias(self) -> bool: ...
    @property
    def dtype(self) -> str: ...
    @property
    def seed(self) -> int: ...


def build_mlp(case: MLPShape, device: torch.device) -> nn.Sequential:
    """Linear(d0, d1), ReLU, Linear(d1, d2), ... with seeded values, on ``device``."""
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(itertools.pairwise(case.dims)):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(d_in, d_out, bias=case.bias))
    model = nn.Sequential(*layers)
    model.to(device=device, dtype=torch_dtype(case.dtype))
    seeded_init_(model, case.seed)
    return model


def global_batch(case: MLPCase, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets of the whole batch; rank ``r`` trains on rows ``r*b:(r+1)*b``."""
    rng = np.random.default_rng(case.seed + 1)
    rows = world_size * case.batch_per_rank
    inputs = rng.uniform(-1.0, 1.0, size=(rows, case.dims[0]))
    targets = rng.uniform(-1.0, 1.0, size=(rows, case.dims[-1]))
    return inputs, targets
