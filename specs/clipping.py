"""Gradient clipping as torch.nn.utils documents it, in float64.

``clip_grad_norm_`` (and ``get_total_norm`` then ``clip_grads_with_norm_``): the total norm
is the ``norm_type``-norm of all gradients' elements taken together (as if concatenated into
one vector; the largest magnitude for the inf-norm), and every gradient is multiplied by
``max_norm / (total_norm + 1e-6)`` clamped to at most 1. With ``error_if_nonfinite`` a total
norm that is nan or infinite raises instead. ``clip_grad_value_`` clamps every element to
``[-clip_value, clip_value]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from harness.errors import require

EPS = 1e-6
"""What the documented clip coefficient adds to the total norm."""


def total_norm(grads: Sequence[np.ndarray], norm_type: float) -> float:
    """The ``norm_type``-norm of every element of ``grads`` together (0 for no elements)."""
    require(norm_type > 0, "norm_type", norm_type, "> 0")
    flat = np.concatenate([np.ravel(g) for g in grads]) if grads else np.zeros(0)
    if flat.size == 0:
        return 0.0
    magnitudes = np.abs(flat.astype(np.float64))
    if math.isinf(norm_type):
        return float(magnitudes.max())
    return float(np.sum(magnitudes**norm_type) ** (1.0 / norm_type))


def clipped_by_norm(grads: Sequence[np.ndarray], max_norm: float, total: float) -> list[np.ndarray]:
    """``grads`` scaled by the clip coefficient ``max_norm / (total + EPS)``, at most 1."""
    coef = min(max_norm / (total + EPS), 1.0)
    return [np.asarray(g, dtype=np.float64) * coef for g in grads]


def clipped_by_value(grads: Sequence[np.ndarray], clip_value: float) -> list[np.ndarray]:
    """Every element clamped to ``[-clip_value, clip_value]`` (nan stays nan)."""
    return [np.clip(np.asarray(g, dtype=np.float64), -clip_value, clip_value) for g in grads]
