"""Tensor ops to run on a DTensor and on the same tensor on one device.

Each op takes ``(tensor, dim, keepdim)``; ``dim`` is a tensor dim the strategy drew for ops
that work along one. The table reaches the sharding rules DTensor dispatches to: pointwise
(unary, binary, with a scalar), reductions to Partial (sum, mean, amax, norm), ops that need
a dim whole (softmax, cumsum), views and copies (transpose, flatten, unsqueeze, cat) and
matmul of a tensor with itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from harness.errors import check_one_of


@dataclass(frozen=True)
class Op:
    apply: Callable[[torch.Tensor, int, bool], torch.Tensor]
    min_ndim: int = 0
    needs_dim: bool = False
    nonempty_dim: bool = False
    """The op raises on an empty ``dim`` on one device too (amax of nothing)."""
    nonempty: bool = False
    extremum: bool = False
    """A max/min reduction: a rank holding an empty shard has no identity element to offer
    (spec uneven.ops.extremum_empty_shard checks that case on its own)."""
    unsharded_only: bool = False
    """Drawn only on tensors no mesh axis shards: DTensor views never redistribute, and torch
    2.13 raises "Sharding propagation failed" for a flatten that merges a sharded dim other
    than the group's first (f64[1, 5, 2] Shard(1) on 3 ranks). Not yet specced on its own."""
    negative_dims: bool = True
    """``dim`` may be drawn counted from the back (``d - ndim``)."""
    batched: bool = False
    """Folds the batch dims of a tensor of 3 or more dims through a view (matmul): drawn only
    where no dim of size 0 is sharded, which torch 2.13's view rule refuses in any view (spec
    placements.ops.matmul_empty_batch checks that case on its own)."""


def _matmul(t: torch.Tensor, dim: int, keepdim: bool) -> torch.Tensor:
    return t @ t if t.ndim == 1 else t @ t.transpose(-1, -2)


OPS: dict[str, Op] = {
    "neg": Op(lambda t, d, k: -t),
    "add": Op(lambda t, d, k: t + t),
    "mul": Op(lambda t, d, k: t * t),
    "affine": Op(lambda t, d, k: t * 0.5 + 1.0),
    "relu": Op(lambda t, d, k: torch.relu(t)),
    "tanh": Op(lambda t, d, k: torch.tanh(t)),
    "where": Op(lambda t, d, k: torch.where(t > 0, t, -2.0 * t)),
    "sum": Op(lambda t, d, k: t.sum()),
    "sum_dim": Op(lambda t, d, k: t.sum(d, keepdim=k), min_ndim=1, needs_dim=True),
    "mean_dim": Op(
        lambda t, d, k: t.mean(d, keepdim=k), min_ndim=1, needs_dim=True, nonempty_dim=True
    ),
    "amax_dim": Op(
        lambda t, d, k: t.amax(d, keepdim=k),
        min_ndim=1,
        needs_dim=True,
        nonempty_dim=True,
        extremum=True,
    ),
    "amin": Op(lambda t, d, k: t.amin(), nonempty=True, extremum=True),
    "norm": Op(lambda t, d, k: torch.linalg.vector_norm(t)),
    "softmax": Op(lambda t, d, k: torch.softmax(t, d), min_ndim=1, needs_dim=True),
    "log_softmax": Op(lambda t, d, k: torch.log_softmax(t, d), min_ndim=1, needs_dim=True),
    # torch 2.13 takes a scan's dim as given where a shard names it from the front (spec
    # placements.ops.scan_negative_dim checks that on its own)
    "cumsum": Op(
        lambda t, d, k: torch.cumsum(t, d), min_ndim=1, needs_dim=True, negative_dims=False
    ),
    "transpose": Op(lambda t, d, k: t.transpose(d, -1), min_ndim=1, needs_dim=True),
    # torch 2.13 loops forever flattening a DTensor with no elements whose leading dim is 0
    # (spec placements.ops.flatten_empty checks that on its own)
    "flatten": Op(lambda t, d, k: t.flatten(), unsharded_only=True, nonempty=True),
    "unsqueeze": Op(lambda t, d, k: t.unsqueeze(d), min_ndim=1, needs_dim=True),
    "cat": Op(lambda t, d, k: torch.cat([t, t], d), min_ndim=1, needs_dim=True),
    "matmul": Op(_matmul, min_ndim=1, batched=True),
}


def apply(name: str, tensor: torch.Tensor, dim: int, keepdim: bool) -> torch.Tensor:
    check_one_of("op", name, sorted(OPS))
    return OPS[name].apply(tensor, dim, keepdim)
