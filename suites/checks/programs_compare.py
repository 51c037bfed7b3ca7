"""The DTensor program property's comparison: each rank's values and leaf gradients against
the program on one device (shared by the placements and compile suites)."""

from __future__ import annotations

import numpy as np

from harness.cases.programs import ProgramCase, no_partial
from harness.parity import assert_close, assert_equal_values, failure
from harness.torchkit.dtensor import DTensorView
from specs.placements import contiguous_stride, local_arrays
from suites.checks.dtensor import expected_piece
from suites.checks.programs import ProgramRun, Reference

# A program's values are sums and products of leaves holding multiples of 1/64: one device
# and the DTensor program add the same terms in other orders (sharded sums, then a
# reduction), which costs a few ulps of the largest term. The terms are values the program
# computed, so the tolerance is held to the largest of them.
PROGRAM_RTOL = 1e-9
PROGRAM_WHY = "the same terms added in another order; atol scales with the largest term"


def assert_program_matches(runs: list[ProgramRun], expected: Reference, case: ProgramCase) -> None:
    """Every rank's run of ``case`` holds one device's values and gradients (``expected``)."""
    __tracebackhide__ = True
    arrays = [a for a in [*expected.values, *expected.grads] if a is not None and a.size]
    scale = max((float(np.abs(a).max()) for a in arrays), default=0.0)
    atol = PROGRAM_RTOL * (1.0 + scale)
    for rank, run in enumerate(runs):
        _assert_program_values(run, expected, case, rank, atol)
        _assert_program_grads(run, expected, case, rank, atol)


def _assert_program_values(
    run: ProgramRun, expected: Reference, case: ProgramCase, rank: int, atol: float
) -> None:
    __tracebackhide__ = True
    names = case.value_names()
    for index, view in enumerate(run.values):
        who = f"{names[index]} on rank {rank} (mesh coord {view.coord})"
        want = expected.values[index]
        assert_equal_values(view.coord, case.mesh.coord_of(rank), what=f"mesh coordinate of {who}")
        assert_equal_values(view.dtype, "float64", what=f"dtype of {who}")
        assert_equal_values(view.shape, want.shape, what=f"shape of {who}")
        if expected.contiguous[index] and want.size:
            # a side of 1 is never stepped over: its stride is free on one device too
            sides = [d for d, side in enumerate(want.shape) if side > 1]
            strides = [
                [stride[d] for d in sides] for stride in (view.stride, expected.strides[index])
            ]
            assert_equal_values(*strides, what=f"stride of {who} (sides > 1)")
        grad_flag = run.requires_grad[index]
        assert_equal_values(
            grad_flag, expected.requires_grad[index], what=f"requires_grad of {who}"
        )
        _assert_program_array(view, want, case, who, atol, "program/values")


def _assert_program_grads(
    run: ProgramRun, expected: Reference, case: ProgramCase, rank: int, atol: float
) -> None:
    __tracebackhide__ = True
    names = case.value_names()
    for index, grad in enumerate(run.grads):
        who = f"the gradient of {names[index]} on rank {rank}"
        want = expected.grads[index]
        if grad is None or want is None:
            if grad is not None or want is not None:
                should = "None (the loss does not depend on it)" if want is None else "a gradient"
                raise failure(
                    f"{who}: got {'None' if grad is None else 'a gradient'}, should be {should}"
                )
            continue
        if isinstance(grad, DTensorView):
            assert_equal_values(grad.shape, want.shape, what=f"shape of {who}")
            _assert_program_array(grad, want, case, who, atol, "program/grads")
            _assert_laid_out_like_its_leaf(grad, who, case.leaves[index].transposed)
            continue
        placements = no_partial(case.leaves[index].placements)
        coord = case.mesh.coord_of(rank)
        local = local_arrays(want, case.mesh.shape, placements)[coord]
        what = f"{who}'s local tensor (from_local's input, laid out {placements})"
        assert_close(
            grad, local, rtol=PROGRAM_RTOL, atol=atol, dtype="float64", what=what, why=PROGRAM_WHY
        )


def _assert_program_array(
    view: DTensorView, want: np.ndarray, case: ProgramCase, who: str, atol: float, record_as: str
) -> None:
    """full_tensor() is one device's value, and to_local() its piece for the placements
    the result carries (not known for Partial contributions)."""
    __tracebackhide__ = True
    assert view.full is not None
    _assert_program_close(view.full, want, f"full_tensor() of {who}", atol, record_as)
    local = expected_piece(view, want, case.mesh.shape)
    if local is not None:
        _assert_program_close(view.local, local, f"to_local() of {who}", atol)


def _assert_laid_out_like_its_leaf(grad: DTensorView, who: str, transposed: bool) -> None:
    """AccumulateGrad's layout contract, on the local tensors too: a leaf's .grad is laid
    out like the leaf (contiguous, or a transposed leaf's last two strides swapped), and its
    local tensor steps through its dims in the leaf's local order, row-major (a chunk of a
    gathered tensor may leave gaps between rows; a transposed local tensor under contiguous
    metadata breaks view() and flat-buffer optimizers on it). distribute_tensor of a
    transposed tensor keeps its stride as the DTensor's and makes its local tensor
    contiguous (torch 2.13): the gradient follows that leaf."""
    __tracebackhide__ = True
    local_shape = grad.local.shape
    dims = [d for d in range(len(grad.shape)) if grad.shape[d] > 1 and local_shape[d] > 1]
    want = list(contiguous_stride(grad.shape))
    if transposed:
        swapped = [*grad.shape[:-2], grad.shape[-1], grad.shape[-2]]
        want = list(contiguous_stride(tuple(swapped)))
        want[-2], want[-1] = want[-1], want[-2]
    assert_equal_values(
        [grad.stride[d] for d in dims], [want[d] for d in dims], what=f"stride of {who}"
    )
    order = sorted(dims, key=lambda d: (-grad.local_stride[d], d))
    what = f"dims of {who}'s local tensor by stride, largest first (stride {grad.local_stride})"
    assert_equal_values(order, dims, what=what)


def _assert_program_close(
    actual: np.ndarray, want: np.ndarray, what: str, atol: float, record_as: str | None = None
) -> None:
    __tracebackhide__ = True
    assert_close(
        actual,
        want,
        rtol=PROGRAM_RTOL,
        atol=atol,
        dtype="float64",
        what=what,
        why=PROGRAM_WHY,
        record_as=record_as,
    )
