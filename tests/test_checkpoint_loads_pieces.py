"""The pieces behind the checkpoint-loads suite: its cases refuse bad values naming them,
its strategies draw valid cases, and the pure key helpers say what build_mlp's model has."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.loads import (
    FailedSaveCase,
    KeyOptionsCase,
    MismatchCase,
    PartialLoadCase,
    StrictSetCase,
    changed_dims,
    child_names,
    linear_keys,
)
from harness.errors import InvalidArgument
from harness.strategies.loads import (
    failed_save_cases,
    key_options_cases,
    mismatch_cases,
    partial_load_cases,
    single_process_cases,
    strict_set_cases,
)
from harness.strategies.state_dict import state_dict_cases

SIZES = st.integers(1, 4)
FAST = settings(max_examples=15, deadline=None)


def test_linear_keys_and_changed_dims():
    assert linear_keys((3, 4, 5), True) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    prefixing = linear_keys((3, 4, 5), False, "prefixing", buffer=True)
    assert prefixing == ["layer.weight", "layer.running_mean", "layer2.weight"]
    assert child_names((3, 4, 5, 6), "prefixing") == ("layer", "act1", "layer2", "act2", "layer3")
    assert linear_keys((3, 4), False) == ["0.weight"]
    assert changed_dims((3, 4), "grown") == (3, 4, 4)
    assert changed_dims((3, 4, 5), "shrunk") == (3, 4)
    with pytest.raises(InvalidArgument, match="dims="):
        changed_dims((3, 4), "shrunk")
    with pytest.raises(InvalidArgument, match="change="):
        changed_dims((3, 4), "doubled")


@FAST
@given(data=st.data(), size=SIZES)
def test_strategies_draw_valid_cases(data: st.DataObject, size: int) -> None:
    sizes = (1, 2, 3, 4)
    for change in ("grown", "shrunk"):
        partial = data.draw(partial_load_cases(size, sizes, change))
        assert len(partial.loading.train.dims) == len(partial.reshard.load.train.dims) + (
            1 if change == "grown" else -1
        )
        strict = data.draw(strict_set_cases(size, change, True))
        assert strict.loading.train.seed != strict.case.train.seed
        broadcast = data.draw(strict_set_cases(size, change, True, True))
        assert broadcast.broadcast and broadcast.full and not broadcast.joint
    for mismatch in ("shape", "dtype"):
        for via in ("dcp", "set_full", "set_sharded"):
            case = data.draw(mismatch_cases(size, sizes, mismatch, via))
            differs = (
                case.loading.train.dims != case.reshard.save.train.dims
                if mismatch == "shape"
                else case.loading.train.dtype != case.reshard.save.train.dtype
            )
            assert differs
            assert via == "dcp" or case.load_size == size
    options = data.draw(key_options_cases(size))
    assert set(options.expected_keys) <= set(options.keys)
    assert len(options.case.train.dims) >= 3 and options.buffer
    if options.submodule is not None:
        prefix = options.submodule_prefix
        assert all(
            f"{prefix}{k}" in options.keys or k in options.keys for k in options.submodule_keys
        )
        assert not (options.frozen and options.submodule_ignores_frozen)
    wrapped = data.draw(key_options_cases(size, wrapped_missing=True))
    assert wrapped.wrapper == "ddp" and wrapped.frozen and wrapped.ignore_frozen
    assert not wrapped.strict and not wrapped.full and wrapped.submodule is None
    reshard = data.draw(single_process_cases(size, sizes))
    assert reshard.save.train.steps == reshard.load.train.steps == 0
    for target in ("new", "same"):
        failed = data.draw(failed_save_cases(size, sizes, target))
        assert 0 <= failed.failing_rank < size
        if target == "same" and size > 1:
            assert failed.failing_rank > 0 and failed.case.train.layout == "fsdp"


@FAST
@given(data=st.data())
def test_cases_refuse_bad_values_naming_them(data: st.DataObject) -> None:
    base = data.draw(state_dict_cases(2, layouts=("fsdp",), steps=(0, 0)))
    three = replace(base, train=replace(base.train, dims=(2, 3, 4)))
    with pytest.raises(InvalidArgument, match="change="):
        StrictSetCase(three, "doubled", True, False, True)
    with pytest.raises(InvalidArgument, match="broadcast=True"):
        StrictSetCase(three, "grown", False, False, True, broadcast=True)
    with pytest.raises(InvalidArgument, match="frozen="):
        KeyOptionsCase(three, ("9.weight",), True, False, False, None, True, True)
    with pytest.raises(InvalidArgument, match="submodule="):
        KeyOptionsCase(three, (), True, False, False, 1, True, True)
    with pytest.raises(InvalidArgument, match="wrapper='fsdp1'"):
        KeyOptionsCase(three, (), True, False, False, None, True, True, wrapper="fsdp1")
    with pytest.raises(InvalidArgument, match="naming='dotted'"):
        KeyOptionsCase(three, (), True, False, False, None, True, True, naming="dotted")
    with pytest.raises(InvalidArgument, match="failing_rank="):
        FailedSaveCase(three, 2, "same", three)
    with pytest.raises(InvalidArgument, match="target="):
        FailedSaveCase(three, 0, "elsewhere", three)
    reshard = data.draw(single_process_cases(2, (1, 2)))
    with pytest.raises(InvalidArgument, match="via="):
        MismatchCase(reshard, "shape", "torch.load")
    with pytest.raises(InvalidArgument, match="mismatch="):
        MismatchCase(reshard, "stride", "dcp")
    tp = data.draw(state_dict_cases(2, layouts=("fsdp_tp",), steps=(0, 0)))
    from harness.cases.state_dict import ReshardCase

    with pytest.raises(InvalidArgument, match="layout="):
        PartialLoadCase(ReshardCase(tp, tp), "grown")
    assert math.prod(three.train.mesh_shape) == 2
