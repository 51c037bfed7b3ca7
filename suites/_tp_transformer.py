"""Rank functions and the single-device reference of the tensor-parallel Transformer:
upstream's plan (test_tp_examples.py's ``Transformer.parallelize``) applied to
``harness.models.Transformer``, trained on the sum of its output with Adam."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from harness.collectives import CountKey, counting
from harness.context import RankContext
from harness.dtensor import to_numpy
from harness.models import Transformer, build_transformer
from harness.parallel_cases import TransformerCase


@dataclass(frozen=True)
class TransformerTrace:
    """The output of every step (whole, on every rank), the full gradients after the first
    backward, the full parameters after the last step, and the collectives of the first
    step's forward, backward and optimizer step."""

    outputs: tuple[np.ndarray, ...]
    grads: dict[str, np.ndarray]
    params: dict[str, np.ndarray]
    counts: tuple[dict[CountKey, int], ...] = field(default=())


def _root_plan(sp: bool) -> dict[str, Any]:
    if sp:
        return {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "norm": SequenceParallel(),
        }
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    }


def _layer_plan(sp: bool) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    if sp:
        plan["attention"] = PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate()
        )
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    for name in ("wq", "wk", "wv"):
        plan[f"attention.{name}"] = ColwiseParallel()
    plan["attention.wo"] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
    plan["feed_forward.w1"] = ColwiseParallel(input_layouts=Shard(1)) if sp else ColwiseParallel()
    plan["feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
    return plan


def parallelize(model: Transformer, mesh: Any, case: TransformerCase) -> Transformer:
    """Upstream's plan; the attention projections hand on local outputs, so each rank's
    attention runs over its own heads."""
    sp = case.sequence_parallel
    parallelize_module(model, mesh, _root_plan(sp))
    for layer in model.layers:
        parallelize_module(layer, mesh, _layer_plan(sp))
    output = (
        ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
        if sp
        else ColwiseParallel(output_layouts=Replicate())
    )
    parallelize_module(model.output, mesh, output)
    if case.weight_tying:
        # Both are Shard(0) of a (vocab, dim) weight: one parameter, one gradient.
        model.output.weight = model.tok_embeddings.weight
    return model


def _freeze(model: nn.Module, case: TransformerCase) -> list[nn.Parameter]:
    for name, param in model.named_parameters():
        param.requires_grad_(case.requires_grad(name))
    return [p for p in model.parameters() if p.requires_grad]


def tokens(case: TransformerCase, step: int) -> torch.Tensor:
    rng = np.random.default_rng((case.seed, step))
    return torch.from_numpy(rng.integers(0, case.vocab, size=(case.batch, case.seq_len)))


def _full(tensor: torch.Tensor) -> np.ndarray:
    return to_numpy(tensor.full_tensor() if isinstance(tensor, DTensor) else tensor)


def _trace(model: nn.Module, case: TransformerCase, device: torch.device) -> TransformerTrace:
    optimizer = torch.optim.Adam(
        _freeze(model, case), lr=case.lr, eps=case.eps, foreach=case.foreach
    )
    outputs, grads = [], {}
    counts: tuple[dict[CountKey, int], ...] = ()
    for step in range(case.steps):
        optimizer.zero_grad()
        with counting() as forward:
            output = model(tokens(case, step).to(device))
        with counting() as backward:
            output.sum().backward()
        # Norm weights stay plain tensors without sequence parallelism; Adam's foreach
        # kernels then mix them with DTensors, which upstream allows this way.
        with implicit_replication(), counting() as step_counts:
            optimizer.step()
        outputs.append(to_numpy(output.detach()))
        if step == 0:
            grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
            counts = (dict(forward), dict(backward), dict(step_counts))
    params = {n: _full(p.detach()) for n, p in model.named_parameters()}
    return TransformerTrace(tuple(outputs), grads, params, counts)


def transformer_on_rank(ctx: RankContext, case: TransformerCase) -> TransformerTrace:
    model = build_transformer(case, ctx.device)
    parallelize(model, ctx.mesh((ctx.world_size,)), case)
    return _trace(model, case, ctx.device)


def transformer_reference(case: TransformerCase) -> TransformerTrace:
    """The same model, tokens and optimizer on one device."""
    cpu = torch.device("cpu")
    trace = _trace(build_transformer(case, cpu), case, cpu)
    return TransformerTrace(trace.outputs, trace.grads, trace.params)
