"""DDP communication hooks as cases draw them: a hook refuses what torch refuses, and the
strategies keep PowerSGD off Worlds whose ranks share a generator and off cold starts over
several buckets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.comm_hooks import LOSSLESS, CommHook
from harness.cases.training import OptimConfig, ParityCase
from harness.strategies import parity_cases
from harness.strategies.comm_hooks import comm_hooks


def test_a_hook_refuses_an_unknown_name_and_an_early_power_sgd():
    with pytest.raises(ValueError, match=r"name='noop' must be one of \('allreduce'"):
        CommHook(name="noop")
    with pytest.raises(ValueError, match="start_iter=1 must be >= 2 with error feedback"):
        CommHook(name="powerSGD", start_iter=1)
    assert CommHook(name="powerSGD", start_iter=1, error_feedback=False, warm_start=False)


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
    assert CommHook(name="powerSGD").dtype is None


@settings(max_examples=60, deadline=None)
@given(hook=comm_hooks(LOSSLESS, several_buckets=True))
def test_power_sgd_over_several_buckets_always_starts_warm(hook):
    assert hook.warm_start


@settings(max_examples=100, deadline=None)
@given(data=st.data(), layout=st.sampled_from(("ddp", "zero")))
def test_ranks_sharing_a_generator_never_draw_power_sgd(data, layout):
    strategy = parity_cases(
        2, layout=layout, variants=True, lacks=frozenset({"generator.per_rank"})
    )
    case = data.draw(strategy)
    assert case.comm_hook is None or case.comm_hook.name == "allreduce"
    options = dict(case.wrapper_options)
    accumulates = case.micro_batches > 1 and not case.sync_each_micro_batch
    assert not (accumulates and options["static_graph"])  # optim.ddp.static_graph_no_sync
