"""Compile: DTensor programs through ``torch.compile(fullgraph=True)`` against the same
programs run eagerly on DTensors and on one device (values, placements, local pieces,
gradients).

Runners. The process runner serves it (each rank its own dynamo). The thread runner does
too: rank threads compiling at once (world sizes 1-4, every skeleton, both backends) gave
eager's answers bit for bit with aot_eager; each compiled callable is a rank's own (its key
holds its mesh, its code object is its own, so dynamo's per-code cache never hands one
rank's graph to another), and dynamo's settings are set once per process, alike for every
rank. The local runner does not serve it: the suite is not among ``runners.SERVES``'s
(LocalTensorMode runs every rank in one thread, and a graph traced there would be one
rank's, not every rank's).

Families. The skeletons come in families (``strategies.compile.FAMILIES``), each a test of
its own so that every run compiles each: layouts, reduce ops other than sum, a compiled
block's boundaries (outputs live, the loss and an op outside it), ``torch.distributed``
collectives on local pieces (remapped by dynamo to functional collectives; they run on rank
threads, whose group holds every reduce op they call), guards (a callable called again in
other placements must compile anew: ``CompiledRun.stale`` says it did not). Strides of
values are compared with eager's too.

Cost. A graph costs seconds to compile (about 4 s with aot_eager on 2 cores, a minute
and more with inductor, whose C++ kernels are compiled too); a call of a cached one
milliseconds. Programs come from a small pool of skeletons (``strategies.compile``) and
compiled callables are cached per rank by structure (``torchkit.compile``), so examples of
one skeleton reuse its graph. What compiling cost is counted into each test's record
(``parity.exercise``): graphs compiled or reused, recompilations, compile seconds in bins,
refusals by op family.

Training (``compile.training.blocks_match_eager``): each block of the parity properties' MLP
compiled between tensor parallelism and ``fully_shard``, as torchtitan orders them, trained
eagerly and compiled on the same rows (bit for bit with aot_eager) and against one device.
FSDP2's hooks run eagerly around the compiled blocks (torch 2.13 disables dynamo on them).
Rank threads draw fully_shard only: with FSDP+TP, a foreach Adam step on rank threads met
gradients on the dp mesh beside parameters on the (dp, tp) mesh in a case that rank
processes (and eager training on threads) run right; rank processes draw both layouts.

A refusal (torch declining to capture a program whole: ``Unsupported`` and its kin, alike
on every rank) is coverage, as the ops suite counts an op's refusal of a layout; any other
error of the compiled run where the eager run had none fails the example.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness import World, parity
from harness.cases.compile import CompileCase
from harness.parity import assert_array_equal, assert_close, assert_equal_values, failure
from harness.profiles import costly, goes_wide
from harness.strategies import compile_cases, compiled_training_cases
from harness.strategies.compile import FAMILIES
from harness.torchkit.dtensor import DTensorView
from harness.torchkit.optim import Trained, describe_reference, reference_run
from suites.checks.compile import CompiledRun, compiled_program_on_rank
from suites.checks.compile_training import CompiledTraining, compiled_training_on_rank
from suites.checks.programs import ProgramRun, Reference, program_on_one_device
from suites.checks.programs_compare import PROGRAM_RTOL, assert_program_matches
from suites.checks.training import PARITY_TOLERANCE, PARITY_WHY, assert_trained_like

# inductor's generated C++ kernels may fuse and vectorise what eager computes op by op:
# the same terms summed in another order, a few ulps of the largest term (the program
# property's own tolerance against one device, for the same reason).
INDUCTOR_WHY = "inductor's kernels may add the same terms in another order (fused, vectorised)"
SECONDS_BINS = ((0.5, "< 0.5 s"), (2.0, "0.5-2 s"), (5.0, "2-5 s"), (20.0, "5-20 s"))


@pytest.mark.spec("compile.program.matches_eager")
@pytest.mark.parametrize("family", FAMILIES)
# ci: 2 examples a world size and family; a new graph about 4 s at world size 2 (the suite's
# ci run at world sizes 1-2: about 64 s on 2 busy cores, 34 s before the families)
@costly(50)
@given(data=st.data())
def test_compiled_programs_match_eager_aot_eager(
    world: World, family: str, data: st.DataObject
) -> None:
    if world.world_size > 2 and not goes_wide():
        pytest.skip(
            "compile at world sizes above 2 runs in the wide profiles (nightly, report): each "
            "rank compiles its own graph, over 20 s an example at 3 and 4 ranks on 2 cores"
        )
    _check_compiled(world, data, "aot_eager", family)


@pytest.mark.spec("compile.program.matches_eager")
@pytest.mark.skipif(shutil.which("cc") is None, reason="inductor needs a C compiler on CPU")
@costly(100)  # ci: 2 examples a world size; a new graph about a minute on 2 cores
@given(data=st.data())
def test_compiled_programs_match_eager_inductor(world: World, data: st.DataObject) -> None:
    if not goes_wide():
        pytest.skip(
            "inductor runs in the wide profiles (nightly, report): it compiles each graph's C++ "
            "kernels, a minute and more a rank on 2 cores"
        )
    _check_compiled(world, data, "inductor")


@pytest.mark.spec("compile.training.blocks_match_eager")
@costly(50)  # ci: 2 examples a world size; new graphs about 10 s at world size 2
@given(data=st.data())
def test_compiled_blocks_train_like_eager_and_one_device(world: World, data: st.DataObject) -> None:
    if world.world_size > 2 and not goes_wide():
        pytest.skip(
            "compiled training at world sizes above 2 runs in the wide profiles (nightly, "
            "report): each rank compiles its own blocks, over 20 s an example on 2 cores"
        )
    # FSDP+TP with compiled blocks on rank threads: a foreach Adam's step met gradients on
    # the dp mesh beside parameters on the (dp, tp) mesh, where rank processes run the same
    # case as eager does (process-wide compile state the threads share); processes draw it.
    tensor_parallel = world.runner != "threads"
    cases = compiled_training_cases(
        world.world_size, backend="aot_eager", tensor_parallel=tensor_parallel
    )
    case = data.draw(cases, label="case")
    parity.attach(case.call())
    reference = reference_run(case.training)
    parity.note_reference(describe_reference(case.training))
    runs = world.run(compiled_training_on_rank, case)
    rtol, atol = PARITY_TOLERANCE[case.training.dtype]
    eager = [run.eager for run in runs]
    assert_trained_like(reference, eager, case.training, rtol=rtol, atol=atol, why=PARITY_WHY)
    if _refused(runs, case.backend):
        return
    compiled = [run.compiled for run in runs if run.compiled is not None]
    for rank, (got, want) in enumerate(zip(compiled, eager, strict=True)):
        _assert_trained_alike(got, want, rank)
    assert_trained_like(reference, compiled, case.training, rtol=rtol, atol=atol, why=PARITY_WHY)


def _refused(runs: list[CompiledTraining], backend: str) -> bool:
    """Whether torch refused to compile the blocks, alike on every rank (coverage, counted);
    else the graphs compiled are counted."""
    refusals = {run.refusal.split(":", 1)[0] for run in runs}
    if len(refusals) > 1:
        by_rank = {rank: run.refusal or "compiled" for rank, run in enumerate(runs)}
        raise failure(f"compile: got {by_rank}, should be the same on every rank")
    if runs[0].refusal:
        parity.exercise(f"{backend} blocks: refused ({runs[0].refusal.split(':')[0]})")
        return True
    parity.exercise(f"{backend} blocks: {runs[0].graphs} graphs compiled")
    return False


def _assert_trained_alike(got: Trained, want: Trained, rank: int) -> None:
    """aot_eager runs eager's kernels on AOTAutograd's graphs: eager's losses and parameters
    bit for bit."""
    __tracebackhide__ = True
    what = f"on rank {rank}, compiled blocks (aot_eager) against eager"
    assert_array_equal(np.array(got.losses), np.array(want.losses), what=f"losses {what}")
    assert_equal_values(sorted(got.params), sorted(want.params), what=f"parameter names {what}")
    for name, value in want.params.items():
        assert_array_equal(got.params[name], value, what=f"{name} {what}")


def _check_compiled(
    world: World, data: st.DataObject, backend: str, family: str | None = None
) -> None:
    cases = compile_cases(world.world_size, backend=backend, family=family)
    case = data.draw(cases, label="case")
    parity.attach(case.call())
    expected = program_on_one_device(case.program, world.device)
    runs = world.run(compiled_program_on_rank, case)
    _count(case, runs)
    check_compiled_runs(case, runs, expected)


def check_compiled_runs(case: CompileCase, runs: list[CompiledRun], expected: Reference) -> None:
    """Every rank's eager run against one device; where torch compiled the program, every
    rank's compiled run against its eager run and one device, and no graph reused for
    placements it was not compiled for."""
    __tracebackhide__ = True
    assert_program_matches([run.eager for run in runs], expected, case.program)
    refusals = {(run.refused_family, run.refusal.split(":", 1)[0]) for run in runs}
    if len(refusals) > 1:
        by_rank = {rank: run.refusal or "compiled" for rank, run in enumerate(runs)}
        raise failure(f"compile: got {by_rank}, should be the same on every rank")
    if runs[0].refusal:
        return
    stale = [rank for rank, run in enumerate(runs) if run.stale]
    if stale:
        placements = case.program.leaves[0].placements
        raise failure(
            f"compile: on ranks {stale}, a graph compiled for x0 in {case.guard_placements} ran "
            f"x0 in {placements}: got 0 graphs compiled, should be a new one (dynamo's guard "
            "on the DTensor's spec)"
        )
    compiled = [run.compiled for run in runs]
    assert all(run is not None for run in compiled)
    for rank, (run, eager) in enumerate(zip(compiled, runs, strict=True)):
        assert run is not None
        _assert_like_eager(run, eager.eager, case, rank)
    assert_program_matches([run for run in compiled if run is not None], expected, case.program)


def _count(case: CompileCase, runs: list[CompiledRun]) -> None:
    """What compiling cost this example, counted into the test's record (rank 0's: every
    rank compiles the same graphs)."""
    run, backend = runs[0], case.backend
    if run.refusal:
        parity.exercise(f"{backend}: refused ({run.refused_family}: {run.refusal.split(':')[0]})")
        return
    if not run.reused:
        parity.exercise(f"{backend}: program compiled ({run.graphs} graph)")
        seconds = next((label for bound, label in SECONDS_BINS if run.seconds < bound), "> 20 s")
        parity.exercise(f"{backend}: compile {seconds}")
    else:
        parity.exercise(f"{backend}: graph reused")
    recompiled = run.graphs if run.reused else max(0, run.graphs - 1)
    parity.exercise(f"{backend}: {recompiled} recompilations")


def _assert_like_eager(run: ProgramRun, eager: ProgramRun, case: CompileCase, rank: int) -> None:
    """aot_eager runs eager's kernels on AOTAutograd's graphs: bit for bit eager's answers.
    inductor within ``PROGRAM_RTOL`` of the largest value (``INDUCTOR_WHY``)."""
    __tracebackhide__ = True
    names = case.program.value_names()
    assert_equal_values(run.requires_grad, eager.requires_grad, what="requires_grad of values")
    arrays = [v.local for v in eager.values] + [
        g.local if isinstance(g, DTensorView) else g for g in eager.grads if g is not None
    ]
    scale = max((float(np.abs(a).max()) for a in arrays if a.size), default=0.0)
    for index, (got, want) in enumerate(zip(run.values, eager.values, strict=True)):
        _assert_view(got, want, f"{names[index]} on rank {rank}", case.backend, scale)
    for index, (grad, eager_grad) in enumerate(zip(run.grads, eager.grads, strict=True)):
        who = f"the gradient of {names[index]} on rank {rank}"
        if grad is None or eager_grad is None:
            assert_equal_values(grad is None, eager_grad is None, what=f"{who} is None")
        elif isinstance(grad, DTensorView) and isinstance(eager_grad, DTensorView):
            if case.split is None:
                _assert_view(grad, eager_grad, who, case.backend, scale)
                continue
            # A compiled backward redistributes a gradient that reaches it to the placements
            # tracing gave its output: a leaf's gradient may then be laid out otherwise than
            # eager's, holding eager's values.
            assert grad.full is not None
            assert eager_grad.full is not None
            _assert_array(grad.full, eager_grad.full, f"{who} (full)", case.backend, scale)
        else:
            assert isinstance(grad, np.ndarray)
            assert isinstance(eager_grad, np.ndarray)
            _assert_array(grad, eager_grad, f"{who} (local)", case.backend, scale)


def _assert_view(got: DTensorView, want: DTensorView, who: str, backend: str, scale: float) -> None:
    __tracebackhide__ = True
    for what in ("coord", "shape", "stride", "placements", "dtype", "local_dtype"):
        assert_equal_values(getattr(got, what), getattr(want, what), what=f"{what} of {who}")
    _assert_array(got.local, want.local, f"to_local() of {who}", backend, scale)
    if got.full is not None and want.full is not None:
        _assert_array(got.full, want.full, f"full_tensor() of {who}", backend, scale)


def _assert_array(got: np.ndarray, want: np.ndarray, what: str, backend: str, scale: float) -> None:
    __tracebackhide__ = True
    what = f"{what}, compiled ({backend}) against eager"
    if backend == "aot_eager":
        assert_array_equal(got, want, what=what)
        return
    atol = PROGRAM_RTOL * (1.0 + scale)
    assert_close(
        got,
        want,
        rtol=PROGRAM_RTOL,
        atol=atol,
        dtype="float64",
        what=what,
        why=INDUCTOR_WHY,
        record_as="compile/inductor",
    )
