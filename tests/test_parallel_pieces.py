"""The pieces behind the HSDP and tensor-parallel suites: their cases, strategies, models
and the torch-free models of loss_parallel's layouts and of the TP plan's collectives."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.cases.hsdp import GroupErrorCase
from harness.cases.tp import (
    LossCase,
    PrepareCase,
    TensorState,
    TransformerCase,
    transformer_param_names,
)
from harness.strategies.hsdp import hsdp_cases, hsdp_meshes, save_load_cases
from harness.strategies.tp import (
    class_counts,
    hidden_sizes,
    loss_cases,
    loss_error_cases,
    prepare_cases,
    tp_cases,
    transformer_cases,
)
from harness.torchkit.models import build_tied, build_transformer
from specs.chunking import shard_sizes
from specs.loss_parallel import Layouts, Rejected, layouts
from specs.placements import Partial, Replicate, Shard
from specs.tp_collectives import transformer_collectives


@pytest.mark.parametrize("world_size", [1, 2, 4, 6])
def test_hsdp_mesh_kinds_split_the_factorisations(world_size):
    every = hsdp_meshes(world_size)
    assert all(r * s == world_size for r, s in every)
    assert (1, world_size) in every and (world_size, 1) in every
    one_rank = [(world_size, 1)] if world_size > 1 else []
    assert sorted(hsdp_meshes(world_size, "replicated_shards") + tuple(one_rank)) == sorted(every)


def test_hsdp_meshes_reject_a_world_without_replicas():
    with pytest.raises(ValueError, match=r"world_size=1 must be >= 2 for a \(world, 1\) mesh"):
        hsdp_meshes(1, "one_rank_shards")
    with pytest.raises(ValueError, match="kind='rows'"):
        hsdp_meshes(2, "rows")


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.sampled_from(["fsdp1", "fully_shard"]), st.data())
def test_hsdp_cases_are_valid(world_size, api, data):
    case = data.draw(hsdp_cases(world_size, api=api))
    assert math.prod(case.mesh_shape) == world_size
    if not case.use_orig_params:
        assert case.api == "fsdp1" and case.training.optim.second_group is None
    if api == "fully_shard":
        assert case.groups == "device_mesh"
        assert (case.training.optim.name, case.training.optim.impl) != ("SGD", "fused")


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.data())
def test_fsdp1_save_load_cases_keep_the_mixed_mesh_apart(world_size, data):
    case, steps_after = data.draw(save_load_cases(world_size, api="fsdp1"))
    assert (case.wrapping, case.groups) != ("mixed", "device_mesh")
    assert case.training.optim.scheduler is None and 1 <= steps_after <= 3
    mixed, _ = data.draw(save_load_cases(world_size, api="fsdp1", mixed_mesh=True))
    assert (mixed.wrapping, mixed.groups) == ("mixed", "device_mesh")


def test_cases_reject_unknown_choices_by_name():
    with pytest.raises(ValueError, match="given='two groups'"):
        GroupErrorCase("HYBRID_SHARD", "two groups", (1, 2), (1, 1))
    with pytest.raises(ValueError, match="reduction='avg'"):
        LossCase((2,), (1,), (2, 2), False, "avg", False, "float64", 0)
    with pytest.raises(ValueError, match="n_heads=3 must be a multiple of tp=2"):
        _transformer(tp=2, n_heads=3, dim=6)
    with pytest.raises(ValueError, match=re.escape("trainable=('output.weight',)")):
        _transformer(weight_tying=True, trainable=("output.weight",))


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_hidden_sizes_and_class_counts_are_what_they_say(tp):
    assert all(h % tp == 0 and h > 1 for h in hidden_sizes(tp, "even"))
    assert all(h % tp for h in hidden_sizes(tp, "uneven")) if tp > 1 else True
    assert all(0 not in shard_sizes(c, tp) for c in class_counts(tp, "nonempty"))
    if tp > 2:
        assert all(0 in shard_sizes(c, tp) for c in class_counts(tp, "empty"))


def test_hidden_size_one_only_on_one_rank():
    assert hidden_sizes(1, "one") == (1,)
    with pytest.raises(ValueError, match="tp=2"):
        hidden_sizes(2, "one")
    with pytest.raises(ValueError, match="tp=1 must be >= 2 for an uneven hidden size"):
        hidden_sizes(1, "uneven")


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.data())
def test_tp_cases_split_rows_under_sequence_parallelism(world_size, data):
    case = data.draw(tp_cases(world_size))
    assert case.training.dims[1] % world_size == 0
    if case.sequence_parallel:
        assert case.training.batch_per_rank % world_size == 0


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.data())
def test_prepare_cases_declare_local_outputs_as_they_are(world_size, data):
    case = data.draw(prepare_cases(world_size))
    assert all(dim % world_size == 0 for dim in case.shape)
    assert len(case.results()) == len(case.fed()) == 1 + case.keyword
    if case.style in ("output", "input_output"):
        for layout, state in zip(case.output_layouts, case.module_outputs(), strict=True):
            assert layout in (None, state.placement)


def _prepare(**changes):
    base = dict(
        style="input_output", tp=2, shape=(2, 4), keyword=True, input_layout=Shard(0),
        desired_input_layout=Replicate(), kwarg_layouts=(Replicate(), Shard(-1)),
        use_local_input=True, output_layouts=(Replicate(), None),
        desired_output_layouts=(Shard(1), Shard(0)), use_local_output=False, bare=False,
        named_mesh=False, dtype="float64", seed=0,
    )  # fmt: skip
    return PrepareCase(**{**base, **changes})


def test_prepare_case_follows_each_tensor_through_the_style():
    case = _prepare()
    assert case.fed() == (Shard(0), Replicate())
    assert case.module_inputs() == (TensorState(Replicate(), False), TensorState(Shard(-1), False))
    # x's local output declared Replicate and redistributed; y's left as the module made it
    assert case.results() == (TensorState(Shard(1), True), TensorState(Shard(-1), False))
    assert _prepare(style="input", output_layouts=(), desired_output_layouts=()).results() == (
        case.module_outputs()
    )
    with pytest.raises(ValueError, match="the outputs' own layouts"):
        _prepare(output_layouts=(Shard(0), None))
    with pytest.raises(ValueError, match="tp=2"):
        _prepare(shape=(3, 4))
    assert "input_kwarg_layouts={'y': Replicate()}" in case.call()


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.sampled_from([1, 2]), st.data())
def test_loss_cases_are_accepted_and_error_cases_rejected(world_size, mesh_ndim, data):
    case = data.draw(loss_cases(world_size, mesh_ndim=mesh_ndim))
    assert isinstance(
        layouts(case.spec_placements(), case.reduction, target_is_dtensor=True), Layouts
    )
    rule, bad = data.draw(loss_error_cases(world_size))
    got = layouts(bad.spec_placements(), bad.reduction, target_is_dtensor=not bad.target_plain)
    assert isinstance(got, Rejected), rule


def test_loss_layouts_match_upstreams_examples():
    """test_loss_parallel_multi_dim_mesh, _tp_not_last_dim, _3d_input_non_batch_shard."""
    dp_tp = layouts((Shard(0), Shard(1)), "sum", target_is_dtensor=True)
    assert dp_tp == Layouts(
        (Shard(0), Replicate()), (Partial("sum"), Replicate()), (Shard(0), Shard(1))
    )
    tp_dp = layouts((Shard(1), Shard(0)), "sum", target_is_dtensor=True)
    assert isinstance(tp_dp, Layouts) and tp_dp.loss == (Replicate(), Partial("sum"))
    seq = layouts((Shard(2), Shard(1)), "none", target_is_dtensor=True)
    assert isinstance(seq, Layouts) and seq.target == seq.loss == (Shard(1), Replicate())
    mean = layouts((Shard(0), Shard(1)), "mean", target_is_dtensor=True)
    assert mean == Rejected("NotImplementedError", "only supported on one-dimensional DeviceMesh")
    with pytest.raises(ValueError, match="reduction='avg'"):
        layouts((Shard(1),), "avg", target_is_dtensor=True)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.booleans(), st.data())
def test_transformer_cases_split_evenly_and_train_a_subset(world_size, frozen, data):
    case = data.draw(transformer_cases(world_size, frozen=frozen))
    assert case.n_heads % world_size == 0 and case.vocab % world_size == 0
    assert case.max_seq_len % world_size == 0 and case.max_seq_len >= case.seq_len
    assert min(case.vocab, case.dim, case.max_seq_len) >= 2
    assert (case.trainable is None) != frozen
    assert case.dtype == "float64" or case.steps == 1


@pytest.mark.parametrize("tying", [False, True])
def test_transformer_param_names_are_the_models(tying):
    case = _transformer(n_layers=2, weight_tying=tying)
    model = build_transformer(case, torch.device("cpu"))
    assert tuple(n for n, _ in model.named_parameters()) == transformer_param_names(2, tying)
    assert (model.output.weight is model.tok_embeddings.weight) == tying
    again = build_transformer(case, torch.device("cpu"))
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )


def test_tied_model_starts_untied_with_different_weights():
    case = dataclasses.make_dataclass("T", ["vocab", "dim", "dtype", "seed"])(4, 4, "float64", 0)
    model = build_tied(case, torch.device("cpu"))
    assert model.fc.weight is not model.embedding.weight
    assert not torch.equal(model.fc.weight, model.embedding.weight)


# Upstream's ExpCommCounts (test_transformer_training, test_transformer_req_grad) for its
# two-layer model; EXP_BASE_CC's optimizer step is checked as empty.
_UPSTREAM = [
    (False, None, {"all_reduce": 6, "all_gather": 1}, {"all_reduce": 9}, {}),
    (
        True,
        None,
        {"reduce_scatter": 6, "all_gather": 6},
        {"reduce_scatter": 5, "all_gather": 6},
        {"all_reduce": 30},
    ),
    (
        True,
        ("output.weight", "norm.weight", "norm.bias"),
        None,
        {"reduce_scatter": 1},
        {"all_reduce": 6},
    ),
    (
        True,
        ("tok_embeddings.weight", "output.weight"),
        None,
        {"reduce_scatter": 5, "all_gather": 5},
        {},
    ),
    (
        True,
        ("tok_embeddings.weight", "output.weight", "norm.weight", "norm.bias"),
        None,
        {"reduce_scatter": 5, "all_gather": 5},
        {"all_reduce": 6},
    ),
    (
        True,
        (
            "tok_embeddings.weight",
            "output.weight",
            "norm.weight",
            "norm.bias",
            "layers.1.ffn_norm.weight",
            "layers.1.ffn_norm.bias",
        ),
        None,
        {"reduce_scatter": 5, "all_gather": 5},
        {"all_reduce": 12},
    ),
    (
        True,
        (
            "tok_embeddings.weight",
            "layers.0.attention.wv.weight",
            "layers.0.feed_forward.w1.bias",
            "layers.1.ffn_norm.bias",
            "layers.1.feed_forward.w2.weight",
            "output.weight",
        ),
        None,
        {"reduce_scatter": 5, "all_gather": 5},
        {"all_reduce": 3},
    ),
]


@pytest.mark.parametrize(("sp", "thawed", "forward", "backward", "step"), _UPSTREAM)
def test_tp_collectives_model_gives_upstreams_counts(sp, thawed, forward, backward, step):
    got = transformer_collectives(
        tp=4,
        sequence_parallel=sp,
        n_layers=2,
        trainable=lambda name: thawed is None or name in thawed,
    )
    assert got[1:] == (backward, step)
    if forward is not None:
        assert got[0] == forward


def test_tp_collectives_of_a_local_attention_input_all_reduce_each_projection_input():
    def counts(local):
        return transformer_collectives(
            tp=2, sequence_parallel=True, n_layers=2, trainable=lambda _: True,
            local_attention_input=local,
        )  # fmt: skip

    shared, local = counts(False), counts(True)
    assert (local[0], local[2]) == (shared[0], shared[2])
    assert local[1]["all_reduce"] == 3 * 2
    assert local[1]["reduce_scatter"] == shared[1]["reduce_scatter"] - 2


@pytest.mark.parametrize("sp", [False, True])
def test_tp_collectives_of_loss_parallel_are_three_forward_all_reduces(sp):
    def counts(loss):
        return transformer_collectives(
            tp=2, sequence_parallel=sp, n_layers=1, trainable=lambda _: True,
            sharded_head=True, parallel_loss=loss,
        )  # fmt: skip

    summed, parallel = counts(False), counts(True)
    assert parallel[0] == {**summed[0], "all_reduce": summed[0].get("all_reduce", 0) + 3}
    assert parallel[1:] == summed[1:]


def test_tp_collectives_on_one_rank_are_none():
    assert transformer_collectives(
        tp=1, sequence_parallel=True, n_layers=2, trainable=lambda _: True
    ) == ({}, {}, {})


def _transformer(**changes):
    base = TransformerCase(
        sequence_parallel=False,
        tp=1,
        vocab=4,
        dim=4,
        n_heads=2,
        n_layers=1,
        seq_len=2,
        batch=1,
        weight_tying=False,
        trainable=None,
        lr=0.01,
        foreach=False,
        steps=1,
        dtype="float64",
        seed=0,
    )
    return dataclasses.replace(base, **changes)
