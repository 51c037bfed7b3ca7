"""The pieces of the checkpoint-loads coordination and API-options properties: cases refuse
what they do not stand for, naming it; strategies draw valid cases."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.load_options import ApiOptionsCase, CoordinationCase, RankLocalReshardCase
from harness.errors import InvalidArgument
from harness.strategies import api_options_cases, coordination_cases, rank_local_reshard_cases


@settings(max_examples=20, deadline=None)
@given(data=st.data(), world_size=st.integers(1, 4))
def test_strategies_draw_valid_cases(data: st.DataObject, world_size: int) -> None:
    coordination = data.draw(coordination_cases(world_size, (1, 2, 3, 4)))
    assert coordination.call()
    options = data.draw(api_options_cases(world_size))
    assert not (options.full and (options.cpu_offload or options.flatten_optimizer))
    if world_size >= 2:
        local = data.draw(rank_local_reshard_cases(world_size))
        assert local.load.train.mesh_shape == (world_size, 1)


@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_cases_refuse_bad_values_naming_them(data: st.DataObject) -> None:
    case = data.draw(coordination_cases(2, (2,)))
    with pytest.raises(InvalidArgument, match="save_how='sideways'"):
        replace(case, save_how="sideways")
    with pytest.raises(InvalidArgument, match="load_how='rank_local'"):
        replace(case, load_how="rank_local")
    options = data.draw(api_options_cases(2))
    with pytest.raises(InvalidArgument, match="modifiers='nope'"):
        replace(options, modifiers="nope")
    with pytest.raises(InvalidArgument, match="cpu_offload=True"):
        replace(options, full=True, cpu_offload=True)
    local = data.draw(rank_local_reshard_cases(2))
    one = replace(local.save, train=replace(local.save.train, mesh_shape=(1,)))
    with pytest.raises(InvalidArgument, match="world size=1"):
        RankLocalReshardCase(one)
    assert isinstance(options, ApiOptionsCase) and isinstance(case, CoordinationCase)
