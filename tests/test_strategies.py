"""Strategies draw valid cases by construction and reject bad arguments by name."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import strategies as hs
from harness.cases.meshes import MeshCase
from harness.cases.placements import DTYPES, DistributeCase, partial_sum_factor
from harness.errors import InvalidArgument
from specs.placements import Partial, Replicate, Shard, validate


@pytest.mark.parametrize("world_size", [1, 2, 4, 6, 8, 12])
def test_factorisations_are_every_ordered_factorisation(world_size):
    shapes = hs.factorisations(world_size, 3)
    assert len(set(shapes)) == len(shapes)
    assert all(math.prod(s) == world_size and 1 <= len(s) <= 3 for s in shapes)
    assert shapes[0] == (world_size,)
    assert (1, 1, world_size) in shapes


@settings(max_examples=200)
@given(st.integers(1, 8), st.data())
def test_distribute_cases_are_valid(world_size, data):
    case = data.draw(hs.distribute_cases(world_size))
    assert math.prod(case.mesh.parent) == world_size
    assert case.mesh.shape == case.mesh_shape
    validate(case.mesh_shape, case.placements, len(case.shape))
    ops = {p.reduce_op for p in case.placements if isinstance(p, Partial)}
    assert len(ops) <= 1
    assert case.dtype in DTYPES
    assert not (case.dtype == "int64" and ops & {"avg", "sum"})
    array = case.global_array()
    assert array.shape == case.shape
    assert (array % partial_sum_factor(case.mesh_shape, case.placements) == 0).all()
    assert (abs(array) <= 64).all()


@settings(max_examples=200)
@given(st.integers(1, 8), st.data())
def test_distribute_sources_every_axis_has(world_size, data):
    case = data.draw(hs.distribute_cases(world_size, no_source=True))
    if case.src_data_rank is None:
        assert not any(isinstance(p, Partial) for p in case.placements)
        return
    assert 0 <= case.src_data_rank < min(case.mesh_shape)
    sources = [rank for rank in range(world_size) if case.is_source(rank)]
    meshes = {tuple(case.mesh.ranks_of(rank)) for rank in range(world_size)}
    assert len(sources) == len(meshes), "one source on each mesh the world holds"
    for source in sources:
        assert case.coord_of(source) == (case.src_data_rank,) * len(case.mesh_shape)
        assert (case.input_of(source) == case.global_array()).all()


def test_distribute_inputs_differ_off_the_source():
    case = DistributeCase((2, 3), (Replicate(), Replicate()), (4,), "float64", 5, 1)
    assert [r for r in range(6) if case.is_source(r)] == [4]
    assert (case.input_of(4) == case.global_array()).all()
    assert all((case.input_of(r) != case.global_array()).any() for r in range(6) if r != 4)


@settings(max_examples=200)
@given(st.integers(1, 8), st.data())
def test_redistribute_destinations_add_no_new_partial(world_size, data):
    case = data.draw(hs.redistribute_cases(world_size, shardable_ops=frozenset({"sum"})))
    validate(case.mesh_shape, case.dst, len(case.shape))
    for src, dst in zip(case.src, case.dst, strict=True):
        if isinstance(dst, Partial):
            assert dst == src
        if isinstance(src, Partial) and src.reduce_op != "sum":
            assert not isinstance(dst, Shard)


@settings(max_examples=100)
@given(st.integers(1, 8), st.data())
def test_partial_target_cases_add_exactly_one_new_partial(world_size, data):
    case = data.draw(hs.partial_target_cases(world_size))
    added = [i for i, (s, d) in enumerate(zip(case.src, case.dst, strict=True)) if s != d]
    assert len(added) == 1
    assert isinstance(case.dst[added[0]], Partial) and not isinstance(case.src[added[0]], Partial)


@settings(max_examples=100)
@given(st.integers(1, 8), st.data())
def test_uneven_and_mlp_cases_stay_near_the_world_size(world_size, data):
    shard = data.draw(hs.uneven_shard_cases(world_size))
    assert shard.mesh_shape == (world_size,)
    assert shard.shape[shard.placements[0].dim] <= 2 * world_size + 1
    mlp = data.draw(hs.mlp_cases(world_size))
    assert all(1 <= d <= 2 * world_size + 1 for d in mlp.dims)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: hs.mesh_shapes(0), "world_size=0 must be a positive int"),
        (lambda: hs.mesh_shapes(2, max_ndim=0), "max_ndim=0 must be a positive int"),
        (lambda: hs.shapes(min_ndim=2, max_ndim=1), "max_ndim=1 must be an int >= 2"),
        (lambda: hs.dtypes(["float16"]), "allowed=\\('float16',\\) must be a non-empty subset"),
        (lambda: hs.placements(0, 2), "mesh_ndim=0 must be a positive int"),
        (lambda: hs.placements(1, 2, reduce_ops=["prod"]), "reduce_ops=\\('prod',\\)"),
    ],
)
def test_bad_arguments_name_the_value(make, message):
    with pytest.raises(InvalidArgument, match=message):
        make()


@pytest.mark.parametrize(
    "strategy",
    [
        hs.distribute_cases,
        hs.redistribute_cases,
        hs.partial_target_cases,
        hs.extremum_to_shard_cases,
        hs.partial_sum_integer_cases,
        hs.uneven_redistribute_cases,
        hs.uneven_shard_cases,
        hs.mlp_cases,
    ],
)
def test_case_strategies_validate_world_size_when_built(strategy):
    with pytest.raises(InvalidArgument, match="world_size=-1 must be a positive int"):
        strategy(-1)


@given(data=st.data())
def test_sampled_keeps_bools_and_ints_apart(data):
    from harness.strategies._common import sampled

    flags, sizes = sampled((True,)), sampled((1,))
    assert type(data.draw(sizes)) is int and type(data.draw(flags)) is bool
    assert type(data.draw(sampled((0,)))) is int and type(data.draw(sampled((False,)))) is bool


def test_costly_properties_buy_a_share_of_the_profiles_examples():
    from hypothesis import settings

    from harness.profiles import WIDE_BUDGET, costly

    budget = settings.default.max_examples
    share = budget // 4 if budget >= WIDE_BUDGET else budget // 8
    assert costly(4).max_examples == max(2, share)
    assert costly(10**6).max_examples == 2
    assert costly(4).deadline is None
    with pytest.raises(ValueError, match=r"cost=0 must be a positive int"):
        costly(0)
    with pytest.raises(ValueError, match=r"needs=-1 must be an int >= 0"):
        costly(4, needs=-1)


def test_a_costly_property_buys_twice_the_examples_mutate_needed_within_the_budget():
    from hypothesis import settings

    from harness.profiles import costly

    budget = settings.default.max_examples
    assert costly(10**6, needs=1).max_examples == min(budget, 2)
    assert costly(10**6, needs=budget).max_examples == budget  # never above the budget
    assert costly(1, needs=0).max_examples == costly(1).max_examples


def test_a_costly_property_runs_its_budget_at_world_size_2_and_a_share_elsewhere():
    from harness.profiles import costly, examples_at, property_settings, whole_at

    assert [examples_at(size, 100) for size in (1, 2, 3, 4, 8, 64)] == [12, 100, 25, 33, 33, 33]
    assert [examples_at(size, 12) for size in (1, 2, 3, 4)] == [2, 12, 3, 4]
    assert [examples_at(size, 2) for size in (1, 2, 3, 4)] == [2, 2, 2, 2]
    assert [examples_at(size, 1) for size in (1, 2, 4)] == [1, 1, 1]  # never above the budget
    assert [examples_at(size, 8, whole_at=1) for size in (1, 2, 3)] == [8, 4, 2]
    # a run without world size 2 runs the whole budget at its smallest world size
    assert [examples_at(size, 12, run_sizes=(3, 4)) for size in (3, 4)] == [12, 4]
    assert examples_at(3, 12, run_sizes=(2, 3)) == 3
    assert whole_at(costly(3)) == 2 and whole_at(costly(3, whole_at=1)) == 1
    assert whole_at(property_settings()) == 2 and whole_at(property_settings(whole_at=1)) == 1
    assert whole_at(settings(max_examples=3)) is None
    with pytest.raises(ValueError, match=r"world_size=0 must be a positive int"):
        examples_at(0, 10)


@settings(max_examples=300)
@given(st.integers(1, 8), st.data())
def test_mesh_cases_build_meshes_of_their_shape_over_the_world(world_size, data):
    case = data.draw(hs.mesh_cases(world_size))
    meshes = {tuple(case.ranks_of(rank)) for rank in range(world_size)}
    assert sorted(r for ranks in meshes for r in ranks) == list(range(world_size))
    for rank in range(world_size):
        assert len(case.ranks_of(rank)) == math.prod(case.shape)
        grid = np.array(case.ranks_of(rank)).reshape(case.shape)
        assert grid[case.coord_of(rank)] == rank


LOCAL_LACKS = frozenset({"mesh.from_group", "scatter.group_src"})


@settings(max_examples=200)
@given(st.integers(1, 8), st.data())
def test_what_a_world_lacks_is_never_drawn(world_size, data):
    strategy = data.draw(
        st.sampled_from(
            [
                hs.distribute_cases(world_size, no_source=True, lacks=LOCAL_LACKS),
                hs.redistribute_cases(world_size, lacks=LOCAL_LACKS),
                hs.program_cases(world_size, lacks=LOCAL_LACKS),
                hs.factory_cases(world_size, lacks=LOCAL_LACKS),
                hs.reshape_cases(world_size, lacks=LOCAL_LACKS),
            ]
        )
    )
    case = data.draw(strategy)
    case = getattr(case, "source", case)  # a reshape of a distributed source
    assert case.mesh.how != "from_group"
    assert getattr(case, "src_data_rank", 0) in (0, None)


def test_meshes_from_an_axis_group_are_drawn_where_nothing_is_lacked():
    seen = set()

    @settings(max_examples=200, database=None)
    @given(hs.mesh_cases(4))
    def collect(case):
        seen.add(case.how)

    collect()
    assert "from_group" in seen


@pytest.mark.parametrize("lacks", [frozenset({1}), "mesh.from_group", None])
def test_lacks_is_refused_unless_it_names_what_is_lacked(lacks):
    with pytest.raises(InvalidArgument, match=re.escape(f"lacks={lacks!r}")):
        hs.distribute_cases(4, lacks=lacks)


def test_mesh_cases_spell_their_construction():
    sliced = MeshCase((2, 3), "sliced", (1,))
    assert sliced.shape == (3,)
    assert sliced.ranks_of(4) == [3, 4, 5] and sliced.coord_of(4) == (1,)
    flat = MeshCase((2, 1, 2), "flattened", (0, 2))
    assert flat.shape == (4,) and flat.ranks_of(3) == [0, 1, 2, 3]
    group = MeshCase((2, 2), "from_group", (0,))
    assert group.ranks_of(3) == [1, 3]
    assert "get_group('a0')" in group.call()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"how": "folded", "axes": (0,)}, "how='folded'"),
        ({"how": "sliced", "axes": (1, 0)}, "axes=(1, 0)"),
        ({"how": "flattened", "axes": (0,)}, "axes=(0,)"),
        ({"how": "from_group", "axes": (0, 1)}, "axes=(0, 1)"),
        ({"how": "shape", "axes": (0,)}, "axes=(0,)"),
    ],
)
def test_mesh_cases_refuse_constructions_that_do_not_exist(kwargs, message):
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        MeshCase((2, 2), **kwargs)
