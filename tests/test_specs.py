"""The torch-free reference models against torch itself, over exhaustive small grids."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor import distribute_tensor

from harness import open_world
from harness.strategies import mesh_shapes, placements, shapes
from harness.torchkit.dtensor import to_torch_placements
from specs import chunking
from specs.placements import (
    REDUCE_OPS,
    Partial,
    Replicate,
    Shard,
    assemble,
    contiguous_stride,
    coord_of_rank,
    local_arrays,
    mesh_coords,
)

SPECS = Path(__file__).resolve().parent.parent / "specs"


@pytest.mark.parametrize("k", range(1, 10))
def test_shard_sizes_and_offsets_follow_torch_chunk(k):
    for n in range(0, 25):
        pieces = torch.chunk(torch.arange(n), k)
        sizes = [len(p) for p in pieces] + [0] * (k - len(pieces))
        assert chunking.shard_sizes(n, k) == tuple(sizes), (n, k)
        assert chunking.num_chunks(n, k) == (len(pieces) if n else 0), (n, k)
        for rank, (offset, size) in enumerate(
            zip(chunking.shard_offsets(n, k), sizes, strict=True)
        ):
            if size:
                assert pieces[rank][0].item() == offset, (n, k, rank)
            assert chunking.shard_range(n, k, rank) == (offset, size)


@pytest.mark.parametrize(
    ("n", "k", "message"), [(-1, 2, "n=-1"), (3, 0, "k=0"), (True, 2, "n=True")]
)
def test_chunking_rejects_bad_sizes(n, k, message):
    with pytest.raises(ValueError, match=message):
        chunking.shard_sizes(n, k)


def test_shard_range_rejects_a_rank_outside_the_axis():
    with pytest.raises(ValueError, match=r"rank=4 must be an int in \[0, 4\)"):
        chunking.shard_range(5, 4, 4)


def _local_shapes_and_values(ctx, shape, mesh_shape, placement_grid):
    mesh = ctx.mesh(mesh_shape)
    tensor = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape)
    out = []
    for chosen in placement_grid:
        local = distribute_tensor(tensor, mesh, to_torch_placements(chosen)).to_local()
        out.append(local.numpy().copy())
    return out


GRID_SHAPES = [(n,) for n in range(10)] + list(itertools.product((0, 1, 2, 3, 5), repeat=2))


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (1, 4), (3,), (2, 3)])
def test_placement_model_matches_distribute_tensor(mesh_shape):
    world_size = int(np.prod(mesh_shape))
    with open_world("threads", world_size=world_size) as world:
        for shape in GRID_SHAPES:
            axis_choices = [Replicate()] + [Shard(d) for d in range(-len(shape), len(shape))]
            grid = list(itertools.product(axis_choices, repeat=len(mesh_shape)))
            per_rank = world.run(_local_shapes_and_values, shape, mesh_shape, grid)
            global_array = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
            for chosen_index, chosen in enumerate(grid):
                expected = local_arrays(global_array, mesh_shape, chosen)
                for rank, locals_ in enumerate(per_rank):
                    coord = coord_of_rank(mesh_shape, rank)
                    np.testing.assert_array_equal(
                        locals_[chosen_index],
                        expected[coord],
                        err_msg=f"{shape} {mesh_shape} {chosen} rank {rank}",
                    )


@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 4), (1, 5, 2)])
def test_contiguous_stride_matches_torch(shape):
    assert contiguous_stride(shape) == tuple(torch.empty(shape).stride())


def test_mesh_coords_are_row_major():
    assert mesh_coords((2, 3)) == [coord_of_rank((2, 3), r) for r in range(6)]


@st.composite
def _layouts(draw):
    world_size = draw(st.integers(1, 8))
    mesh = draw(mesh_shapes(world_size))
    shape = draw(shapes())
    chosen = draw(placements(len(mesh), len(shape)))
    values = draw(st.integers(0, 2**32 - 1))
    return mesh, shape, chosen, values


@given(_layouts(), st.sampled_from(["divide", "distinct"]))
def test_assemble_inverts_local_arrays(layout, partial):
    mesh, shape, chosen, seed = layout
    rng = np.random.default_rng(seed)
    factor = int(
        np.prod([m for m, p in zip(mesh, chosen, strict=True) if isinstance(p, Partial)] or [1])
    )
    global_array = rng.integers(-50, 50, size=shape).astype(np.float64) * factor
    layout_ = local_arrays(global_array, mesh, chosen, partial=partial, seed=seed)
    assert set(layout_) == set(mesh_coords(mesh))
    np.testing.assert_array_equal(assemble(layout_, mesh, chosen), global_array)


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_distinct_contributions_differ_between_ranks(op):
    global_array = np.arange(-20, 20, dtype=np.float64).reshape(5, 8)
    layout = local_arrays(global_array, (4,), (Partial(op),), partial="distinct", seed=7)
    assert not all(np.array_equal(layout[(0,)], layout[(r,)]) for r in range(1, 4))


def test_assemble_rejects_replicas_that_differ():
    layout = {(0,): np.zeros(2), (1,): np.ones(2)}
    with pytest.raises(ValueError, match="replicas differ"):
        assemble(layout, (2,), (Replicate(),))


@pytest.mark.parametrize(
    ("mesh", "chosen", "ndim", "message"),
    [
        ((2,), (Shard(1),), 1, r"placement=Shard\(dim=1\) must be a Shard of a dim in \[-1, 1\)"),
        ((2, 2), (Replicate(),), 1, "one entry per mesh axis"),
        ((0,), (Replicate(),), 1, "mesh_shape=\\(0,\\)"),
    ],
)
def test_local_arrays_validates_its_input(mesh, chosen, ndim, message):
    with pytest.raises(ValueError, match=message):
        local_arrays(np.zeros((3,) * ndim), mesh, chosen)


def test_partial_rejects_unknown_reduce_op():
    with pytest.raises(ValueError, match="reduce_op='prod' must be one of"):
        Partial("prod")


def test_specs_never_import_torch():
    for path in SPECS.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n == "torch" or n.startswith("torch.") for n in names), (
                f"{path.name} imports torch"
            )
