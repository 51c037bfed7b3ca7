"""Small models the suites train, built identically on every rank from a seed."""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from harness.cases.training import MLPCase
from harness.torchkit.dtensor import torch_dtype


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


def build_keyed_mlp(
    case: MLPShape, device: torch.device, names: Sequence[str], buffer: str | None
) -> nn.Sequential:
    """``build_mlp``'s model (the same values) with its children named ``names`` and, where
    ``buffer`` names one, a persistent buffer of that name on its first Linear (one value
    per output feature, seeded after the parameters)."""
    mlp = build_mlp(case, device)
    model = nn.Sequential(OrderedDict(zip(names, mlp, strict=True)))
    if buffer is not None:
        first = model[0]
        first.register_buffer(buffer, torch.zeros_like(first.get_parameter("weight")[:, 0]))
        seeded_init_(model, case.seed)  # the parameters first, as build_mlp drew them
    return model


def build_dropout_mlp(case: MLPShape, device: torch.device, p: float) -> nn.Sequential:
    """``build_mlp``'s model with each Linear in a unit of its own followed by
    ``Dropout(p)``: (Linear, Dropout), ReLU, (Linear, Dropout), ..., seeded alike."""
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(itertools.pairwise(case.dims)):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Sequential(nn.Linear(d_in, d_out, bias=case.bias), nn.Dropout(p)))
    model = nn.Sequential(*layers)
    model.to(device=device, dtype=torch_dtype(case.dtype))
    seeded_init_(model, case.seed)
    return model


class Centering(nn.Module):
    """Subtracts a running mean of its inputs (a buffer updated by every training forward,
    as BatchNorm's running statistics are)."""

    center: torch.Tensor

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("center", torch.zeros(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x - self.center
        if self.training:
            with torch.no_grad():
                self.center.mul_(0.75).add_(x.mean(0), alpha=0.25)
        return out


def build_centered_mlp(case: MLPShape, device: torch.device) -> nn.Sequential:
    """``Centering`` before the layers of ``build_mlp``: an MLP with a running buffer."""
    mlp = build_mlp(case, device)
    centering = Centering(case.dims[0]).to(device=device, dtype=torch_dtype(case.dtype))
    seeded_init_(centering, case.seed + 1)
    return nn.Sequential(centering, *mlp)


def global_batch(case: MLPCase, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets of the whole batch; rank ``r`` trains on rows ``r*b:(r+1)*b``."""
    rng = np.random.default_rng(case.seed + 1)
    rows = world_size * case.batch_per_rank
    inputs = rng.uniform(-1.0, 1.0, size=(rows, case.dims[0]))
    targets = rng.uniform(-1.0, 1.0, size=(rows, case.dims[-1]))
    return inputs, targets


class TiedShape(Protocol):
    """What ``build_tied`` reads from a case."""

    @property
    def vocab(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def seed(self) -> int: ...


class EmbeddingHead(nn.Module):
    """``fc(embedding(tokens))``: an Embedding(vocab, dim) and a Linear(dim, vocab), whose
    weights have the same shape and can be tied."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(self.embedding(tokens))
        return out


def build_tied(case: TiedShape, device: torch.device) -> EmbeddingHead:
    """An ``EmbeddingHead`` with seeded, different embedding and fc weights (not yet tied)."""
    model = EmbeddingHead(case.vocab, case.dim)
    model.to(device=device, dtype=torch_dtype(case.dtype))
    seeded_init_(model, case.seed)
    return model


class TransformerShape(Protocol):
    """What ``build_transformer`` reads from a case."""

    @property
    def vocab(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def weight_tying(self) -> bool: ...
    @property
    def dtype(self) -> str: ...
    @property
    def seed(self) -> int: ...


class Attention(nn.Module):
    """Causal multi-head self-attention without biases. The head count comes from the
    projection's width (``view(..., -1, head_dim)``), so under tensor parallelism with local
    projection outputs each rank attends over its own heads."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.size()
        q, k, v = (
            w(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        result: torch.Tensor = self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))
        return result


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, 4 * dim)
        self.gelu = nn.GELU()
        self.w2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(self.gelu(self.w1(x)))
        return out


class Block(nn.Module):
    """Pre-norm residual block: ``h = x + attention(norm(x)); h + feed_forward(norm(h))``."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out


class Transformer(nn.Module):
    """A toy decoder of the shape upstream's tensor-parallel examples train: token and
    position embeddings, ``n_layers`` blocks, a final LayerNorm and an output projection
    (tied to the token embedding when ``weight_tying``). No dropout: one device and TP must
    compute the same function."""

    def __init__(self, case: TransformerShape) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(case.vocab, case.dim)
        self.pos_embeddings = nn.Embedding(case.max_seq_len, case.dim)
        self.layers = nn.ModuleList(Block(case.dim, case.n_heads) for _ in range(case.n_layers))
        self.norm = nn.LayerNorm(case.dim)
        self.output = nn.Linear(case.dim, case.vocab, bias=False)
        if case.weight_tying:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        h = h + self.pos_embeddings(torch.arange(tokens.size(1), device=tokens.device))
        for layer in self.layers:
            h = layer(h)
        out: torch.Tensor = self.output(self.norm(h))
        return out


def build_transformer(case: TransformerShape, device: torch.device) -> Transformer:
    """A ``Transformer`` with seeded values (a tied weight is drawn once), on ``device``."""
    model = Transformer(case)
    model.to(device=device, dtype=torch_dtype(case.dtype))
    seeded_init_(model, case.seed)
    return model


class SquareEach(nn.Module):
    """``x * x + x``, and ``y * y`` when the keyword tensor ``y`` is given: elementwise,
    exact in any floating dtype however a tensor is split (each element rounds alike), so
    every piece of the output is the piece of one device's output."""

    def forward(
        self, x: torch.Tensor, *, y: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        squared = x * x + x
        return squared if y is None else (squared, y * y)
