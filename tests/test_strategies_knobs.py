"""The FSDP2 knob strategies: valid by construction for the layout they are drawn for, each
path the properties rely on (PreMulSum, a one-rank shard group) drawn only where asked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.training import Knobs
from harness.errors import InvalidArgument
from harness.strategies import FSDP_LAYOUTS, KNOB_FAMILIES, parity_cases
from harness.strategies.knobs import divides_twice, shard_size, uses_premul_sum


def _reduce_dtype(case_dtype: str, mixed: bool) -> str:
    return "float32" if mixed else case_dtype


@settings(max_examples=150)
@given(world_size=st.integers(1, 6), data=st.data())
def test_knob_cases_are_valid_for_their_layout(world_size: int, data: st.DataObject) -> None:
    layout = data.draw(st.sampled_from(FSDP_LAYOUTS))
    focus = data.draw(st.sampled_from(KNOB_FAMILIES))
    case = data.draw(
        parity_cases(world_size, layout=layout, variants=True, knobs=KNOB_FAMILIES, focus=focus)
    )
    knobs, reduce_dtype = case.knobs, _reduce_dtype(case.dtype, case.precision is not None)
    assert not uses_premul_sum(knobs, layout, case.mesh_shape, reduce_dtype)
    assert not divides_twice(knobs, layout, case.mesh_shape, reduce_dtype)
    size = shard_size(layout, case.mesh_shape)
    if knobs.reshard_to is not None:
        assert 1 < knobs.reshard_to < size and size % knobs.reshard_to == 0
    if knobs.hold_all_reduce:
        assert layout in ("hsdp", "hsdp_tp")
    if knobs.flatten is not None:
        assert layout == "fsdp" and knobs.flatten[0] * knobs.flatten[1] == world_size
    if focus == "micro_batching":
        assert case.micro_batches in (2, 3) and case.batch_per_rank % case.micro_batches == 0
    if focus == "divide_factor" and knobs.divide_factor is None:
        # dropped only where every reduction of this mesh and dtype would divide twice
        assert size == 1 and reduce_dtype == "float64"
    if focus == "checkpoint":
        assert knobs.checkpoint


@settings(max_examples=60)
@given(world_size=st.integers(2, 6), data=st.data())
def test_premul_sum_cases_take_that_path(world_size: int, data: st.DataObject) -> None:
    layout = data.draw(st.sampled_from(("fsdp", "hsdp")))
    case = data.draw(parity_cases(world_size, layout=layout, premul_sum=True))
    assert case.dtype == "float32"
    assert uses_premul_sum(case.knobs, layout, case.mesh_shape, case.dtype)


@settings(max_examples=60)
@given(world_size=st.integers(1, 6), data=st.data())
def test_one_rank_shard_cases_take_that_path(world_size: int, data: st.DataObject) -> None:
    layouts = ("fsdp", "hsdp") if world_size == 1 else ("hsdp", "fsdp_tp", "hsdp_tp")
    layout = data.draw(st.sampled_from(layouts))
    case = data.draw(parity_cases(world_size, layout=layout, one_rank_shard=True))
    assert divides_twice(case.knobs, layout, case.mesh_shape, case.dtype)


def test_divides_twice_needs_a_factor_a_one_rank_group_and_a_summing_reduction() -> None:
    forced = Knobs(divide_factor=2.0, force_sum_reduction=True)
    assert divides_twice(forced, "fsdp", (1,), "float32")
    assert divides_twice(Knobs(divide_factor=2.0), "hsdp", (2, 1), "float64")
    assert not divides_twice(Knobs(divide_factor=2.0), "hsdp", (2, 1), "float32")
    assert not divides_twice(forced, "fsdp", (2,), "float32")
    assert not divides_twice(
        Knobs(divide_factor=1.0, force_sum_reduction=True), "fsdp", (1,), "float32"
    )


def test_knobs_are_refused_where_nothing_calls_fully_shard() -> None:
    with pytest.raises(InvalidArgument, match="layout='ddp' must be one of"):
        parity_cases(2, layout="ddp", knobs=("divide_factor",))
    with pytest.raises(InvalidArgument, match=r"knobs=.*'nope'"):
        parity_cases(2, layout="fsdp", knobs=("nope",))
    with pytest.raises(InvalidArgument, match=r"focus='checkpoint' must be one of"):
        parity_cases(2, layout="fsdp", knobs=("divide_factor",), focus="checkpoint")
