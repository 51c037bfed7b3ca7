"""Rank functions of the compile suite's training property: one training run eager and one
with each block compiled (``CompiledTrainingCase``), on the same rows and seeds."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
from torch import nn

from harness import RankContext
from harness.cases.compile import CompiledTrainingCase
from harness.torchkit.compile import BLOCK_PREFIX, BlockGraphs, compile_blocks, refusal_of
from harness.torchkit.models import build_mlp
from harness.torchkit.optim import Trained
from harness.torchkit.training import (
    dtensor_full_params,
    optimizer_for,
    parallelize,
    train_steps,
)
from suites.checks.training import train_on_rank


@dataclass(frozen=True)
class CompiledTraining:
    """A rank's eager run, and its compiled run (None where torch refused to compile)."""

    eager: Trained
    compiled: Trained | None
    graphs: int
    """Graphs the backend was handed for this rank's blocks."""
    refusal: str
    """Why torch refused (``refusal_of``), else ``""``."""


def compiled_training_on_rank(ctx: RankContext, case: CompiledTrainingCase) -> CompiledTraining:
    eager = train_on_rank(ctx, case.training)
    training = case.training
    model = build_mlp(training, ctx.device)
    counted = BlockGraphs()
    compile_all = partial(compile_blocks, backend=case.backend, counted=counted)
    wrapped, dp_rank = parallelize(model, training, ctx, before_fully_shard=compile_all)
    optimizer = optimizer_for(model, training)
    try:
        compiled = train_steps(ctx, training, wrapped, optimizer, dp_rank, full_params=_params)
    except Exception as error:
        refusal = refusal_of(error)
        if refusal is None:
            raise
        return CompiledTraining(eager, None, counted.graphs, refusal)
    return CompiledTraining(eager, compiled, counted.graphs, "")


def _params(model: nn.Module) -> dict[str, np.ndarray]:
    """Every full parameter by the eager model's name."""
    return {n.replace(BLOCK_PREFIX, ""): v for n, v in dtensor_full_params(model).items()}
