"""Cases of the op-conformance suite: one OpInfo sample, its tensors laid out as DTensors.

A ``Partial`` input holds its value split unevenly between the ranks of each Partial axis,
so that a rule which forgets a rank's contribution, or counts one twice, shows in the value:
``sum`` and ``avg`` split it in uneven dyadic shares (exact in floating point: the value is
first rounded to as many significant bits as the shares leave spare, so every order of
adding the pieces gives the value itself), ``max`` and ``min`` give each element to one
rank (a different one element by element) and something strictly smaller (larger) to the
others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from harness.cases.meshes import MeshCase
from harness.cases.placements import _OnAMesh
from harness.errors import require
from specs.placements import Partial, Placement

SIGNIFICAND_BITS = {"float32": 24, "float64": 53}


@dataclass(frozen=True)
class TensorArgument:
    """One tensor argument of an OpInfo sample, as the strategies see it."""

    shape: tuple[int, ...]
    kind: str
    """``float``, ``complex``, ``int`` or ``bool``."""
    finite: bool
    strided: bool
    """A plain dense tensor (not sparse, not quantized): only these can be a DTensor's."""

    @property
    def may_be_partial(self) -> bool:
        """A pending reduction of a value only makes sense of finite floating values."""
        return self.kind == "float" and self.finite and self.strided


@dataclass(frozen=True)
class OpInfoCase(_OnAMesh):
    """``op`` applied to sample ``sample`` of its OpInfo in ``dtype``, each tensor argument
    a DTensor of the placements at its position in ``placements`` (then, with ``backward``,
    the gradients of every floating output with respect to every input that needs one)."""

    op: str
    dtype: str
    sample: int
    mesh_shape: tuple[int, ...]
    placements: tuple[tuple[Placement, ...], ...]
    arguments: tuple[TensorArgument, ...]
    backward: bool
    construction: MeshCase | None = None

    def __post_init__(self) -> None:
        self._check_mesh()
        require(
            len(self.placements) == len(self.arguments),
            "placements",
            self.placements,
            f"one placement tuple per tensor argument ({len(self.arguments)})",
        )

    def significand_bits(self, index: int) -> int | None:
        """How many significant bits tensor ``index`` keeps so that its Partial pieces add up
        exactly; None: it is used as drawn (no sum or avg axis)."""
        spent = 0
        for placement, size in zip(self.placements[index], self.mesh_shape, strict=True):
            if isinstance(placement, Partial) and placement.reduce_op in ("sum", "avg"):
                spent += _share_bits(size)
                if placement.reduce_op == "avg":
                    spent += math.ceil(math.log2(size)) if size > 1 else 0
        return None if spent == 0 else SIGNIFICAND_BITS[self.dtype] - spent - 1

    def call(self) -> str:
        layout = ", ".join(
            f"{list(argument.shape)} as {list(placements)}"
            for argument, placements in zip(self.arguments, self.placements, strict=True)
        )
        then = ", then backward" if self.backward else ""
        return (
            f"{self.op}(sample {self.sample} in {self.dtype}: {layout}) on mesh "
            f"{self.mesh_shape}{self.mesh_call()}{then}"
        )


def _share_bits(size: int) -> int:
    return int(math.log2(share_denominator(size)))


def share_denominator(size: int) -> int:
    """The power of two the shares of an axis of ``size`` ranks are counted in."""
    return max(16, 1 << (2 * size - 1).bit_length())


def sum_shares(size: int) -> tuple[int, ...]:
    """Each coordinate's share (over ``share_denominator``) of a Partial sum's value: uneven
    on an axis of two ranks or more, every share at least 1."""
    whole = share_denominator(size)
    base, extra = divmod(whole, size)
    shares = [base + (1 if c < extra else 0) for c in range(size)]
    if size > 1:
        shares[0] += 1
        shares[-1] -= 1
    return tuple(shares)


def extremum_holder(element: Any, axis: int, size: int) -> Any:
    """The coordinate along ``axis`` whose piece holds element ``element`` (a flat index, or
    an array of them) of a Partial max or min value; the others hold a value it beats."""
    return (element * 7 + axis * 3 + 1) % size
