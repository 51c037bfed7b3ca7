"""The DCP layout strategies draw valid cases by construction, reject bad arguments by name,
and the layout model (specs.strided) agrees with specs.placements and with torch."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from harness import strategies as hs
from harness.cases.dcp_layouts import (
    DCP_DTYPES,
    SENTINEL,
    DcpLayoutCase,
    Layout,
    SavedTensor,
    spell,
    viewed,
)
from harness.errors import InvalidArgument
from harness.strategies import MAX_SIDE
from harness.strategies.dcp_layouts import MAX_TENSORS, dcp_layouts
from specs.placements import Replicate, Shard, coord_of_rank, local_arrays, mesh_coords
from specs.strided import StridedShard, boxes_only, held_indices, is_box, local_array


def _strided_form(layout: Layout) -> None:
    """A StridedShard axis is followed by Shard axes of its dim, whose ranks it splits by."""
    for axis, p in enumerate(layout.placements):
        if not isinstance(p, StridedShard):
            continue
        later = [
            m
            for m, q in zip(
                layout.mesh_shape[axis + 1 :], layout.placements[axis + 1 :], strict=True
            )
            if q == Shard(p.dim)
        ]
        assert later, layout
        assert p.split_factor == math.prod(later), layout
        assert not any(isinstance(q, StridedShard) for q in layout.placements[axis + 1 :])


@settings(max_examples=300)
@given(st.integers(1, 8), st.lists(st.integers(1, 8), min_size=1, max_size=4), st.data())
def test_drawn_cases_are_valid(world_size: int, load_sizes: list[int], data: st.DataObject) -> None:
    case = data.draw(hs.dcp_layout_cases(world_size, load_sizes))
    assert case.save_size == world_size
    assert case.load_size in load_sizes
    assert 1 <= len(case.tensors) <= MAX_TENSORS
    assert len({t.name for t in case.tensors}) == len(case.tensors)
    for t in case.tensors:
        assert t.dtype in DCP_DTYPES
        assert len(t.shape) <= 3 and all(0 <= n <= MAX_SIDE for n in t.shape)
        assert (t.save.world_size, t.load.world_size) == (world_size, case.load_size)
        for layout in (t.save, t.load):
            assert 1 <= len(layout.mesh_shape) <= 3
            _strided_form(layout)
            assert all(not isinstance(p, Shard) or p.dim >= 0 for p in layout.placements)
        array = t.global_array()
        assert array.shape == t.shape and (np.abs(array) <= 64).all()
        assert SENTINEL not in array


def test_cases_shrink_to_one_tensor_and_reach_the_same_world_size() -> None:
    # derandomized: shrinking from a random first example can stop short of the simplest.
    # The load size is not pinned: the shortest choice sequence may load at another size
    # when its layouts take fewer choices there.
    once = settings(derandomize=True, database=None)
    case = find(hs.dcp_layout_cases(2, (1, 2, 3)), lambda c: True, settings=once)
    assert (case.save_size, len(case.tensors)) == (2, 1)
    same = find(hs.dcp_layout_cases(2, (1, 2, 3)), lambda c: c.load_size == 2, settings=once)
    assert same.load_size == 2


@pytest.mark.parametrize("world_size", [4, 8])
def test_layouts_reach_strided_and_nested_shards(world_size: int) -> None:
    def strided(layout: Layout) -> bool:
        return any(isinstance(p, StridedShard) and p.split_factor > 1 for p in layout.placements)

    def nested(layout: Layout) -> bool:
        dims = [p.dim for p in layout.placements if isinstance(p, Shard)]
        return len(dims) > len(set(dims))

    for wanted in (strided, nested):
        layout = find(
            dcp_layouts(world_size, 2),
            wanted,
            settings=settings(max_examples=2000, derandomize=True, database=None),
        )
        assert wanted(layout)


def test_cases_reach_empty_pieces_and_scalars() -> None:
    def empty_piece(case: DcpLayoutCase) -> bool:
        t = case.tensors[0]
        return 0 not in t.shape and any(
            0 in t.local_shape(t.load, r) for r in range(case.load_size)
        )

    find(
        hs.dcp_layout_cases(4, (4,)),
        empty_piece,
        settings=settings(max_examples=2000, derandomize=True, database=None),
    )
    find(
        hs.dcp_layout_cases(4, (4,)),
        lambda c: c.tensors[0].shape == (),
        settings=settings(max_examples=2000, derandomize=True, database=None),
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: hs.dcp_layout_cases(0, (1,)), "world_size=0 must be"),
        (lambda: hs.dcp_layout_cases(2, ()), "load_sizes=() must be a non-empty sequence"),
        (lambda: hs.dcp_layout_cases(2, (2, 0)), "load_sizes[...]=0 must be"),
        (lambda: hs.dcp_layout_cases(2, (2,), max_tensors=0), "max_tensors=0 must be"),
        (lambda: hs.dcp_layout_cases(2, (2,), allowed_dtypes=("bfloat16",)), "allowed_dtypes="),
        (lambda: hs.dcp_layout_cases(2, (2,), allowed_dtypes=()), "allowed_dtypes="),
        (lambda: dcp_layouts(0, 1), "world_size=0 must be"),
        (lambda: dcp_layouts(2, -1), "ndim=-1 must be"),
    ],
)
def test_arguments_are_checked_by_name(call: object, message: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        call()
    assert message in str(raised.value)


def _tensor(save: Layout, load: Layout, shape: tuple[int, ...] = (5,)) -> SavedTensor:
    return SavedTensor("w", shape, "float64", 0, save, load)


def test_cases_refuse_what_does_not_fit() -> None:
    one = Layout((2,), (Shard(0),))
    with pytest.raises(InvalidArgument, match="placement"):
        _tensor(Layout((2,), (Shard(1),)), one)
    with pytest.raises(InvalidArgument, match="one per mesh axis"):
        _tensor(Layout((2, 1), (Shard(0),)), one)
    with pytest.raises(InvalidArgument, match="dtype"):
        SavedTensor("w", (5,), "bfloat16", 0, one, one)
    with pytest.raises(InvalidArgument, match="distinct names"):
        DcpLayoutCase(2, 2, (_tensor(one, one), _tensor(one, one)))
    with pytest.raises(InvalidArgument, match="meshes of 2 and 3 ranks"):
        DcpLayoutCase(2, 3, (_tensor(one, one),))
    with pytest.raises(InvalidArgument, match="split_factor"):
        StridedShard(0, 0)


def test_call_spells_torch_placements() -> None:
    fsdp_tp = Layout((2, 2), (StridedShard(0, 2), Shard(0)))
    case = DcpLayoutCase(2, 4, (_tensor(Layout((2,), (Replicate(),)), fsdp_tp),))
    assert "mesh (2, 2), (_StridedShard(dim=0, sf=2), Shard(dim=0))" in case.call()
    assert "mesh (2,), (Replicate(),)" in case.call()
    assert spell(StridedShard(1, 3)) == repr(_StridedShard(1, split_factor=3))
    assert viewed(StridedShard(1, 3)) == repr(_StridedShard(1, split_factor=3))
    assert viewed(Shard(1)) == Shard(1)


def test_fsdp_over_tp_pieces() -> None:
    """torch's docstring example: (dp=2, tp=2), rows 0-7, [_StridedShard(0, sf=2), Shard(0)]:
    ranks hold row pairs 0, 2, 1, 3 (the TP pieces sharded again over dp)."""
    placements = (StridedShard(0, 2), Shard(0))
    pieces = [held_indices((8,), (2, 2), placements, c)[0].tolist() for c in mesh_coords((2, 2))]
    assert pieces == [[0, 1], [4, 5], [2, 3], [6, 7]]


def test_non_box_pieces_are_recognised() -> None:
    placements = (StridedShard(0, 2), Shard(0))
    assert held_indices((13,), (3, 2), placements, (2, 0))[0].tolist() == [6, 11]
    assert not boxes_only((13,), (3, 2), placements)
    assert boxes_only((12,), (3, 2), placements)
    assert is_box((np.array([3, 4, 5]), np.array([], dtype=int)))


@settings(max_examples=200)
@given(st.integers(1, 8), st.data())
def test_plain_layouts_agree_with_the_placement_model(world_size: int, data: st.DataObject) -> None:
    shape = data.draw(hs.shapes(near=world_size))
    layout = data.draw(dcp_layouts(world_size, len(shape)))
    if any(isinstance(p, StridedShard) for p in layout.placements):
        return
    array = np.arange(math.prod(shape), dtype=np.float64).reshape(shape)
    expected = local_arrays(array, layout.mesh_shape, layout.placements)
    for coord, piece in expected.items():
        got = local_array(array, layout.mesh_shape, layout.placements, coord)
        assert got.shape == piece.shape and (got == piece).all()


@settings(max_examples=300)
@given(st.integers(1, 8), st.data())
def test_layouts_agree_with_torch_local_shapes_and_offsets(
    world_size: int, data: st.DataObject
) -> None:
    shape = data.draw(hs.shapes(min_ndim=1, near=world_size))
    layout = data.draw(dcp_layouts(world_size, len(shape)))
    placements = [
        _StridedShard(p.dim, split_factor=p.split_factor)
        if isinstance(p, StridedShard)
        else TorchShard(p.dim)
        if isinstance(p, Shard)
        else TorchReplicate()
        for p in layout.placements
    ]
    for rank in range(world_size):
        coord = coord_of_rank(layout.mesh_shape, rank)
        held = held_indices(shape, layout.mesh_shape, layout.placements, coord)
        sizes, offsets = _compute_local_shape_and_global_offset(
            shape, layout.mesh_shape, list(coord), placements
        )
        assert sizes == tuple(len(ix) for ix in held)
        firsts = tuple(int(ix[0]) if len(ix) else n for ix, n in zip(held, shape, strict=True))
        # torch reports an empty piece's offset as the dim's size on a sharded dim only
        for dim, (got, first, ix) in enumerate(zip(offsets, firsts, held, strict=True)):
            if len(ix) or got != 0:
                assert got == first, (dim, layout, shape, coord)
