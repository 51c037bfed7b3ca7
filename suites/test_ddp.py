"""DistributedDataParallel's options beyond the training parity of test_optim_parity.py
(optim.ddp.*): ``join``'s options with uneven inputs, against the arithmetic its docs give."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness import World, parity
from harness.parity import assert_close, assert_equal_values, failure
from harness.profiles import costly
from harness.strategies import join_cases
from suites.checks.ddp_join import EXHAUSTED, ddp_join_on_rank, join_reference

# float64 SGD: DDP divides each rank's gradient before the all-reduce sums them, the
# reference sums the quotients in rank order; another order of additions, a few ulps.
RTOL, ATOL = 1e-10, 1e-12
WHY = "the all-reduce may add the ranks' gradients in another order than the reference"


def _assert_params(got: list[np.ndarray], want: list[np.ndarray], what: str) -> None:
    __tracebackhide__ = True
    assert_equal_values(len(got), len(want), what=f"number of parameters {what}")
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        what_index = f"parameter {index} {what}"
        assert_close(g, w, rtol=RTOL, atol=ATOL, dtype="float64", what=what_index, why=WHY)


@pytest.mark.spec("ddp.join.options")
@costly(2)  # 25 ms an example at world size 2
@given(data=st.data())
def test_join_options_follow_the_documented_arithmetic(world: World, data: st.DataObject) -> None:
    case = data.draw(join_cases(world.world_size, options=True), label="case")
    parity.attach(case.call())
    expected = join_reference(case, world.world_size)
    parity.note_reference("the join docs' gradient arithmetic with SGD on one device")
    for rank, run in enumerate(world.run(ddp_join_on_rank, case)):
        raised = run.error is not None
        if raised != expected.throws:
            should = f"raise RuntimeError '... {EXHAUSTED} ...'" if expected.throws else "not raise"
            raise failure(f"join() on rank {rank}: got error {run.error!r}, should {should}")
        steps = expected.steps_of[rank]
        assert_equal_values(len(run.steps), steps, what=f"steps taken by rank {rank}")
        for index, params in enumerate(run.steps):
            _assert_params(params, expected.trajectory[index], f"after step {index} on rank {rank}")
        # the last rank to join broadcasts its model to the others on leaving the context;
        # where one threw, every rank stopped at the same step
        final = expected.trajectory[max(expected.steps_of) - 1]
        _assert_params(run.final, final, f"after the join context on rank {rank}")
