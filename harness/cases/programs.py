"""Cases of the DTensor program property: a straight-line program of steps over 1-3
DTensors that ends in a scalar loss and ``backward()``, run on DTensors and on one device.

A step names an op of ``OPS`` and the earlier values it reads (``args``: leaves first, then
each step's result in order). ``OPS`` says of each op what shape it gives, so a strategy can
draw programs one device accepts by construction; ``harness.torchkit.programs`` runs them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from harness.cases.meshes import MeshCase
from harness.cases.placements import integer_array, partial_sum_factor
from harness.errors import check_one_of, require
from specs.placements import Partial, Placement, Replicate

Shape = tuple[int, ...]
LEAF_KINDS = ("distribute", "from_local")
# Leaf values are integers over 64, exact in float64: products of a few stay far from
# overflow and every sum of them is exact up to the order of its terms.
LEAF_SCALE = 64.0


@dataclass(frozen=True)
class Step:
    """``op`` of the values at ``args``; the other fields are the op's own arguments."""

    op: str
    args: tuple[int, ...]
    dims: tuple[int, ...] = ()
    keepdim: bool = False
    scalar: float = 0.0
    target: tuple[Placement, ...] = ()
    """redistribute / relabel: the placements to move to first."""
    partial_axes: tuple[int, ...] = ()
    """relabel: the Replicate axes of ``target`` whose local copies ``from_local`` then
    takes as Partial('sum') contributions (the value is multiplied by their sizes)."""
    hint: bool = False
    """relabel: pass ``grad_placements`` to ``to_local`` even where it is the default."""
    explicit_shape: bool = True
    """relabel: pass ``shape`` and ``stride`` to ``from_local``."""

    def __post_init__(self) -> None:
        check_one_of("op", self.op, sorted(OPS))
        arity = OPS[self.op].arity
        require(len(self.args) == arity, "args", self.args, f"{arity} value indices")

    def call(self, names: list[str]) -> str:
        return OPS[self.op].spell(self, [names[i] for i in self.args])


@dataclass(frozen=True)
class Op:
    arity: int
    shape: Callable[[list[Shape], Step], Shape]
    spell: Callable[[Step, list[str]], str]
    dtensor_only: bool = False
    """Moves data between layouts (redistribute, from_local/to_local, full_tensor): the
    identity on one device, or a known multiple (relabel)."""
    pending: str = "keeps"
    """Whether the result may hold a pending reduction (Partial) where DTensor picks the
    placements: "keeps" (if an argument may), "makes" (a reduction or a product may
    leave one), "clears" (never: non-linear ops reduce first, redistribute targets hold
    none). A strategy draws in-place ops only on values that hold none."""
    collective: bool = False
    """A ``torch.distributed`` collective called on the value's local tensor and given back
    by ``from_local`` (the reduction of a Partial value done by hand, a gather of an even
    Shard(0)): its argument must hold the layout the call expects, which the compile suite's
    skeletons fix; ``program_cases`` never draws it. No gradient flows through it (the
    collective runs on a detached copy): one device detaches."""


def _same(shapes: list[Shape], step: Step) -> Shape:
    return max(shapes, key=len)


def _reduced(shapes: list[Shape], step: Step) -> Shape:
    (shape,) = shapes
    dim = step.dims[0] % len(shape)
    if step.keepdim:
        return (*shape[:dim], 1, *shape[dim + 1 :])
    return (*shape[:dim], *shape[dim + 1 :])


def _transposed(shapes: list[Shape], step: Step) -> Shape:
    swapped = list(shapes[0])
    a, b = step.dims
    swapped[a], swapped[b] = swapped[b], swapped[a]
    return tuple(swapped)


def _unsqueezed(shapes: list[Shape], step: Step) -> Shape:
    shape = shapes[0]
    dim = step.dims[0] % (len(shape) + 1)
    return (*shape[:dim], 1, *shape[dim:])


def _unary(template: str) -> Callable[[Step, list[str]], str]:
    return lambda step, names: template.format(*names, s=step)


OPS: dict[str, Op] = {
    "neg": Op(1, _same, _unary("-{0}")),
    "tanh": Op(1, _same, _unary("torch.tanh({0})"), pending="clears"),
    "relu": Op(1, _same, _unary("torch.relu({0})"), pending="clears"),
    "add_scalar": Op(1, _same, _unary("{0} + {s.scalar}"), pending="clears"),
    "rsub_scalar": Op(1, _same, _unary("{s.scalar} - {0}"), pending="clears"),
    "mul_scalar": Op(1, _same, _unary("{0} * {s.scalar}")),
    "div_scalar": Op(1, _same, _unary("{0} / {s.scalar}")),
    "add_scalar_": Op(1, _same, _unary("{0}.clone().add_({s.scalar})"), pending="clears"),
    "mul_scalar_": Op(1, _same, _unary("{0}.clone().mul_({s.scalar})")),
    "add": Op(2, _same, _unary("{0} + {1}")),
    "sub": Op(2, _same, _unary("{0} - {1}")),
    "mul": Op(2, _same, _unary("{0} * {1}")),
    "mul_": Op(2, _same, _unary("{0}.clone().mul_({1})")),
    "sum": Op(1, lambda shapes, step: (), _unary("{0}.sum()"), pending="makes"),
    "sum_dim": Op(
        1, _reduced, _unary("{0}.sum({s.dims[0]}, keepdim={s.keepdim})"), pending="makes"
    ),
    "mean_dim": Op(
        1, _reduced, _unary("{0}.mean({s.dims[0]}, keepdim={s.keepdim})"), pending="makes"
    ),
    "transpose": Op(1, _transposed, _unary("{0}.transpose({s.dims[0]}, {s.dims[1]})")),
    "unsqueeze": Op(1, _unsqueezed, _unary("{0}.unsqueeze({s.dims[0]})")),
    "matmul": Op(
        2, lambda shapes, step: (shapes[0][0],) * 2, _unary("{0} @ {1}.T"), pending="makes"
    ),
    "einsum": Op(
        2,
        lambda shapes, step: (shapes[0][0],) * 2,
        _unary("torch.einsum('ij,kj->ik', {0}, {1})"),
        pending="makes",
    ),
    "redistribute": Op(
        1, _same, _unary("{0}.redistribute(mesh, {s.target})"), True, pending="clears"
    ),
    "roundtrip": Op(
        1,
        _same,
        _unary("DTensor.from_local({0}.to_local(), mesh, {0}.placements, shape=, stride=)"),
        True,
    ),
    "relabel": Op(1, _same, lambda step, names: _spell_relabel(step, names[0]), True),
    "full_tensor": Op(
        1,
        _same,
        _unary("DTensor.from_local({0}.full_tensor(), mesh, [Replicate()] * n)"),
        True,
        pending="clears",
    ),
    "all_reduce": Op(
        1,
        _same,
        _unary(
            "DTensor.from_local(dist.all_reduce({0}.to_local(), op=<{0}'s Partial op>), mesh, "
            "[Replicate()])"
        ),
        True,
        pending="clears",
        collective=True,
    ),
    "reduce_scatter": Op(
        1,
        _same,
        _unary(
            "DTensor.from_local(dist.reduce_scatter_tensor(out, {0}.to_local(), "
            "op=<{0}'s Partial op>), mesh, [Shard(0)], shape=, stride=)"
        ),
        True,
        pending="clears",
        collective=True,
    ),
    "all_gather": Op(
        1,
        _same,
        _unary(
            "DTensor.from_local(torch.cat(dist.all_gather(pieces, {0}.to_local())), mesh, "
            "[Replicate()])"
        ),
        True,
        pending="clears",
        collective=True,
    ),
}


def relabelled(step: Step) -> tuple[Placement, ...]:
    """``step.target`` with its ``partial_axes`` taken as Partial('sum')."""
    return tuple(
        Partial("sum") if axis in step.partial_axes else p for axis, p in enumerate(step.target)
    )


def _spell_relabel(step: Step, name: str) -> str:
    hint = relabelled(step) if step.partial_axes or step.hint else None
    shape = ", shape=, stride=" if step.explicit_shape else ""
    local = f"{name}.redistribute(mesh, {step.target}).to_local(grad_placements={hint})"
    local += "" if step.explicit_shape else ".contiguous()"
    return f"DTensor.from_local({local}, mesh, {relabelled(step)}{shape})"


@dataclass(frozen=True)
class Leaf:
    """A DTensor the program differentiates: ``distribute_tensor`` of a tensor that
    requires grad, or ``from_local`` of this rank's piece (a plain tensor that requires
    grad; a Partial('sum') axis holds distinct contributions)."""

    placements: tuple[Placement, ...]
    how: str
    seed: int
    explicit_shape: bool = True
    """from_local: pass ``shape`` and ``stride`` (else torch infers them from an even split)."""
    transposed: bool = False
    """distribute: the tensor handed to ``distribute_tensor`` is a transposed view (its last
    two dims' strides swapped), so the DTensor is not contiguous."""

    def __post_init__(self) -> None:
        check_one_of("how", self.how, LEAF_KINDS)
        if self.transposed:
            check_one_of("how (of a transposed leaf)", self.how, ("distribute",))


@dataclass(frozen=True)
class ProgramCase:
    mesh: MeshCase
    shape: Shape
    """Every leaf's global shape."""
    leaves: tuple[Leaf, ...]
    steps: tuple[Step, ...]
    loss_of_all: bool = True
    """The loss adds every value's sum of squares; else the last value's only (gradients
    then reach the leaves through the chain alone, in the layouts its steps give them)."""

    def __post_init__(self) -> None:
        require(1 <= len(self.leaves) <= 3, "leaves", self.leaves, "1-3 leaves")
        for number, step in enumerate(self.steps):
            known = len(self.leaves) + number
            reads = all(0 <= arg < known for arg in step.args)
            require(reads, "steps", step, f"a step reading the {known} values before it")

    def leaf_array(self, index: int) -> np.ndarray:
        leaf = self.leaves[index]
        factor = partial_sum_factor(self.mesh.shape, leaf.placements)
        return integer_array(self.shape, leaf.seed, multiple_of=factor) / LEAF_SCALE

    def scale_of(self, step: Step) -> float:
        """What a relabel multiplies its value by: the sizes of its Partial axes."""
        return float(math.prod(self.mesh.shape[axis] for axis in step.partial_axes))

    def value_names(self) -> list[str]:
        return [f"x{i}" for i in range(len(self.leaves))] + [
            f"v{i}" for i in range(len(self.steps))
        ]

    def call(self) -> str:
        names = self.value_names()
        lines = [
            f"{names[i]} = {leaf.how}(shape={self.shape}, placements={leaf.placements}, "
            f"seed={leaf.seed}, requires_grad=True{', transposed' if leaf.transposed else ''}"
            f"{'' if leaf.explicit_shape or leaf.how != 'from_local' else ', no shape='})"
            for i, leaf in enumerate(self.leaves)
        ]
        offset = len(self.leaves)
        lines += [f"{names[offset + i]} = {s.call(names)}" for i, s in enumerate(self.steps)]
        summed = ", ".join(names) if self.loss_of_all else names[-1]
        lines.append(f"sum((v * v).sum() for v in ({summed},)).backward()")
        return f"on mesh {self.mesh.call()}: " + "; ".join(lines)


def no_partial(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """The layout of a gradient of a value with these placements: Partial -> Replicate."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def may_be_partial(step: Step, arguments: list[bool]) -> bool:
    """Whether ``step``'s result may hold Partial, given whether its arguments may."""
    if step.op == "relabel":
        return bool(step.partial_axes)
    pending = OPS[step.op].pending
    return pending == "makes" or (pending == "keeps" and any(arguments))
