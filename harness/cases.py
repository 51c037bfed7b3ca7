"""The concrete cases strategies draw and ranks receive: small, picklable, readable reprs.

A case holds only plain values (tuples, ints, strings and the torch-free placements of
``specs.placements``). Every rank derives its tensors from ``seed``, so every rank sees the
same global input without drawing anything itself.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from specs.placements import Partial, Placement

DTYPES = ("float32", "float64", "bfloat16", "int64")
# The largest magnitude a global value may have: every partial sum the placement properties
# form stays below 256, where bfloat16 still represents every integer exactly.
_MAX_MAGNITUDE = 64


def partial_sum_factor(mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]) -> int:
    """Product of the sizes of the mesh axes holding ``Partial('sum')``."""
    sizes = [m for m, p in zip(mesh_shape, placements, strict=True) if p == Partial("sum")]
    return math.prod(sizes)


@functools.lru_cache(maxsize=64)
def integer_array(shape: tuple[int, ...], seed: int, *, multiple_of: int = 1) -> np.ndarray:
    """Seeded integer-valued float64 array, every value a multiple of ``multiple_of``.

    Integer values keep sums, averages over the mesh and divisions by ``multiple_of`` exact
    in every dtype the cases use, so placement properties can compare exactly. The array is
    read-only and memoised: every rank thread and the driver ask for the same one.
    """
    if multiple_of < 1:
        raise ValueError(f"multiple_of={multiple_of!r} must be a positive int")
    bound = max(0, _MAX_MAGNITUDE // multiple_of)
    rng = np.random.default_rng(seed)
    values = rng.integers(-bound, bound + 1, size=shape) * multiple_of
    array = np.asarray(values, dtype=np.float64)  # a 0-d draw comes back as a numpy scalar
    array.flags.writeable = False
    return array


@dataclass(frozen=True)
class DistributeCase:
    """``distribute_tensor(global, mesh(mesh_shape), placements)``."""

    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: str
    seed: int

    def global_array(self) -> np.ndarray:
        # distribute_tensor divides a Partial('sum') value by the axis size: keep it exact.
        factor = partial_sum_factor(self.mesh_shape, self.placements)
        return integer_array(self.shape, self.seed, multiple_of=factor)

    def call(self) -> str:
        return (
            f"distribute_tensor(shape={self.shape}, dtype={self.dtype}, "
            f"mesh={self.mesh_shape}, placements={self.placements})"
        )


@dataclass(frozen=True)
class RedistributeCase:
    """``DTensor.from_local(model locals, mesh, src).redistribute(mesh, dst)``."""

    mesh_shape: tuple[int, ...]
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: str
    seed: int

    def global_array(self) -> np.ndarray:
        return integer_array(self.shape, self.seed)

    def call(self) -> str:
        return (
            f"redistribute(shape={self.shape}, dtype={self.dtype}, mesh={self.mesh_shape}, "
            f"{self.src} -> {self.dst})"
        )


@dataclass(frozen=True)
class MLPCase:
    """A Linear/ReLU stack trained for one optimizer step, sharded or on one device."""

    dims: tuple[int, ...]
    """Feature sizes, input first: ``(4, 3, 2)`` is Linear(4, 3), ReLU, Linear(3, 2)."""
    bias: bool
    shard_layers: bool
    """``fully_shard`` each Linear before the root (several groups) or only the root."""
    batch_per_rank: int
    lr: float
    momentum: float
    dtype: str
    seed: int

    def call(self) -> str:
        return (
            f"fully_shard(MLP{self.dims}, bias={self.bias}, shard_layers={self.shard_layers}) "
            f"+ SGD(lr={self.lr}, momentum={self.momentum}), batch {self.batch_per_rank}/rank, "
            f"{self.dtype}"
        )
