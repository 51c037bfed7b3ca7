"""Ops: every OpInfo of torch's op database on DTensors of drawn meshes and placements,
against the op on one device (outputs, their pieces, gradients)."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from harness import RankFailure, World, parity
from harness.cases.ops import OpInfoCase
from harness.parity import assert_array_equal, assert_close, assert_equal_values, failure
from harness.profiles import costly, goes_wide
from harness.strategies import opinfo_cases, usable_samples
from harness.torchkit import op_db
from harness.torchkit.dtensor import DTensorView
from specs.placements import Shard
from suites.checks.dtensor import expected_piece
from suites.checks.ops import (
    Leaf,
    OpRefused,
    OpRun,
    TensorValue,
    opinfo_on_one_device,
    opinfos_on_rank,
)

# The ops of a transformer's training step (its layers, losses, optimizer arithmetic, views
# and indexing): every profile runs them; the wide ones (nightly, report) every OpInfo.
COMMON_OPS = (
    *("add", "sub", "mul", "div.no_rounding_mode", "neg", "abs", "exp", "log", "sqrt"),
    *("rsqrt", "pow", "tanh", "sigmoid", "where", "clamp", "zeros_like", "ones_like"),
    *("full_like", "nn.functional.silu", "nn.functional.gelu", "nn.functional.relu"),
    *("sum", "mean", "amax", "amin", "max.reduction_with_dim", "min.reduction_with_dim"),
    *("argmax", "var", "std", "linalg.vector_norm", "softmax", "log_softmax", "cumsum"),
    *("mm", "bmm", "addmm", "matmul", "einsum", "nn.functional.linear"),
    *("nn.functional.layer_norm", "nn.functional.rms_norm", "nn.functional.embedding"),
    *("nn.functional.cross_entropy", "nn.functional.nll_loss", "nn.functional.mse_loss"),
    # scaled_dot_product_attention only in the wide profiles: DTensor's propagation through
    # its decomposition takes over a minute for some layouts (ops.toml)
    *("nn.functional.dropout",),
    *("view", "reshape", "transpose", "permute", "squeeze", "unsqueeze", "flatten"),
    *("cat", "stack", "split", "chunk", "narrow", "index_select", "gather", "scatter"),
    *("index_add", "topk", "sort"),
    *("_foreach_add", "_foreach_mul", "_foreach_div", "_foreach_norm", "_foreach_lerp"),
    *("_foreach_addcmul", "_foreach_addcdiv", "_foreach_sqrt", "_foreach_max"),
)
OP_KEYS = op_db.op_keys() if goes_wide() else COMMON_OPS

# Below the wide profiles every op runs at world size 2 (an uneven split, Partial values of two
# ranks) and at one of 1, 3 and 4 by its place in OP_KEYS: a third of the ops at each, so the
# suite costs half as much and each world size still meets every op family.
ROTATED_WORLD_SIZES = (1, 3, 4)

# Layouts an example runs the op in (each its own sample and mesh), in one call of the World:
# a rule's fault shows in some layouts only, and a call costs more than a layout in it.
LAYOUTS = 3

# An example runs the op (and its backward) in LAYOUTS layouts of small OpInfo samples; every
# OpInfo is a test of its own at every world size, so each gets few examples.
OPS = costly(50)

# Pieces run the op's kernel at other sizes and strides than the whole tensor (vectorised and
# scalar paths differ in the last bits), and sums over sharded or Partial values add in
# another order: torch.testing's own default tolerances for the dtype.
TOLERANCE = {"float32": (1.3e-6, 1e-5), "float64": (1e-7, 1e-7)}
WHY = "the kernel runs on pieces, and sums over pieces add in another order"
# Ops that sum products over a dim (the matmul family; of linalg.* and nn.functional.*:
# linear, norms, losses, attention, convolutions, and their few pointwise ops alike): sample
# values reach 9, so terms reach 81, and a sum split between ranks adds in another order;
# float32 keeps about 1e-5 of such sums.
CONTRACTIONS = ("mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "einsum", "tensordot")
CONTRACTION_TOLERANCE = {"float32": (1e-5, 1e-4), "float64": (1e-7, 1e-7)}
CONTRACTION_WHY = "products summed over a contracted dim split between ranks add in another order"
# The gradient of an argument broadcast to a larger output is the output's gradient summed
# over the broadcast dims; a piece's kernel sums in another order (it vectorises by the
# tensor's shape), and the terms may cancel: pow's exponent gradient in float32 sums ten terms
# up to 1.4e4 down to -19.17, where two orders (each within 2.3 ulp of the float64 sum's terms)
# differ by 1.9e-5 of the result; 1.2e-4 is one float32 rounding of such a term.
SUMMED_GRADIENT_TOLERANCE = {"float32": (2e-4, 1e-4), "float64": (1e-7, 1e-7)}
SUMMED_GRADIENT_WHY = "a broadcast argument's gradient sums terms that may cancel, in another order"
REFUSED = "OpRefused: "
SIMULATED = "simulated in one thread"
DTENSOR_REFUSALS = ("Sharding propagation failed", "does not have a sharding strategy registered")


@pytest.mark.spec("ops.opinfo.match_one_device")
@pytest.mark.parametrize("op", OP_KEYS)
@OPS
@given(data=st.data())
def test_op_on_dtensors_matches_one_device(world: World, op: str, data: st.DataObject) -> None:
    _skip_unless_rotated_here(op, world.world_size)
    dtypes = op_db.dtypes_of(op)
    if not usable_samples(op_db.arguments(op, dtypes[0])):
        pytest.skip(f"{op}: no sample whose tensors can all be DTensors (dense, one at least)")
    differentiable = tuple(d for d in dtypes if op_db.differentiable(op, d))
    cases = opinfo_cases(
        world.world_size,
        op=op,
        dtypes=dtypes,
        arguments=partial(op_db.arguments, op),
        differentiable=differentiable,
        lacks=world.lacks,
    )
    drawn = data.draw(st.lists(cases, min_size=LAYOUTS, max_size=LAYOUTS), label="cases")
    pending = []
    for case in drawn:
        try:
            pending.append((case, opinfo_on_one_device(case, world.device)))
        except OpRefused as error:
            event(f"the sample fails on one device: {error}"[:200])
    while pending:
        try:
            results = world.run(opinfos_on_rank, tuple(case for case, _ in pending))
        except RankFailure as rank_failure:
            refusal = _refusal(rank_failure)
            if refusal is None:
                raise
            number, kind = refusal
            parity.exercise(f"{op}: refused ({kind})")
            del pending[number]  # the others run again, without it
            continue
        for number, (case, reference) in enumerate(pending):
            parity.attach(case.call())
            parity.exercise(f"{op}: conformant")
            runs = [per_rank[number] for per_rank in results]
            _assert_backward_refusals(runs, reference, op)
            for rank, run in enumerate(runs):
                _assert_run(run, reference, case, rank)
        return


def _skip_unless_rotated_here(op: str, world_size: int) -> None:
    if goes_wide() or world_size not in ROTATED_WORLD_SIZES:
        return
    turn = ROTATED_WORLD_SIZES[OP_KEYS.index(op) % len(ROTATED_WORLD_SIZES)]
    if world_size != turn:
        pytest.skip(
            f"{op} runs at world sizes 2 and {turn} below the wide profiles (each of "
            f"{', '.join(map(str, ROTATED_WORLD_SIZES))} takes a third of the ops); "
            "--profile nightly or report runs every op at every world size"
        )


def _assert_backward_refusals(results: list[OpRun], reference: OpRun, op: str) -> None:
    """A backward pass refused alike on every rank is coverage (its gradients are not
    compared); one device refusing it too leaves nothing to compare."""
    __tracebackhide__ = True
    refusals = {run.backward_refused.split(":", 1)[0] for run in results}
    if len(refusals) > 1:
        by_rank = {rank: run.backward_refused or "no error" for rank, run in enumerate(results)}
        raise failure(f"backward: got {by_rank}, should be the same on every rank")
    refused = refusals.pop()
    if refused and not reference.backward_refused:
        parity.exercise(f"{op}: backward refused ({refused})")


def _refusal(rank_failure: RankFailure) -> tuple[int, str] | None:
    """The case every rank refused alike, and the phase and exception type; None when some
    rank did not refuse, or refused otherwise (a deviation). Ranks simulated in one thread end
    with its first error: there only DTensor's own refusal of a layout counts, since an error
    of one rank's piece would look the same."""
    outcomes = rank_failure.outcomes
    errors = [o for o in outcomes if o.status == "error"]
    if not errors or any(REFUSED not in o.summary for o in errors):
        return None
    if len(errors) < len(outcomes):
        simulated = all(o in errors or SIMULATED in o.summary for o in outcomes)
        if not simulated or not any(m in errors[0].summary for m in DTENSOR_REFUSALS):
            return None
    kinds = {_refused_kind(o.summary) for o in errors}
    return kinds.pop() if len(kinds) == 1 else None


def _refused_kind(summary: str) -> tuple[int, str]:
    number, phase, kind, *_ = summary.partition(REFUSED)[2].split(": ", 3)
    return int(number.removeprefix("case ")), f"{phase}: {kind}"


def _assert_run(run: OpRun, reference: OpRun, case: OpInfoCase, rank: int) -> None:
    __tracebackhide__ = True
    random = op_db.is_random(case.op, case.dtype, case.sample)
    largest = max(
        (o.values.size for o in reference.outputs if isinstance(o, TensorValue)), default=0
    )
    for what, got, want in (
        ("output", run.outputs, reference.outputs),
        ("gradient of tensor argument", run.grads, reference.grads),
    ):
        if what != "output" and (run.backward_refused or reference.backward_refused):
            continue
        assert_equal_values(len(got), len(want), what=f"number of {what}s on rank {rank}")
        for number, (leaf, expected) in enumerate(zip(got, want, strict=True)):
            who = f"{what} {number} of {case.op} on rank {rank}"
            summed = what != "output" and _smaller(expected, largest)
            _assert_leaf(leaf, expected, case, who, compare_values=not random, summed=summed)


def _smaller(leaf: Leaf, size: int) -> bool:
    return isinstance(leaf, TensorValue) and leaf.values.size < size


def _assert_leaf(
    leaf: Leaf, expected: Leaf, case: OpInfoCase, who: str, *, compare_values: bool, summed: bool
) -> None:
    __tracebackhide__ = True
    if not isinstance(expected, TensorValue):
        assert_equal_values(_spelled(leaf), expected, what=who)
        return
    if not isinstance(leaf, DTensorView):
        raise failure(f"{who}: got {_spelled(leaf)}, should be a DTensor")
    assert_equal_values(leaf.shape, tuple(expected.values.shape), what=f"shape of {who}")
    assert_equal_values(leaf.dtype, expected.dtype, what=f"dtype of {who}")
    _assert_placements_fit(leaf, who)
    if not compare_values:
        return
    assert leaf.full is not None
    _assert_values(leaf.full, expected.values, case, f"full_tensor() of {who}", summed=summed)
    piece = expected_piece(leaf, expected.values, case.mesh_shape)
    if piece is not None:
        where = f"to_local() of {who} {list(leaf.placements)}"
        _assert_values(leaf.local, piece, case, where, summed=summed)


def _assert_placements_fit(view: DTensorView, who: str) -> None:
    __tracebackhide__ = True
    ndim = len(view.shape)
    for placement in view.placements:
        if isinstance(placement, Shard) and not -ndim <= placement.dim < max(ndim, 0):
            raise failure(
                f"placements of {who}: got {list(view.placements)}, should shard only dims "
                f"of a tensor of rank {ndim}"
            )


def _spelled(leaf: Leaf) -> str | None:
    if isinstance(leaf, DTensorView):
        return f"a DTensor {list(leaf.shape)}"
    if isinstance(leaf, TensorValue):
        return f"a tensor {list(leaf.values.shape)}"
    return leaf


def _assert_values(
    actual: np.ndarray, expected: np.ndarray, case: OpInfoCase, what: str, *, summed: bool = False
) -> None:
    __tracebackhide__ = True
    if expected.dtype.kind not in "fc":
        assert_array_equal(actual, expected, what=what)
        return
    contraction = case.op in CONTRACTIONS or case.op.startswith(("linalg.", "nn.functional."))
    rtol, atol = (CONTRACTION_TOLERANCE if contraction else TOLERANCE)[case.dtype]
    why = CONTRACTION_WHY if contraction else WHY
    if summed:
        rtol, atol = (max(rtol, bound) for bound in SUMMED_GRADIENT_TOLERANCE[case.dtype])
        why = SUMMED_GRADIENT_WHY
    parts = (("real", np.real), ("imag", np.imag)) if expected.dtype.kind == "c" else (("", None),)
    for name, part in parts:
        got, want = (actual, expected) if part is None else (part(actual), part(expected))
        where = f"{what} ({name})" if name else what
        assert_close(
            got,
            want,
            rtol=rtol,
            atol=atol,
            dtype=case.dtype,
            what=where,
            why=why,
            record_as=f"ops/{case.dtype}",
        )
