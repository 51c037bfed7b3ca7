"""Tensor parallelism: every check of upstream's test_tp_examples.py as properties (which
upstream test each covers: the specs' provenance), and test_tp_style.py's prepare styles with
drawn layouts (tp.prepare.layouts). FSDP+TP training is optim.fsdp_tp.parity.

``loss_parallel()`` (and torch's own ``CommDebugMode``) change process-global dispatch
state in torch 2.13 and fail when rank threads use them at once: the checks enter it
through ``harness.torchkit.shared_contexts``, once per process. Collectives are counted by
``harness.torchkit.collectives``, whose counters are per thread, so every count runs on both
runners.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness import World, parity
from harness.cases.tp import LossCase, TPCase, TransformerCase
from harness.parity import (
    Float32Multiple,
    assert_array_equal,
    assert_close,
    assert_equal_values,
)
from harness.profiles import HANG_DEADLINE, costly, hanging, property_settings
from harness.strategies import (
    loss_cases,
    loss_error_cases,
    prepare_cases,
    tied_cases,
    tp_cases,
    transformer_cases,
)
from harness.torchkit.collectives import CountKey
from specs.chunking import shard_sizes
from specs.loss_parallel import Layouts, Rejected, layouts
from specs.placements import normalize
from specs.tp_collectives import transformer_collectives
from suites.checks import tp, tp_prepare

PROPERTY = property_settings()
HANGS_ITS_PEERS = pytest.mark.runner(
    "processes",
    reason="a rank holding no class issues one all-reduce fewer and its peers wait forever "
    "(an expectation); a rank thread stuck there would keep the process-wide loss_parallel() "
    "entered for the rest of the session",
)

# Rowwise layers sum partial matmul products over the ranks (all-reduce or
# reduce-scatter) where one device sums the whole dot product at once: the same terms in
# another order, a few ulps, which k optimizer steps (Adam's normalisation) can grow
# (as optim.fsdp_tp.parity). A wrong shard, a missing reduction or a wrong scale is off
# by whole percent.
TOLERANCE = {"float64": (1e-10, 1e-12), "float32": (1e-4, 1e-6)}  # (rtol, atol)
WHY = "row-parallel matmuls sum partial products over ranks in another order"


def _assert_close(got: np.ndarray, want: np.ndarray, dtype: str, what: str) -> None:
    __tracebackhide__ = True
    rtol, atol = TOLERANCE[dtype]
    assert_close(
        got, want, rtol=rtol, atol=atol, dtype=dtype, what=what, why=WHY, record_as=f"tp/{dtype}"
    )


def _gathered(case: TPCase, per_rank: list[np.ndarray], rank: int) -> np.ndarray:
    """The whole output: every rank's rows under sequence parallelism, else its own."""
    return np.concatenate(per_rank) if case.sequence_parallel else per_rank[rank]


def _check_training(world: World, data: st.DataObject, hidden: str) -> None:
    """A drawn TP MLP with a hidden size of ``hidden`` kind trains like one device."""
    case = data.draw(tp_cases(world.world_size, hidden=hidden), label="case")
    parity.attach(case.call())
    reference = tp.tp_reference(case)
    traces = world.run(tp.tp_train_on_rank, case)
    dtype = case.training.dtype
    for rank, trace in enumerate(traces):
        for step, want in enumerate(reference.outputs):
            got = _gathered(case, [t.outputs[step] for t in traces], rank)
            _assert_close(got, want, dtype, f"output of step {step} on rank {rank}")
        for kind, got_map, want_map in (
            ("gradient after the first backward", trace.grads, reference.grads),
            (f"parameter after {case.training.steps} step(s)", trace.params, reference.params),
        ):
            assert_equal_values(sorted(got_map), sorted(want_map), what=f"{kind} names")
            for name, want in want_map.items():
                _assert_close(got_map[name], want, dtype, f"{name} {kind} on rank {rank}")


@pytest.mark.spec("tp.mlp.training")
@costly(6)  # 104 ms an example at world size 4
@given(data=st.data())
def test_tp_mlp_trains_like_one_device(world: World, data: st.DataObject) -> None:
    _check_training(world, data, "even")


@pytest.mark.spec("tp.mlp.uneven_hidden")
@pytest.mark.world_size(min=2)
@PROPERTY
@given(data=st.data())
def test_tp_mlp_with_uneven_hidden_trains_like_one_device(
    world: World, data: st.DataObject
) -> None:
    _check_training(world, data, "uneven")


@pytest.mark.spec("tp.mlp.hidden_one")
@pytest.mark.world_size(1)  # over more ranks a hidden size of 1 is tp.mlp.uneven_hidden
@PROPERTY
@given(data=st.data())
def test_tp_mlp_with_hidden_size_one_trains_like_one_device(
    world: World, data: st.DataObject
) -> None:
    _check_training(world, data, "one")


@pytest.mark.spec("tp.mlp.inference")
@costly(10)  # 166 ms an example at world size 4
@given(data=st.data())
def test_tp_mlp_inference_matches_one_device(world: World, data: st.DataObject) -> None:
    case = data.draw(tp_cases(world.world_size), label="case")
    parity.attach(case.call())
    want = tp.reference_output(case)
    outputs = world.run(tp.tp_inference_on_rank, case)
    for rank in range(world.world_size):
        got = _gathered(case, outputs, rank)
        _assert_close(got, want, case.training.dtype, f"output on rank {rank}")


def expected_mlp_collectives(case: TPCase) -> dict[CountKey, int]:
    """One forward and backward: the Rowwise output's all-reduce; under sequence
    parallelism the Colwise input's all-gather (forward), the Rowwise output's
    reduce-scatter (forward) and the all-gather of its gradient (backward). Nothing over
    a one-rank mesh."""
    ranks = tuple(range(case.tp))
    if case.tp == 1:
        return {}
    if case.sequence_parallel:
        return {("all_gather", ranks): 2, ("reduce_scatter", ranks): 1}
    return {("all_reduce", ranks): 1}


@pytest.mark.spec("tp.mlp.collectives")
@costly(4)  # 74 ms an example at world size 4
@given(data=st.data())
def test_tp_mlp_issues_the_expected_collectives(world: World, data: st.DataObject) -> None:
    case = data.draw(tp_cases(world.world_size), label="case")
    parity.attach(case.call())
    for rank, trace in enumerate(world.run(tp.tp_train_on_rank, case)):
        assert_equal_values(
            dict(sorted(trace.counts.items())),
            expected_mlp_collectives(case),
            what=f"collectives of the first forward and backward on rank {rank}",
        )


@pytest.mark.spec("tp.weight_tying")
@costly(2)  # 49 ms an example at world size 4
@given(data=st.data())
def test_tied_weights_stay_one_parameter_with_one_gradient(
    world: World, data: st.DataObject
) -> None:
    case = data.draw(tied_cases(world.world_size), label="case")
    parity.attach(case.call())
    output, grad = tp.tied_reference(case)
    for rank, result in enumerate(world.run(tp.tied_on_rank, case)):
        flags = (
            result.untied_weights_differ,
            result.untied_grads_differ,
            result.same_parameter,
            result.same_grad,
        )
        assert_equal_values(
            flags,
            (True, True, True, True),
            what=f"(untied local weights differ, untied local grads differ, fc.weight is "
            f"embedding.weight, one gradient object) on rank {rank}",
        )
        _assert_close(result.output, output, case.dtype, f"tied output on rank {rank}")
        _assert_close(result.grad, grad, case.dtype, f"tied weight's gradient on rank {rank}")


# float64: against one device in float64; measured within 3e-13 of gradients up to ~3
# (LayerNorm over a few features amplifies rounding). A wrong shard or a missed
# reduction is off by whole terms.
TRANSFORMER_TOLERANCE = (1e-10, 1e-12)  # (rtol, atol)
TRANSFORMER_WHY = "partial products and LayerNorm terms summed in another order"
# float32: that amplification leaves one device in float32 itself up to 1e-4 off the
# float64 answer (measured), spread unevenly over the network: a tensor one device got
# nearly exact can still take another order's rounding from upstream. TP in float32 is
# held to the float64 answer within a multiple of the largest error one device's float32
# run makes in any tensor of the same kind (outputs, gradients, parameters). Two orders'
# rounding errors are two samples, not one bound: over 220 drawn float32 cases at world
# sizes 2-4, TP's error was a median 1.0x one device's and reached 10.6x (a width-2
# LayerNorm, whose gradient is almost all cancellation), so the multiple is 32. A missed
# reduction or a wrong shard is off by whole terms, 1e-2 relative and more. Its one Adam
# step moves a parameter by lr * g / (|g| + eps), turning a gradient difference d into at
# most lr / eps * d: the gradients' allowance, amplified, is added.
FLOAT32_SLACK, FLOAT32_FLOOR = 32.0, 1e-6
FLOAT32_WHY = "float32 rounding: within 32x one device's largest float32 error, + 1e-6"


Float32Allowance = tuple[float, Float32Multiple]
"""An atol and the multiple of one device's float32 error it is built on."""


def _float32_atol(exact: Sequence[np.ndarray], own: Sequence[np.ndarray]) -> Float32Allowance:
    errors = [
        np.abs(o.astype(np.float64) - e).max(initial=0.0) for e, o in zip(exact, own, strict=True)
    ]
    basis = Float32Multiple(FLOAT32_SLACK, float(max(errors, default=0.0)))
    return basis.multiple * basis.error + FLOAT32_FLOOR, basis


def _assert_transformer_close(
    got: np.ndarray,
    exact: np.ndarray,
    case: TransformerCase,
    what: str,
    float32: Float32Allowance | None,
) -> None:
    """``got`` against the float64 reference; ``float32``: the float32 allowance (None for
    float64 cases)."""
    __tracebackhide__ = True
    rtol, atol = TRANSFORMER_TOLERANCE
    why, basis = TRANSFORMER_WHY, None
    if float32 is not None:
        (atol, basis), rtol, why = float32, 0.0, FLOAT32_WHY
    assert_close(
        got,
        exact,
        rtol=rtol,
        atol=atol,
        dtype=case.dtype,
        what=what,
        why=why,
        record_as=f"tp_transformer/{case.dtype}",
        atol_from=basis,
    )


def _float32_allowances(
    exact: tp.TransformerTrace, own: tp.TransformerTrace, case: TransformerCase
) -> tuple[Float32Allowance, Float32Allowance, Float32Allowance]:
    """(outputs, gradients, parameters) float32 allowances."""
    grads = _float32_atol(list(exact.grads.values()), [own.grads[n] for n in exact.grads])
    params, basis = _float32_atol(
        list(exact.params.values()), [own.params[n] for n in exact.params]
    )
    outputs = _float32_atol(exact.outputs, own.outputs)
    return outputs, grads, (params + case.lr / case.eps * grads[0], basis)


def _check_values(
    trace: tp.TransformerTrace,
    exact: tp.TransformerTrace,
    own: tp.TransformerTrace | None,
    case: TransformerCase,
    rank: int,
) -> None:
    allowances = (None, None, None) if own is None else _float32_allowances(exact, own, case)
    assert_equal_values(len(trace.outputs), len(exact.outputs), what="steps")
    for step, want in enumerate(exact.outputs):
        what = f"output of step {step} on rank {rank}"
        _assert_transformer_close(trace.outputs[step], want, case, what, allowances[0])
    for kind, got_map, want_map, float32 in (
        ("gradient after the first backward", trace.grads, exact.grads, allowances[1]),
        (f"parameter after {case.steps} step(s)", trace.params, exact.params, allowances[2]),
    ):
        assert_equal_values(sorted(got_map), sorted(want_map), what=f"{kind} names")
        for name, want in want_map.items():
            what = f"{name} {kind} on rank {rank}"
            _assert_transformer_close(got_map[name], want, case, what, float32)


def _check_transformer(world: World, case: TransformerCase) -> None:
    parity.attach(case.call())
    exact = tp.transformer_reference(dataclasses.replace(case, dtype="float64"))
    own = tp.transformer_reference(case) if case.dtype == "float32" else None
    expected = transformer_collectives(
        tp=case.tp,
        sequence_parallel=case.sequence_parallel,
        n_layers=case.n_layers,
        trainable=case.requires_grad,
        sharded_head=case.sharded_head,
        local_attention_input=case.local_attention_input,
        parallel_loss=case.parallel_loss,
    )
    group = tuple(range(case.tp))
    for rank, trace in enumerate(world.run(tp.transformer_on_rank, case)):
        _check_values(trace, exact, own, case, rank)
        for phase, got_counts, want_counts in zip(
            ("forward", "backward", "optimizer step"), trace.counts, expected, strict=True
        ):
            assert_equal_values(
                dict(sorted(got_counts.items())),
                {(op, group): n for op, n in sorted(want_counts.items())},
                what=f"collectives of the first {phase} on rank {rank}",
            )


@pytest.mark.spec("tp.transformer.training")
@costly(12)  # 601 ms an example at world size 4
@given(data=st.data())
def test_tp_transformer_trains_like_one_device(world: World, data: st.DataObject) -> None:
    _check_transformer(world, data.draw(transformer_cases(world.world_size), label="case"))


@pytest.mark.spec("tp.transformer.requires_grad")
@costly(12)  # 336 ms an example at world size 4
@given(data=st.data())
def test_tp_transformer_with_frozen_parameters(world: World, data: st.DataObject) -> None:
    case = data.draw(transformer_cases(world.world_size, frozen=True), label="case")
    _check_transformer(world, case)


# Distributed log-softmax all-reduces the max and the sum of exponentials over class
# shards, and a Partial('sum') loss is summed over batch shards: the same terms in another
# order, a few ulps (measured float64 within 2e-15). A wrong shard or a missed reduction
# is off by the size of a term.
LOSS_TOLERANCE = {"float64": (1e-12, 1e-14), "float32": (1e-5, 1e-6)}
LOSS_WHY = "the max and sum of exponentials are reduced over class shards in another order"


def _check_loss(world: World, case: LossCase, *, timeout: float | None = None) -> None:
    parity.attach(case.call())
    expected = layouts(case.spec_placements(), case.reduction, target_is_dtensor=True)
    assert isinstance(expected, Layouts), f"the strategy drew a rejected layout: {expected}"
    loss, grad = tp.loss_reference(case)
    rtol, atol = LOSS_TOLERANCE[case.dtype]
    tp_group = _tp_group(case)
    for rank, result in enumerate(world.run(tp.loss_on_rank, case, timeout=timeout)):
        assert_equal_values(result.error, None, what=f"exception on rank {rank}")
        assert_equal_values(
            (result.loss_placements, result.grad_placements),
            (expected.loss, expected.grad),
            what=f"(loss, input gradient) placements on rank {rank}",
        )
        assert result.loss is not None
        assert result.grad is not None
        for what, got, want in (("loss", result.loss, loss), ("input gradient", result.grad, grad)):
            assert_close(
                got,
                want,
                rtol=rtol,
                atol=atol,
                dtype=case.dtype,
                what=f"{what} on rank {rank}",
                why=LOSS_WHY,
                record_as=f"loss_parallel/{case.dtype}",
            )
        # The max of the log-softmax needs no all-reduce where this rank's input piece is
        # empty (a batch piece past the end: the whole TP group shares it, so all skip).
        reductions = 3 if _holds_input(case, rank) else 2
        assert_equal_values(
            (result.forward, result.backward),
            ({("all_reduce", tp_group[rank]): reductions}, {}),
            what=f"collectives of (forward, backward) on rank {rank}",
        )


def _coords(case: LossCase, rank: int) -> tuple[int, ...]:
    return tuple(int(c) for c in np.unravel_index(rank, case.mesh_shape))


def _tp_group(case: LossCase) -> list[tuple[int, ...]]:
    """Every rank's group along the mesh axis that shards the classes."""
    axis = case.placements.index(1)
    grid = np.arange(int(np.prod(case.mesh_shape))).reshape(case.mesh_shape)
    groups = []
    for rank in range(grid.size):
        index: list[int | slice] = list(_coords(case, rank))
        index[axis] = slice(None)
        groups.append(tuple(int(r) for r in grid[tuple(index)]))
    return groups


def _holds_input(case: LossCase, rank: int) -> bool:
    """Whether every dim of this rank's piece of the input is non-empty."""
    coords = _coords(case, rank)
    for axis, dim in enumerate(case.placements):
        if (
            isinstance(dim, int)
            and shard_sizes(case.shape[dim], case.mesh_shape[axis])[coords[axis]] == 0
        ):
            return False
    return True


@pytest.mark.spec("tp.loss_parallel.class_dim")
@costly(2)  # 29 ms an example at world size 4
@given(data=st.data())
def test_loss_parallel_matches_cross_entropy(world: World, data: st.DataObject) -> None:
    _check_loss(world, data.draw(loss_cases(world.world_size, mesh_ndim=1), label="case"))


@pytest.mark.spec("tp.loss_parallel.multi_dim")
@costly(2)  # 51 ms an example at world size 4
@given(data=st.data())
def test_loss_parallel_on_a_2d_mesh_matches_cross_entropy(
    world: World, data: st.DataObject
) -> None:
    _check_loss(world, data.draw(loss_cases(world.world_size, mesh_ndim=2), label="case"))


@pytest.mark.spec("tp.loss_parallel.rejected")
@costly(2)  # 40 ms an example at world size 4
@given(data=st.data())
def test_loss_parallel_rejects_other_layouts(world: World, data: st.DataObject) -> None:
    rule, case = data.draw(loss_error_cases(world.world_size), label="case")
    parity.attach(case.call())
    expected = layouts(
        case.spec_placements(), case.reduction, target_is_dtensor=not case.target_plain
    )
    assert isinstance(expected, Rejected), f"{rule}: the model accepts {case.call()}"
    # The whole message, placements as torch prints them: upstream matches "loss_parallel".
    want = (expected.error, tp.rejection_message(case, expected))
    for rank, result in enumerate(world.run(tp.loss_on_rank, case)):
        assert_equal_values(
            result.error or ("no exception", ""),
            want,
            what=f"exception on rank {rank} ({rule})",
        )


# Each failing example hangs the ranks that hold classes in a collective until the deadline.
HANGS = hanging()


@pytest.mark.spec("tp.loss_parallel.empty_class_shard")
@HANGS_ITS_PEERS
@pytest.mark.world_size(min=2)
@HANGS
@given(data=st.data())
def test_loss_parallel_with_an_empty_class_shard(world: World, data: st.DataObject) -> None:
    case = data.draw(loss_cases(world.world_size, mesh_ndim=1, classes="empty"), label="case")
    _check_loss(world, case, timeout=HANG_DEADLINE)


@pytest.mark.spec("tp.prepare.layouts")
@costly(2)  # 41 ms an example at world size 2
@given(data=st.data())
def test_prepare_styles_lay_out_like_they_say(world: World, data: st.DataObject) -> None:
    case = data.draw(prepare_cases(world.world_size), label="case")
    parity.attach(case.call())
    outputs, grads = tp_prepare.prepare_reference(case)
    states, fed = case.results(), case.fed()
    for rank, result in enumerate(world.run(tp_prepare.prepare_on_rank, case)):
        assert_equal_values(len(result.grads), len(fed), what=f"input gradients on rank {rank}")
        for i, (got, state, want) in enumerate(zip(result.outputs, states, outputs, strict=True)):
            what = f"output {i} on rank {rank}"
            placements = normalize((state.placement,), len(case.shape))
            wanted = placements if state.dtensor else None  # None: a local tensor
            assert_equal_values(got.placements, wanted, what=f"{what}: placements")
            # Exact: SquareEach is elementwise, each element rounded alike however split.
            if not state.dtensor:
                want = tp_prepare.piece(want, state.placement, case.tp, rank)
            assert_array_equal(got.value, want, what=what)
        for i, (got_grad, want) in enumerate(zip(result.grads, grads, strict=True)):
            want = tp_prepare.piece(want, fed[i], case.tp, rank)
            assert_array_equal(got_grad, want, what=f"gradient of input {i} on rank {rank}")
