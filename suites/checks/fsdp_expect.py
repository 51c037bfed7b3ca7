"""Driver-side comparisons of the FSDP init suite: what each rank reported against the
reference model (``specs.modules``) or the one-device reference, "got X, should be Y"."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from harness.parity import assert_array_equal, assert_close, assert_equal_values
from harness.torchkit.dtensor import DTensorView
from specs.chunking import shard_range
from specs.modules import Group, Loc, ModuleGraph
from specs.placements import Shard
from suites.checks.fsdp_graphs import GroupView, TrainView

# Sharded training averages per-rank mean losses where the reference takes one mean over the
# global batch: the same terms summed in another order, compounded over up to three SGD steps
# (momentum included). A few ulps of float64; a wrong scale or a lost shard moves whole
# percent.
RTOL, ATOL = 1e-9, 1e-11
WHY = "per-rank mean losses are averaged in another order than the global mean"


def piece(full: np.ndarray, parts: int, dim: int, index: int) -> np.ndarray:
    """``torch.chunk(full, parts, dim)[index]``, empty past the last chunk."""
    offset, size = shard_range(full.shape[dim], parts, index)
    return full.take(range(offset, offset + size), axis=dim)


def assert_close_to_one_device(
    actual: np.ndarray, expected: np.ndarray, *, what: str, record_as: str | None = None
) -> None:
    """Within the float64 tolerance of the one-device reference (``RTOL``, ``ATOL``: ``WHY``)."""
    __tracebackhide__ = True
    assert_close(
        actual,
        expected,
        rtol=RTOL,
        atol=ATOL,
        dtype="float64",
        what=what,
        why=WHY,
        record_as=record_as,
    )


def matching_groups(
    views: Sequence[GroupView], groups: Sequence[Group], rank: int
) -> list[tuple[GroupView, Group, str]]:
    """Pair each ``fully_shard`` call's view with the model's group, with a label."""
    assert_equal_values(
        [v.wrap for v in views],
        [g.wrap for g in groups],
        what=f"fully_shard calls reported by rank {rank}",
    )
    return [
        (v, g, f"fully_shard{g.roots} (wraps[{g.wrap}]) on rank {rank}")
        for v, g in zip(views, groups, strict=True)
    ]


def assert_infos(view: GroupView, group: Group, who: str) -> None:
    __tracebackhide__ = True
    got = dict(zip(view.params, view.infos, strict=True))
    expected = dict(zip(group.params, group.infos, strict=True))
    assert_equal_values(sorted(got), sorted(expected), what=f"parameters of {who}")
    for loc, info in expected.items():
        assert_equal_values(got[loc], info, what=f"ParamModuleInfo of {loc} in {who}")


def assert_sharded_values(
    views: dict[str, DTensorView],
    expected: dict[str, np.ndarray],
    rank: int,
    world_size: int,
) -> None:
    """Each parameter is a DTensor ``(Shard(0),)`` with the global shape and stride, its
    local data is the rank's ``torch.chunk`` piece and its full value is the original."""
    __tracebackhide__ = True
    assert_equal_values(list(views), list(expected), what=f"parameters on rank {rank}")
    for name, view in views.items():
        full, who = expected[name], f"{name} on rank {rank}"
        assert_equal_values(view.placements, (Shard(0),), what=f"placements of {who}")
        assert_equal_values(view.shape, full.shape, what=f"global shape of {who}")
        stride = tuple(int(np.prod(full.shape[i + 1 :])) for i in range(full.ndim))
        assert_equal_values(view.stride, stride, what=f"global stride of {who}")
        local = piece(full, world_size, 0, rank)
        assert_array_equal(view.local, local, what=f"local shard of {who}")
        assert view.full is not None, "views are taken with full_tensor()"
        assert_array_equal(view.full, full, what=f"full_tensor() of {who}")


def assert_ties_held(graph: ModuleGraph, view: TrainView, rank: int) -> None:
    """Every canonical place is one object at all its places, with one value."""
    __tracebackhide__ = True
    for loc, count in sorted(view.objects.items()):
        assert_equal_values(count, 1, what=f"objects at the places of {loc} on rank {rank}")
    for place, value in sorted(view.values.items()):
        source = graph.source(place)
        what = f"{place} (tied to {source}) on rank {rank}"
        assert_array_equal(value, view.values[source], what=what)


def assert_trained_like(
    view: TrainView, reference: TrainView, rank: int, *, losses: Sequence[float]
) -> None:
    """Final values at every place, and the mean over ranks of each step's loss, within the
    float64 tolerance of the one-device reference."""
    __tracebackhide__ = True
    for place, value in sorted(reference.values.items()):
        what = f"{place} after training, rank {rank}"
        assert_close_to_one_device(view.values[place], value, what=what, record_as="param/float64")
    assert_close_to_one_device(
        np.asarray(losses),
        np.asarray(reference.losses),
        what="mean over ranks of each step's loss",
        record_as="loss/float64",
    )


def assert_first_pieces(
    after: dict[Loc, np.ndarray], initial: dict[Loc, np.ndarray], rank: int, world_size: int
) -> None:
    """Every parameter's local shard is this rank's piece of its seeded value."""
    __tracebackhide__ = True
    for loc, local in sorted(after.items()):
        expected = piece(initial[loc], world_size, 0, rank)
        assert_array_equal(local, expected, what=f"local shard of {loc} on rank {rank}")


def assert_grads(grads: dict[str, np.ndarray], reference: dict[str, np.ndarray], rank: int) -> None:
    """Full gradients of one step equal the one-device ones (float64 tolerance)."""
    __tracebackhide__ = True
    assert_equal_values(sorted(grads), sorted(reference), what=f"gradients on rank {rank}")
    for name, grad in reference.items():
        what = f"grad of {name} on rank {rank}"
        assert_close_to_one_device(grads[name], grad, what=what, record_as="grad/float64")
