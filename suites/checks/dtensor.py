"""Rank functions and driver-side comparisons shared by the DTensor suites.

Rank functions (``*_on_rank``) take the rank context and a case and return plain views;
comparisons run in the driver against the numpy model, so a mismatch is reported once, with
the rank and mesh coordinate that differ.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import zeros as dtensor_zeros

from harness import RankContext
from harness.cases.meshes import MeshCase
from harness.cases.placements import (
    DistributeCase,
    FactoryCase,
    FlattenedCase,
    OpCase,
    RedistributeCase,
    ReshapeCase,
)
from harness.parity import assert_array_equal, assert_equal_values
from harness.torchkit import dtensor_ops, local
from harness.torchkit.dtensor import (
    DTensorView,
    distribute,
    tensor_from,
    to_numpy,
    to_torch_placements,
    torch_dtype,
    view_of,
)
from specs.placements import (
    Coord,
    Partial,
    assemble,
    contiguous_stride,
    local_arrays,
    normalize,
)


def distribute_on_rank(ctx: RankContext, case: DistributeCase) -> DTensorView:
    return view_of(distribute(ctx, case), ctx)


def op_on_rank(ctx: RankContext, case: OpCase) -> list[DTensorView]:
    """Each application of the op, in order, on one DTensor (a sharding decision cached
    for one dim must not serve another)."""
    source = distribute(ctx, case.source)
    return [
        view_of(dtensor_ops.apply(case.op, source, dim, keepdim), ctx)
        for dim, keepdim in case.applications
    ]


def ops_on_rank(ctx: RankContext, cases: Sequence[OpCase]) -> list[list[DTensorView]]:
    return [op_on_rank(ctx, case) for case in cases]


def op_on_one_device(case: OpCase, device: str) -> list[np.ndarray]:
    """The reference: the same ops on the global tensor, on one device."""
    tensor = tensor_from(case.source.global_array(), case.source.dtype, torch.device(device))
    return [
        to_numpy(dtensor_ops.apply(case.op, tensor, dim, keepdim))
        for dim, keepdim in case.applications
    ]


def reshape_on_rank(ctx: RankContext, case: ReshapeCase) -> DTensorView | str:
    """The view (or reshape) of the distributed tensor, or the RuntimeError it raised."""
    source = distribute(ctx, case.source)
    try:
        result = getattr(source, case.method)(case.target)
    except RuntimeError as exc:
        return str(exc)
    return view_of(result, ctx)


Box = tuple[tuple[int, ...], tuple[int, ...]]


def box_on_rank(ctx: RankContext, case: DistributeCase) -> tuple[Box, DTensorView]:
    """Where torch says this rank's shard sits in the global tensor, and the shard."""
    dtensor = distribute(ctx, case)
    box = local.shard_box(dtensor)
    return box, view_of(dtensor, ctx, with_full=False)


@functools.lru_cache(maxsize=4)
def _source_layout(case: RedistributeCase) -> dict[Coord, np.ndarray]:
    """The model's locals of the source, distinct Partial contributions (shared by ranks)."""
    return local_arrays(
        case.global_array(), case.mesh_shape, case.src, partial="distinct", seed=case.seed
    )


def _source(ctx: RankContext, case: RedistributeCase) -> DTensor:
    """This rank's part of the source: the model's local array, wrapped by ``from_local``."""
    layout = _source_layout(case)
    return DTensor.from_local(
        local.rank_tensor(
            ctx, lambda rank: tensor_from(layout[case.coord_of(rank)], case.dtype, ctx.device)
        ),
        ctx.mesh_of(case.mesh),
        to_torch_placements(case.src),
        shape=torch.Size(case.shape),
        stride=contiguous_stride(case.shape),
    )


def redistribute_on_rank(ctx: RankContext, case: RedistributeCase) -> DTensorView:
    source = _source(ctx, case)
    return view_of(source.redistribute(source.device_mesh, to_torch_placements(case.dst)), ctx)


def redistribute_or_refusal_on_rank(ctx: RankContext, case: RedistributeCase) -> DTensorView | str:
    """The redistributed DTensor, or the message of the RuntimeError that refused it."""
    source = _source(ctx, case)
    try:
        result = source.redistribute(source.device_mesh, to_torch_placements(case.dst))
    except RuntimeError as exc:
        return str(exc)
    return view_of(result, ctx)


def assert_layout(
    views: Sequence[DTensorView],
    case: DistributeCase | RedistributeCase,
    *,
    partial_values_known: bool,
) -> None:
    """Every rank holds what the model says the case's DTensor holds: laid out by its
    placements (a redistribution's target ones), with its global value and dtype.

    Local values are compared exactly unless a ``Partial`` axis holds contributions the
    model cannot predict (``partial_values_known=False``); then the contributions must still
    have the model's shapes and reduce to the global value.
    """
    __tracebackhide__ = True
    mesh_shape, global_array, dtype = case.mesh_shape, case.global_array(), case.dtype
    placements = case.dst if isinstance(case, RedistributeCase) else case.placements
    expected = local_arrays(global_array, mesh_shape, placements)
    has_partial = any(isinstance(p, Partial) for p in placements)
    for rank, view in enumerate(views):
        coord = case.coord_of(rank)
        who = f"rank {rank} (mesh coord {coord})"
        assert_equal_values(view.coord, coord, what=f"mesh coordinate of rank {rank}")
        ranks = tuple(case.mesh.ranks_of(rank))
        assert_equal_values(view.mesh_ranks, ranks, what=f"ranks of the mesh of {who}")
        assert_equal_values(view.shape, global_array.shape, what=f"global shape on {who}")
        stride = contiguous_stride(global_array.shape)
        assert_equal_values(view.stride, stride, what=f"global stride on {who}")
        normalized = normalize(placements, global_array.ndim)
        assert_equal_values(view.placements, normalized, what=f"placements on {who}")
        dtypes = (view.dtype, view.local_dtype)
        assert_equal_values(dtypes, (dtype, dtype), what=f"(dtype, local dtype) on {who}")
        if partial_values_known or not has_partial:
            assert_array_equal(view.local, expected[coord], what=f"to_local() on {who}")
        else:
            shape = expected[coord].shape
            assert_equal_values(view.local.shape, shape, what=f"to_local() shape on {who}")
        assert view.full is not None, "views are taken with full_tensor()"
        assert_array_equal(view.full, global_array, what=f"full_tensor() on {who}")
    if has_partial:
        for ranks, members in _by_mesh(views, case).items():
            reduced = assemble({v.coord: v.local for v in members}, mesh_shape, placements)
            what = f"global value the local arrays of the mesh of ranks {list(ranks)} reduce to"
            assert_array_equal(reduced, global_array, what=what)


def _by_mesh(
    views: Sequence[DTensorView], case: DistributeCase | RedistributeCase
) -> dict[tuple[int, ...], list[DTensorView]]:
    """The views of each mesh a slice of the world builds (one for a whole-world mesh)."""
    meshes: dict[tuple[int, ...], list[DTensorView]] = {}
    for rank, view in enumerate(views):
        meshes.setdefault(tuple(case.mesh.ranks_of(rank)), []).append(view)
    return meshes


@dataclass(frozen=True)
class MeshView:
    """What one rank sees of a mesh: its ranks, its coordinate, and per axis the ranks of
    the axis group and the sum of their ranks an all_reduce over that group gives."""

    ranks: list[int]
    coord: tuple[int, ...] | None
    group_ranks: list[list[int]]
    group_sums: list[int]


def mesh_on_rank(ctx: RankContext, case: MeshCase) -> MeshView:
    mesh = ctx.mesh_of(case)
    groups = [mesh.get_group(axis) for axis in range(mesh.ndim)]
    sums = []
    for group in groups:
        total = local.rank_tensor(ctx, lambda rank: torch.tensor([rank], device=ctx.device))
        dist.all_reduce(total, group=group)
        sums.append(local.per_shard(total, lambda t: int(t.item())))
    coord = mesh.get_coordinate()
    return MeshView(
        ranks=local.map_value(local.mesh_ranks(mesh), list),
        coord=None if coord is None else tuple(local.integer(c) for c in coord),
        group_ranks=[local.group_ranks(group) for group in groups],
        group_sums=sums,
    )


@dataclass(frozen=True)
class FactoryView:
    """A factory's DTensor on one rank, its autograd flags, and the gradient of the sum of
    its squares (None where it does not require grad)."""

    view: DTensorView
    requires_grad: bool
    is_leaf: bool
    grad: DTensorView | None


def factory_on_rank(ctx: RankContext, case: FactoryCase) -> FactoryView:
    import torch.distributed.tensor as dtensor_api

    mesh = ctx.mesh_of(case.mesh)
    placements = to_torch_placements(case.placements)
    try:
        made = getattr(dtensor_api, case.factory)(
            *_factory_sizes(case), **_factory_options(case), device_mesh=mesh, placements=placements
        )
    except AssertionError as exc:
        if str(exc):
            raise
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{frame.name} ({Path(frame.filename).name}:{frame.lineno})"
        raise AssertionError(f"torch raised an AssertionError with no message in {where}") from exc
    grad = None
    if made.requires_grad:
        (made * made).sum().backward()
        grad = view_of(made.grad, ctx) if made.grad is not None else None
    return FactoryView(view_of(made.detach(), ctx), made.requires_grad, made.is_leaf, grad)


def factory_on_one_device(case: FactoryCase, device: str) -> torch.Tensor:
    made = getattr(torch, case.factory)(
        *_factory_sizes(case), **_factory_options(case), device=device
    )
    assert isinstance(made, torch.Tensor)
    return made


def _factory_sizes(case: FactoryCase) -> tuple[object, ...]:
    size = torch.Size(case.shape)
    return (size,) if case.fill_value is None else (size, case.fill_value)


def _factory_options(case: FactoryCase) -> dict[str, object]:
    options: dict[str, object] = {"requires_grad": case.requires_grad}
    if case.dtype is not None:
        options["dtype"] = torch_dtype(case.dtype)
    return options


def from_the_back_on_rank(ctx: RankContext, case: DistributeCase) -> dict[str, DTensorView | str]:
    """Each placements-taking API given ``case.placements`` as spelled (a Shard dim counted
    from the back): its DTensor, or the ``Type: message`` of what it raised. ``zeros`` is
    the factory's zeros; ``to_local`` is the gradient of sum(y * y), y the from_local of a
    to_local whose ``grad_placements`` are the spelled ones."""
    mesh = ctx.mesh_of(case.mesh)
    spelled = to_torch_placements(case.placements)
    whole = tensor_from(case.global_array(), case.dtype, ctx.device)
    piece = local_arrays(case.global_array(), case.mesh_shape, case.placements)
    mine = local.rank_tensor(
        ctx, lambda rank: tensor_from(piece[case.coord_of(rank)], case.dtype, ctx.device)
    )
    size, replicated = torch.Size(case.shape), [TorchReplicate()] * mesh.ndim

    def hinted_gradient() -> torch.Tensor | None:
        leaf = distribute_tensor(whole.clone().requires_grad_(), mesh, spelled)
        hinted = leaf.to_local(grad_placements=spelled)
        again = DTensor.from_local(hinted, mesh, spelled, shape=size, stride=leaf.stride())
        (again * again).sum().backward()
        return leaf.grad

    calls: dict[str, Callable[[], torch.Tensor | None]] = {
        "distribute_tensor": lambda: distribute_tensor(whole, mesh, spelled),
        "from_local": lambda: DTensor.from_local(
            mine, mesh, spelled, shape=size, stride=contiguous_stride(case.shape)
        ),
        "redistribute": lambda: distribute_tensor(whole, mesh, replicated).redistribute(
            mesh, spelled
        ),
        "zeros": lambda: dtensor_zeros(
            size, dtype=whole.dtype, device_mesh=mesh, placements=spelled
        ),
        "to_local": hinted_gradient,
    }
    results: dict[str, DTensorView | str] = {}
    for api, call in calls.items():
        try:
            made = call()
        except (AssertionError, RuntimeError, ValueError) as exc:
            results[api] = f"{type(exc).__name__}: {exc}"
        else:
            results[api] = view_of(made, ctx)
    return results


def flattened_on_rank(ctx: RankContext, case: FlattenedCase) -> DTensorView:
    """The case's DTensor on its own named root mesh, once the axes are flattened."""
    source = case.source
    root = ctx.mesh(source.mesh_shape, tuple(f"p{axis}" for axis in range(len(source.mesh_shape))))
    names = tuple(f"p{axis}" for axis in case.flattened)
    root[names]._flatten("_".join(names))
    whole = tensor_from(source.global_array(), source.dtype, ctx.device)
    return view_of(distribute_tensor(whole, root, to_torch_placements(source.placements)), ctx)


def expected_piece(
    view: DTensorView, expected: np.ndarray, mesh_shape: tuple[int, ...]
) -> np.ndarray | None:
    """The piece of ``expected`` that ``view``'s placements give its rank on a mesh of
    ``mesh_shape``; None for contributions (Partial) or a placement the model does not know
    (``_StridedShard``)."""
    if any(isinstance(p, str | Partial) for p in view.placements):
        return None
    known = tuple(p for p in view.placements if not isinstance(p, str))
    return local_arrays(expected, mesh_shape, known)[view.coord]
