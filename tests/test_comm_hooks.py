"""DDP communication hooks as cases draw them: a hook refuses what torch refuses, and
training draws only the one that must leave it unchanged."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.comm_hooks import CommHook
from harness.cases.training import OptimConfig, ParityCase
from harness.strategies import parity_cases


def test_a_hook_refuses_an_unknown_name():
    with pytest.raises(ValueError, match=r"name='noop' must be one of \('allreduce'"):
        CommHook(name="noop")


def test_a_hook_is_refused_off_ddp_layouts():
    hook = CommHook(name="allreduce")
    with pytest.raises(ValueError, match=r"comm_hook=CommHook.* must be None for layout='fsdp'"):
        ParityCase(
            "fsdp", (2,), (3, 2), True, 1, "float64", OptimConfig("SGD", "default", 0.1),
            1, None, 0, comm_hook=hook,
        )  # fmt: skip


def test_rounding_hooks_say_their_dtype():
    assert CommHook(name="fp16_wrapper").dtype == "float16"
    assert CommHook(name="bf16_compress").dtype == "bfloat16"
    assert CommHook(name="allreduce").dtype is None


@settings(max_examples=100, deadline=None)
@given(data=st.data(), layout=st.sampled_from(("ddp", "zero")))
def test_training_draws_only_the_lossless_hook_and_static_graph_where_it_syncs(data, layout):
    case = data.draw(parity_cases(2, layout=layout, variants=True))
    assert case.comm_hook is None or case.comm_hook.name == "allreduce"
    options = dict(case.wrapper_options)
    accumulates = case.micro_batches > 1 and not case.sync_each_micro_batch
    assert not (accumulates and options["static_graph"])  # optim.ddp.static_graph_no_sync
