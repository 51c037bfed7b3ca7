"""Rank functions and single-device references of the tensor-parallel suite: the
Colwise/Rowwise MLP (with and without sequence parallelism), tied weights, loss_parallel."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from harness import RankContext
from harness.cases.tp import LossCase, TiedCase, TPCase, TransformerCase
from harness.torchkit import shared_contexts
from harness.torchkit.collectives import CountKey, counting
from harness.torchkit.dtensor import (
    from_torch_placements,
    full_array,
    tensor_from,
    to_numpy,
    to_torch_placements,
)
from harness.torchkit.models import Transformer, build_mlp, build_tied, build_transformer
from harness.torchkit.optim import (
    build_optimizer,
    loss_of,
    param_groups,
    step_batch,
)
from harness.torchkit.schedules import build_scheduler
from specs.loss_parallel import Rejected, target_placements
from specs.placements import Placement


@dataclass(frozen=True)
class TPTrace:
    """What a training run shows: this rank's output at every step (the whole output, or
    its rows under sequence parallelism), the full gradients after the first backward, the
    full parameters after the last step, the collectives of the first forward and backward."""

    outputs: tuple[np.ndarray, ...]
    grads: dict[str, np.ndarray]
    params: dict[str, np.ndarray]
    counts: dict[CountKey, int] = field(default_factory=dict)


def _plan(case: TPCase) -> dict[str, Any]:
    local = case.local_output
    if case.sequence_parallel:
        return {
            "0": ColwiseParallel(input_layouts=Shard(0)),
            "2": RowwiseParallel(output_layouts=Shard(0), use_local_output=local),
        }
    return {"0": ColwiseParallel(), "2": RowwiseParallel(use_local_output=local)}


def _local_rows(output: torch.Tensor) -> torch.Tensor:
    """This rank's rows of the output (a DTensor output's local piece)."""
    return output.to_local() if isinstance(output, DTensor) else output


def _rank_loss(case: TPCase, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """This rank's share of the loss over the global batch. A DTensor output meets a DTensor
    target of its layout (made from this rank's rows, no collective): the loss is then the
    global mean itself. Under sequence parallelism a local output's mean over its rows is
    tp times its share of the global mean."""
    if isinstance(output, DTensor):
        target = DTensor.from_local(targets, output.device_mesh, output.placements)
        return loss_of(output, target)
    share = case.tp if case.sequence_parallel else 1
    return loss_of(output, targets) / share


def _rows(case: TPCase, rank: int) -> slice:
    """This rank's rows of the batch: all of them, or its piece under sequence parallelism."""
    if not case.sequence_parallel:
        return slice(None)
    per_rank = case.training.batch_per_rank // case.tp
    return slice(rank * per_rank, (rank + 1) * per_rank)


def tp_train_on_rank(ctx: RankContext, case: TPCase) -> TPTrace:
    t = case.training
    model = build_mlp(t, ctx.device)
    parallelize_module(model, ctx.mesh((ctx.world_size,)), _plan(case))
    optimizer = build_optimizer(t.optim, param_groups(model, t.optim))
    scheduler = build_scheduler(t.optim, optimizer)
    rows = _rows(case, ctx.rank)
    outputs, grads, counts = [], {}, {}
    for step in range(t.steps):
        inputs, targets = step_batch(t, step)
        optimizer.zero_grad()
        with counting() as seen:
            output = model(tensor_from(inputs[rows], t.dtype, ctx.device))
            target = tensor_from(targets[rows], t.dtype, ctx.device)
            _rank_loss(case, output, target).backward()
        outputs.append(to_numpy(_local_rows(output)))
        if step == 0:
            grads = {
                n: full_array(p.grad) for n, p in model.named_parameters() if p.grad is not None
            }
            counts = dict(seen)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    params = {n: full_array(p) for n, p in model.named_parameters()}
    return TPTrace(tuple(outputs), grads, params, counts)


def tp_reference(case: TPCase) -> TPTrace:
    """The same model, optimizer and global batches on one device."""
    t = case.training
    model = build_mlp(t, torch.device("cpu"))
    optimizer = build_optimizer(t.optim, param_groups(model, t.optim))
    scheduler = build_scheduler(t.optim, optimizer)
    outputs, grads = [], {}
    for step in range(t.steps):
        inputs, targets = step_batch(t, step)
        optimizer.zero_grad()
        output = model(tensor_from(inputs, t.dtype, torch.device("cpu")))
        loss_of(output, tensor_from(targets, t.dtype, torch.device("cpu"))).backward()
        outputs.append(to_numpy(output))
        if step == 0:
            grads = {n: to_numpy(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return TPTrace(tuple(outputs), grads, {n: to_numpy(p) for n, p in model.named_parameters()})


def tp_inference_on_rank(ctx: RankContext, case: TPCase) -> np.ndarray:
    """One forward of the parallelized MLP under ``torch.inference_mode``."""
    t = case.training
    with torch.inference_mode():
        model = build_mlp(t, ctx.device)
        parallelize_module(model, ctx.mesh((ctx.world_size,)), _plan(case))
        inputs, _ = step_batch(t, 0)
        output = model(tensor_from(inputs[_rows(case, ctx.rank)], t.dtype, ctx.device))
        return to_numpy(_local_rows(output))


def reference_output(case: TPCase) -> np.ndarray:
    inputs, _ = step_batch(case.training, 0)
    model = build_mlp(case.training, torch.device("cpu"))
    with torch.no_grad():
        return to_numpy(model(tensor_from(inputs, case.training.dtype, torch.device("cpu"))))


def _tokens(case: TiedCase) -> torch.Tensor:
    rng = np.random.default_rng(case.seed)
    return torch.from_numpy(rng.integers(0, case.vocab, size=case.tokens))


@dataclass(frozen=True)
class TiedResult:
    untied_weights_differ: bool
    untied_grads_differ: bool
    same_parameter: bool
    same_grad: bool
    output: np.ndarray
    grad: np.ndarray


def _local(tensor: torch.Tensor | None) -> torch.Tensor:
    assert tensor is not None
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def tied_on_rank(ctx: RankContext, case: TiedCase) -> TiedResult:
    """Upstream's order: untied TP model (local weights and gradients differ), then
    ``fc.weight = embedding.weight`` and a forward and backward of the tied model."""
    model = build_tied(case, ctx.device)
    plan = {"embedding": ColwiseParallel(), "fc": RowwiseParallel()}
    parallelize_module(model, ctx.mesh((ctx.world_size,)), plan)
    tokens = _tokens(case).to(ctx.device)
    weights_differ = not torch.equal(_local(model.embedding.weight), _local(model.fc.weight))
    model(tokens).sum().backward()
    grads_differ = not torch.equal(
        _local(model.embedding.weight.grad), _local(model.fc.weight.grad)
    )
    model.zero_grad()
    model.fc.weight = model.embedding.weight
    output = model(tokens)
    output.sum().backward()
    grad = model.embedding.weight.grad
    assert grad is not None
    return TiedResult(
        untied_weights_differ=weights_differ,
        untied_grads_differ=grads_differ,
        same_parameter=model.fc.weight is model.embedding.weight,
        same_grad=model.fc.weight.grad is grad,
        output=full_array(output),
        grad=full_array(grad),
    )


def tied_reference(case: TiedCase) -> tuple[np.ndarray, np.ndarray]:
    """Output and the one gradient of the tied model on one device."""
    model = build_tied(case, torch.device("cpu"))
    model.fc.weight = model.embedding.weight
    output = model(_tokens(case))
    output.sum().backward()
    grad = model.embedding.weight.grad
    assert grad is not None
    return to_numpy(output), to_numpy(grad)


@dataclass(frozen=True)
class LossResult:
    """What ``cross_entropy`` under ``loss_parallel`` did on one rank: the exception it
    raised, or the loss's and the input gradient's placements and full values, and the
    collectives of the forward and of the backward."""

    error: tuple[str, str] | None = None
    loss_placements: tuple[Placement | str, ...] = ()
    grad_placements: tuple[Placement | str, ...] = ()
    loss: np.ndarray | None = None
    grad: np.ndarray | None = None
    forward: dict[CountKey, int] = field(default_factory=dict)
    backward: dict[CountKey, int] = field(default_factory=dict)


def loss_inputs(case: LossCase) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Seeded input, target classes and (optional) class weights."""
    rng = np.random.default_rng(case.seed)
    x = rng.uniform(-2.0, 2.0, size=case.shape)
    target = rng.integers(0, case.classes, size=(case.shape[0], *case.shape[2:]))
    weight = rng.uniform(0.1, 1.0, size=case.classes) if case.weighted else None
    return x, target, weight


def _dist_input(case: LossCase, x: torch.Tensor, mesh: Any) -> DTensor:
    placements = case.spec_placements()
    if "partial" not in case.placements:
        return distribute_tensor(x, mesh, to_torch_placements(placements))
    # distribute_tensor cannot make Partial: every rank contributes its piece of x.
    torch_placements = to_torch_placements(placements)
    replicated = [Replicate() if p == Partial() else p for p in torch_placements]
    local = distribute_tensor(x, mesh, replicated).to_local()
    return DTensor.from_local(local, mesh, torch_placements, run_check=False)


def loss_on_rank(ctx: RankContext, case: LossCase) -> LossResult:
    """``cross_entropy`` of the distributed input under ``loss_parallel``, and backward."""
    x, target, weight = loss_inputs(case)
    mesh = ctx.mesh(case.mesh_shape)
    dist_x = _dist_input(case, tensor_from(x, case.dtype, ctx.device), mesh).requires_grad_()
    target_t = torch.from_numpy(target).to(ctx.device)
    if not case.target_plain:
        placements = to_torch_placements(target_placements(case.spec_placements()))
        target_t = distribute_tensor(target_t, mesh, placements)
    weight_t = None if weight is None else tensor_from(weight, case.dtype, ctx.device)
    with shared_contexts.loss_parallel():
        try:
            with counting() as forward:
                loss = F.cross_entropy(dist_x, target_t, weight_t, reduction=case.reduction)
        except (ValueError, NotImplementedError, RuntimeError) as exc:
            return LossResult(error=(type(exc).__name__, str(exc)))
        with counting() as backward:
            grad = _backward(case, loss, dist_x, mesh)
    assert isinstance(loss, DTensor)
    assert isinstance(grad, DTensor)
    return LossResult(
        loss_placements=from_torch_placements(loss.placements),
        grad_placements=from_torch_placements(grad.placements),
        loss=full_array(loss),
        grad=full_array(grad),
        forward=dict(forward),
        backward=dict(backward),
    )


def _backward(case: LossCase, loss: torch.Tensor, x: torch.Tensor, mesh: Any) -> torch.Tensor:
    if case.replicated_grad_output:
        ones = torch.ones(loss.shape, dtype=loss.dtype, device=x.device)
        replicated = distribute_tensor(ones, mesh, [Replicate()] * mesh.ndim)
        (grad,) = torch.autograd.grad(loss, x, grad_outputs=replicated)
        return grad
    (loss.sum() if case.reduction == "none" else loss).backward()
    assert x.grad is not None
    return x.grad


def loss_reference(case: LossCase) -> tuple[np.ndarray, np.ndarray]:
    """The loss and the input gradient of ``F.cross_entropy`` on one device."""
    x, target, weight = loss_inputs(case)
    cpu = torch.device("cpu")
    xt = tensor_from(x, case.dtype, cpu).requires_grad_()
    weight_t = None if weight is None else tensor_from(weight, case.dtype, cpu)
    loss = F.cross_entropy(xt, torch.from_numpy(target), weight_t, reduction=case.reduction)
    (loss.sum() if case.reduction == "none" else loss).backward()
    assert xt.grad is not None
    return to_numpy(loss.detach()), to_numpy(xt.grad)


def rejection_message(case: LossCase, rejected: Rejected) -> str:
    """torch 2.13's whole message for the layout the reference model rejects (its
    fragment says which rule), with the placements printed as torch prints them."""
    placements = to_torch_placements(case.spec_placements())
    if "exactly one mesh dim" in rejected.message:
        count = sum(p == 1 for p in case.placements)
        return (
            "loss_parallel() requires exactly one mesh dim to shard tensor dimension 1, "
            f"but got placements {placements} with {count} such mesh dim(s)."
        )
    if "Shard or Replicate" in rejected.message:
        axis = case.placements.index("partial")
        return (
            "loss_parallel() expects non-TP mesh dims to be Shard or Replicate, "
            f"got {placements[axis]} at dim {axis}."
        )
    if "requires a DTensor" in rejected.message:
        target = to_torch_placements(target_placements(case.spec_placements()))
        return (
            "loss_parallel() requires a DTensor (not a plain torch.Tensor) when the derived "
            f"placements {target} contain Shard — this happens on a multi-dimensional mesh "
            "with a batch-sharded non-TP dim. Wrap the tensor with DTensor.from_local or "
            "distribute_tensor to make the sharding explicit."
        )
    return (
        "loss_parallel() with reduction='mean' is only supported on one-dimensional "
        f"DeviceMesh; got mesh with ndim={len(case.mesh_shape)}. Use reduction='sum' or "
        "'none' instead."
    )


@dataclass(frozen=True)
class TransformerTrace:
    """The output of every step (whole, on every rank), the full gradients after the first
    backward, the full parameters after the last step, and the collectives of the first
    step's forward, backward and optimizer step."""

    outputs: tuple[np.ndarray, ...]
    grads: dict[str, np.ndarray]
    params: dict[str, np.ndarray]
    counts: tuple[dict[CountKey, int], ...] = field(default=())


def _root_plan(case: TransformerCase) -> dict[str, Any]:
    if case.sequence_parallel:
        return {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "norm": _sequence_parallel(case),
        }
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    }


def _sequence_parallel(case: TransformerCase) -> SequenceParallel:
    if case.sequence_dim is not None:
        return SequenceParallel(
            sequence_dim=case.sequence_dim, use_local_output=case.norm_local_output
        )
    return SequenceParallel(use_local_output=case.norm_local_output)


def _attention_input(case: TransformerCase) -> Any:
    """The SP attention's input gathered along the sequence; its output (what ``wo``'s
    row-wise plan already handed on, a local Shard(1) piece) declared as it is."""
    local = case.local_attention_input
    if not case.prepare_input_output:
        return PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=local
        )
    return PrepareModuleInputOutput(
        input_layouts=Shard(1),
        desired_input_layouts=Replicate(),
        use_local_input=local,
        output_layouts=Shard(1),
        desired_output_layouts=Shard(1),
    )


def _layer_plan(case: TransformerCase) -> dict[str, Any]:
    sp = case.sequence_parallel
    plan: dict[str, Any] = {}
    if sp:
        plan["attention"] = _attention_input(case)
        plan["attention_norm"] = _sequence_parallel(case)
        plan["ffn_norm"] = _sequence_parallel(case)
    for name in ("wq", "wk", "wv"):
        plan[f"attention.{name}"] = ColwiseParallel()
    plan["attention.wo"] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
    plan["feed_forward.w1"] = ColwiseParallel(input_layouts=Shard(1)) if sp else ColwiseParallel()
    plan["feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
    return plan


def _head_plan(case: TransformerCase) -> ColwiseParallel:
    inputs = Shard(1) if case.sequence_parallel else None
    if case.sharded_head:
        return ColwiseParallel(
            input_layouts=inputs, output_layouts=Shard(-1), use_local_output=False
        )
    return ColwiseParallel(input_layouts=inputs, output_layouts=Replicate())


def parallelize_transformer(model: Transformer, mesh: Any, case: TransformerCase) -> Transformer:
    """Upstream's plan, spelled as the case says (per block or with ``layers.*`` keys);
    the attention projections hand on local outputs, so each rank's attention runs over
    its own heads."""
    rank = {"src_data_rank": case.src_data_rank}
    if case.wildcard_plan:
        blocks = {f"layers.*.{key}": style for key, style in _layer_plan(case).items()}
        parallelize_module(model, mesh, {**_root_plan(case), **blocks}, **rank)
    else:
        parallelize_module(model, mesh, _root_plan(case), **rank)
        for layer in model.layers:
            parallelize_module(layer, mesh, _layer_plan(case), **rank)
    parallelize_module(model.output, mesh, _head_plan(case), **rank)
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


def targets(case: TransformerCase, step: int) -> torch.Tensor:
    """The target token of every position (seeded apart from the input tokens)."""
    rng = np.random.default_rng((case.seed, step, 1))
    return torch.from_numpy(rng.integers(0, case.vocab, size=(case.batch * case.seq_len,)))


def _loss(
    output: torch.Tensor, case: TransformerCase, step: int, device: torch.device
) -> torch.Tensor:
    """The sum of the output, or its cross-entropy against the step's targets: under
    ``loss_parallel()`` where the logits are a DTensor (sharded over the vocabulary)."""
    if not case.parallel_loss:
        return output.sum()
    logits, target = output.flatten(0, 1), targets(case, step).to(device)
    if not isinstance(output, DTensor):
        return F.cross_entropy(logits, target)
    with shared_contexts.loss_parallel():
        return F.cross_entropy(logits, target)


def _loss_backward(loss: torch.Tensor, case: TransformerCase) -> None:
    """loss_parallel's backward runs under it too, as its documentation asks."""
    if case.parallel_loss and isinstance(loss, DTensor):
        with shared_contexts.loss_parallel():
            loss.backward()
    else:
        loss.backward()


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
            loss = _loss(output, case, step, device)
        with counting() as backward:
            _loss_backward(loss, case)
        # Norm weights stay plain tensors without sequence parallelism; Adam's foreach
        # kernels then mix them with DTensors, which upstream allows this way.
        with implicit_replication(), counting() as step_counts:
            optimizer.step()
        outputs.append(full_array(output.detach()))
        if step == 0:
            grads = {
                n: full_array(p.grad) for n, p in model.named_parameters() if p.grad is not None
            }
            counts = (dict(forward), dict(backward), dict(step_counts))
    params = {n: full_array(p.detach()) for n, p in model.named_parameters()}
    return TransformerTrace(tuple(outputs), grads, params, counts)


def transformer_on_rank(ctx: RankContext, case: TransformerCase) -> TransformerTrace:
    model = build_transformer(case, ctx.device)
    parallelize_transformer(model, ctx.mesh((ctx.world_size,)), case)
    return _trace(model, case, ctx.device)


def transformer_reference(case: TransformerCase) -> TransformerTrace:
    """The same model, tokens and optimizer on one device."""
    cpu = torch.device("cpu")
    trace = _trace(build_transformer(case, cpu), case, cpu)
    return TransformerTrace(trace.outputs, trace.grads, trace.params)
