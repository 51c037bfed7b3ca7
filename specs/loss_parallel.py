"""Reference model of ``loss_parallel()``'s layouts for ``cross_entropy`` (class dim 1).

The input is sharded on the class dim by exactly one mesh axis (the "TP" axis); every other
axis shards another input dim or replicates. The target is the input without its class dim,
laid out like the input on the other axes and replicated on the TP axis. The loss comes
back replicated on the TP axis; on another axis it is the target's layout for
``reduction='none'`` and, for a reduction, ``Partial('sum')`` where the batch was sharded
(each coordinate reduced its own rows) and replicated otherwise. ``reduction='mean'`` needs
a 1-D mesh (a per-rank mean does not sum to the global mean). The input gradient has the
input's layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from harness.errors import check_one_of
from specs.placements import Partial, Placement, Replicate, Shard

CLASS_DIM = 1


@dataclass(frozen=True)
class Rejected:
    """``loss_parallel`` refuses the layout: the exception and a fragment of its message."""

    error: str
    message: str


@dataclass(frozen=True)
class Layouts:
    target: tuple[Placement, ...]
    loss: tuple[Placement, ...]
    grad: tuple[Placement, ...]


def tp_axis(placements: Sequence[Placement]) -> int | None:
    """The one mesh axis sharding the class dim, or None when not exactly one does."""
    axes = [i for i, p in enumerate(placements) if p == Shard(CLASS_DIM)]
    return axes[0] if len(axes) == 1 else None


def target_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """The input's placements without the class dim (dims past it move down by one)."""
    out: list[Placement] = []
    for p in placements:
        if isinstance(p, Shard) and p.dim == CLASS_DIM:
            out.append(Replicate())
        elif isinstance(p, Shard) and p.dim > CLASS_DIM:
            out.append(Shard(p.dim - 1))
        else:
            out.append(p)
    return tuple(out)


def layouts(
    placements: Sequence[Placement], reduction: str, *, target_is_dtensor: bool
) -> Layouts | Rejected:
    """What ``cross_entropy(input, target, reduction=...)`` gives under ``loss_parallel``."""
    check_one_of("reduction", reduction, ("none", "mean", "sum"))
    axis = tp_axis(placements)
    if axis is None:
        return Rejected(
            "ValueError", f"requires exactly one mesh dim to shard tensor dimension {CLASS_DIM}"
        )
    if any(isinstance(p, Partial) for p in placements):
        return Rejected("ValueError", "expects non-TP mesh dims to be Shard or Replicate")
    target = target_placements(placements)
    if not target_is_dtensor and any(isinstance(p, Shard) for p in target):
        return Rejected("ValueError", "requires a DTensor (not a plain torch.Tensor)")
    if reduction == "mean" and len(placements) > 1:
        return Rejected("NotImplementedError", "only supported on one-dimensional DeviceMesh")
    if reduction == "none":
        loss = target
    else:
        loss = tuple(Partial("sum") if isinstance(p, Shard) else Replicate() for p in target)
    return Layouts(target=target, loss=loss, grad=tuple(placements))
