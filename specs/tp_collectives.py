"""Reference model of the collectives upstream's tensor-parallel Transformer plan issues.

The plan (test_tp_examples.py's ``Transformer.parallelize``): token and position embeddings
RowwiseParallel; per block wq/wk/wv ColwiseParallel, wo RowwiseParallel, w1 Colwise, w2
Rowwise; output ColwiseParallel with a replicated output. Under sequence parallelism the
residual stream is sharded on the sequence dim: embeddings and Rowwise layers
reduce-scatter into it, the attention input (PrepareModuleInput), w1 and the output
projection all-gather out of it, and LayerNorms are SequenceParallel (replicated weights
whose gradients stay Partial until the optimizer reads them).

Forward collectives are fixed by the plan. In backward, a forward collective's adjoint
runs exactly when its input requires grad: an all-reduce of a Partial output (or a
reduce-scatter) becomes nothing (or an all-gather) and an all-gather becomes a
reduce-scatter; without sequence parallelism each Colwise layer all-reduces its input's
Partial gradient. Adam reads each gradient three times (``lerp`` once, ``addcmul`` twice),
and every read of a Partial gradient all-reduces it: three all-reduces per trainable
SequenceParallel norm parameter. A one-rank mesh issues nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from harness.errors import require

Counts = dict[str, int]
ADAM_GRAD_READS = 3
LOSS_PARALLEL_ALL_REDUCES = 3


def _prefix_flags(n_layers: int, rg: Callable[[str], bool]) -> list[dict[str, bool]]:
    """Per block, whether each point of the residual stream requires grad."""
    h = rg("tok_embeddings.weight") or rg("pos_embeddings.weight")
    blocks = []
    for i in range(n_layers):
        p = f"layers.{i}."
        attn_in = h or rg(p + "attention_norm.weight") or rg(p + "attention_norm.bias")
        projections = ("wq", "wk", "wv", "wo")
        wo_out = attn_in or any(rg(f"{p}attention.{w}.weight") for w in projections)
        h = h or wo_out
        w1_in = h or rg(p + "ffn_norm.weight") or rg(p + "ffn_norm.bias")
        ffn = ("w1.weight", "w1.bias", "w2.weight", "w2.bias")
        w2_out = w1_in or any(rg(f"{p}feed_forward.{w}") for w in ffn)
        h = h or w2_out
        blocks.append({"attn_in": attn_in, "wo_out": wo_out, "w1_in": w1_in, "w2_out": w2_out})
    blocks.append({"out_in": h or rg("norm.weight") or rg("norm.bias")})
    return blocks


def transformer_collectives(
    *,
    tp: int,
    sequence_parallel: bool,
    n_layers: int,
    trainable: Callable[[str], bool],
    sharded_head: bool = False,
    local_attention_input: bool = False,
    parallel_loss: bool = False,
) -> tuple[Counts, Counts, Counts]:
    """(forward, backward, optimizer step) collective counts per operation, over the TP
    group, of one training step; ``trainable(name)`` says whether a parameter requires
    grad (a tied output weight is the token embedding's). ``sharded_head``: the output
    head leaves its logits sharded over the vocabulary, so the forward gathers them not.
    ``local_attention_input``: under sequence parallelism the gathered attention input is
    handed on as a local tensor, so its gradient reaches the three Colwise projections'
    inputs as three Partial gradients, each all-reduced to the Replicate input it was
    taken as, and the gather's adjoint becomes a local slice instead of a reduce-scatter.
    ``parallel_loss``: the forward ends in cross_entropy under loss_parallel(), whose
    distributed log-softmax all-reduces 3 times (the max, the sum of exponentials, the
    target's logit) and whose backward needs none (tp.loss_parallel.class_dim)."""
    require(tp >= 1, "tp", tp, ">= 1")
    require(n_layers >= 0, "n_layers", n_layers, ">= 0")
    loss = LOSS_PARALLEL_ALL_REDUCES * parallel_loss
    if tp == 1:
        # DTensor issues no collective over a one-rank mesh, but loss_parallel's log-softmax
        # all-reduces its three values whatever the group's size (measured, torch 2.13)
        return _nonzero({"all_reduce": loss}), {}, {}
    flags = _prefix_flags(n_layers, trainable)
    blocks, out_in = flags[:-1], flags[-1]["out_in"]
    if not sequence_parallel:
        forward = {"all_reduce": 2 + 2 * n_layers + loss, "all_gather": 1 - sharded_head}
        forward = _nonzero(forward)
        colwise_inputs = sum(3 * b["attn_in"] + b["w1_in"] for b in blocks) + out_in
        return forward, _nonzero({"all_reduce": colwise_inputs}), {}
    forward = {"reduce_scatter": 2 + 2 * n_layers, "all_gather": 2 + 2 * n_layers - sharded_head}
    forward = _nonzero({**forward, "all_reduce": loss})
    local = sum(b["attn_in"] for b in blocks) if local_attention_input else 0
    backward = Counter(
        all_reduce=3 * local,
        reduce_scatter=sum(b["attn_in"] + b["w1_in"] for b in blocks) + out_in - local,
        all_gather=trainable("tok_embeddings.weight")
        + trainable("pos_embeddings.weight")
        + sum(b["wo_out"] + b["w2_out"] for b in blocks),
    )
    norms = [f"layers.{i}.{n}" for i in range(n_layers) for n in ("attention_norm", "ffn_norm")]
    norm_params = [f"{n}.{p}" for n in [*norms, "norm"] for p in ("weight", "bias")]
    reads = ADAM_GRAD_READS * sum(trainable(n) for n in norm_params)
    return forward, _nonzero(dict(backward)), _nonzero({"all_reduce": reads})


def _nonzero(counts: Counts) -> Counts:
    return {op: n for op, n in counts.items() if n}
