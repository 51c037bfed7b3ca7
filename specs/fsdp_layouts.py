"""Reference layouts of FSDP parameters beyond 1-D (no torch): FSDP over tensor
parallelism, DTensor's ``_StridedShard``, and ``shard_placement_fn`` outcomes."""

from __future__ import annotations

from typing import Any

import numpy as np

from specs.chunking import shard_range

# --- FSDP over tensor parallelism ------------------------------------------------


def chunk(array: Any, parts: int, dim: int, index: int) -> Any:
    """``torch.chunk(array, parts, dim)[index]``, empty past the last chunk."""
    offset, size = shard_range(array.shape[dim], parts, index)
    return array.take(range(offset, offset + size), axis=dim)


def fsdp_over_tp_local(
    full: Any,
    mesh_shape: tuple[int, int],
    coord: tuple[int, int],
    tp_dim: int | None,
    fsdp_dim: int,
) -> Any:
    """What rank ``(i, j)`` of a ``(dp, tp)`` mesh holds when TP shards ``tp_dim`` (None:
    replicates) and FSDP then shards each TP piece on ``fsdp_dim``: FSDP's piece ``i`` of
    TP's piece ``j``, whatever the placements are called."""
    (dp, tp), (i, j) = mesh_shape, coord
    tp_piece = full if tp_dim is None else chunk(full, tp, tp_dim, j)
    return chunk(tp_piece, dp, fsdp_dim, i)


def fsdp_over_tp_spellings(
    tp_dim: int | None, fsdp_dim: int, tp: int
) -> tuple[tuple[str, ...], ...]:
    """The placements (``(dp axis, tp axis)``, as reprs) that mean ``fsdp_over_tp_local``.

    TP's own dim sharded again by FSDP cannot be spelled with plain placements (``(Shard(0),
    Shard(0))`` means the dp piece split by tp); torch 2.13 spells it ``_StridedShard(dim,
    sf=tp)`` on the dp axis, which collapses to ``Shard(dim)`` when the tp axis has size 1.
    """
    tp_axis = "Replicate()" if tp_dim is None else f"Shard(dim={tp_dim})"
    if tp_dim != fsdp_dim or tp == 1:
        return ((f"Shard(dim={fsdp_dim})", tp_axis),)
    return ((f"_StridedShard(dim={fsdp_dim}, sf={tp})", tp_axis),)


# --- shard_placement_fn ----------------------------------------------------------------------


def shard_dim_outcome(
    shapes: tuple[tuple[int, ...], ...], dims: tuple[int, ...], world_size: int
) -> tuple[str, str] | tuple[int, ...]:
    """``fully_shard`` with ``Shard(dims[i])`` for the parameter of shape ``shapes[i]`` (in
    order): the exception type and message start of the first parameter torch refuses (a dim
    past the last; an uneven split of a dim other than 0), else every normalised dim."""
    normalised = []
    for shape, dim in zip(shapes, dims, strict=True):
        d = dim + len(shape) if dim < 0 else dim
        if d >= len(shape):
            return "AssertionError", f"Shard dim {d} is invalid for {len(shape)}D tensor"
        if d > 0 and shape[d] % world_size:
            return "NotImplementedError", f"FSDP does not support uneven sharding on dim {d}"
        normalised.append(d)
    return tuple(normalised)


def strided_shard_local(
    full: Any, mesh_shape: tuple[int, int], coord: tuple[int, int], dim: int
) -> Any:
    """DTensor's own meaning of ``(_StridedShard(dim, sf=tp), Shard(dim))`` on ``(dp, tp)``
    (``distribute_tensor``): dp index ``i`` joins piece ``i`` of each of the ``tp`` pieces,
    and tp index ``j`` takes ``torch.chunk`` piece ``j`` of that."""
    (dp, tp), (i, j) = mesh_shape, coord
    parts = [chunk(chunk(full, tp, dim, k), dp, dim, i) for k in range(tp)]
    return chunk(np.concatenate(parts, axis=dim), tp, dim, j)


def strided_shard_agrees(size: int, dp: int, tp: int) -> bool:
    """Whether ``strided_shard_local`` and ``fsdp_over_tp_local`` are one layout for a dim of
    ``size`` on a ``(dp, tp)`` mesh."""
    full = np.arange(size)
    return all(
        np.array_equal(
            strided_shard_local(full, (dp, tp), (i, j), 0),
            fsdp_over_tp_local(full, (dp, tp), (i, j), 0, 0),
        )
        for i in range(dp)
        for j in range(tp)
    )
