"""The FSDP2 knob strategies: valid by construction for the layout they are drawn for, each
path the properties rely on (PreMulSum, a one-rank shard group) drawn only where asked."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.checkpointing import Checkpointing
from harness.cases.knobs import Knobs, Precision
from harness.cases.training import OptimConfig, ParityCase, shard_size
from harness.errors import InvalidArgument
from harness.strategies import FSDP_LAYOUTS, KNOB_FAMILIES, parity_cases
from harness.strategies.knobs import divides_twice, uses_premul_sum


def _reduce_dtype(case_dtype: str, mixed: bool) -> str:
    return "float32" if mixed else case_dtype


@settings(max_examples=150)
@given(world_size=st.integers(1, 6), data=st.data())
def test_knob_cases_are_valid_for_their_layout(world_size: int, data: st.DataObject) -> None:
    layout = data.draw(st.sampled_from(FSDP_LAYOUTS))
    focus = data.draw(st.sampled_from(KNOB_FAMILIES))
    case = data.draw(
        parity_cases(
            world_size, layout=layout, variants=True, knob_families=KNOB_FAMILIES, focus=focus
        )
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
        assert knobs.checkpoint is not None
    custom = knobs.custom_all_gather is not None or knobs.custom_reduce_scatter is not None
    assert not (custom and knobs.group_allocates is not None)
    assert knobs.group_allocates is not True  # only where the World's group allocates
    if focus == "comms":
        comms = (knobs.reduce_scatter_unused, knobs.separate_reduce_scatter, knobs.group_allocates)
        assert custom or any(control is not None for control in comms)


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
        parity_cases(2, layout="ddp", knob_families=("divide_factor",))
    with pytest.raises(InvalidArgument, match=r"knob_families=.*'nope'"):
        parity_cases(2, layout="fsdp", knob_families=("nope",))
    with pytest.raises(InvalidArgument, match=r"focus='checkpoint' must be one of"):
        parity_cases(2, layout="fsdp", knob_families=("divide_factor",), focus="checkpoint")


def _case(layout: str, mesh: tuple[int, ...], **changes: object) -> ParityCase:
    fields: dict[str, object] = {
        "layout": layout,
        "mesh_shape": mesh,
        "dims": (2, 3, 1),
        "bias": True,
        "batch_per_rank": 2,
        "dtype": "float32",
        "optim": OptimConfig("SGD", "default", 0.1),
        "steps": 1,
        "precision": None,
        "seed": 0,
    }
    return ParityCase(**{**fields, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("layout", "mesh", "changes", "message"),
    [
        (
            "ddp",
            (2,),
            {"knobs": Knobs(divide_factor=2.0)},
            r"knobs=.* must be Knobs\(\) for layout='ddp'",
        ),
        (
            "fsdp",
            (2,),
            {"knobs": Knobs(divide_factor=0.0)},
            r"divide_factor=0\.0 must be None or > 0",
        ),
        (
            "fsdp",
            (4,),
            {"knobs": Knobs(reshard_to=3)},
            r"reshard_to=3 must be None or a divisor of 4",
        ),
        (
            "fsdp",
            (2,),
            {"knobs": Knobs(hold_all_reduce=True)},
            r"hold_all_reduce=True must be False",
        ),
        ("hsdp", (2, 2), {"knobs": Knobs(flatten=(2, 2))}, r"flatten=\(2, 2\) must be None"),
        (
            "fsdp",
            (2,),
            {"precision": Precision(layer_dtypes=("bfloat16",))},
            r"precision=.* must be 2 layer_dtypes",
        ),
        ("zero", (2,), {"precision": Precision(layer_dtypes=("bfloat16",) * 2)}, r"must be None"),
    ],
)
def test_parity_cases_refuse_knobs_their_layout_cannot_take(
    layout: str, mesh: tuple[int, ...], changes: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        _case(layout, mesh, **changes)


def test_precision_names_the_field_it_refuses() -> None:
    with pytest.raises(InvalidArgument, match=r"layer_dtypes\[1\]='float16'"):
        Precision(layer_dtypes=("bfloat16", "float16"))
    with pytest.raises(InvalidArgument, match=r"output_dtype='int64'"):
        Precision(layer_dtypes=(), output_dtype="int64")


def test_paths_a_world_size_cannot_reach_are_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"premul_sum=True must be False for 'fsdp'"):
        parity_cases(1, layout="fsdp", premul_sum=True)
    with pytest.raises(InvalidArgument, match=r"one_rank_shard=True must be False for 'fsdp'"):
        parity_cases(2, layout="fsdp", one_rank_shard=True)
    with pytest.raises(InvalidArgument, match=r"one_rank_shard=True must be False with premul"):
        parity_cases(4, layout="hsdp", premul_sum=True, one_rank_shard=True)


def test_knobs_refuse_a_sharded_first_layer_that_checkpointing_recomputes():
    with pytest.raises(InvalidArgument, match="first_layer_stays_sharded=True must be False"):
        Knobs(first_layer_stays_sharded=True, checkpoint=Checkpointing(layers=(0, 1)))
    Knobs(first_layer_stays_sharded=True, checkpoint=Checkpointing(layers=(1,)))


def test_knobs_refuse_two_unshard_in_backward_calls_and_unknown_forward_methods() -> None:
    with pytest.raises(InvalidArgument, match="first_layer_unshards=True must be False"):
        Knobs(first_layer_stays_sharded=True, first_layer_unshards=True)
    with pytest.raises(InvalidArgument, match="forward_method='decode' must be one of"):
        Knobs(forward_method="decode")
    assert Knobs(force_sum_reduction=False).describe() == "force_sum_reduction=False"
    assert Knobs().describe() == ""


@settings(max_examples=40)
@given(data=st.data())
def test_process_group_buffers_are_drawn_where_the_group_allocates(data: st.DataObject) -> None:
    case = data.draw(
        parity_cases(
            2, layout="fsdp", knob_families=("comms",), focus="comms", group_allocation=True
        )
    )
    custom = case.knobs.custom_all_gather is not None or case.knobs.custom_reduce_scatter
    assert not (custom and case.knobs.group_allocates is not None)


def test_knobs_refuse_process_group_buffers_with_custom_collectives() -> None:
    with pytest.raises(InvalidArgument, match="group_allocates=False must be None"):
        Knobs(custom_all_gather=True, group_allocates=False)
