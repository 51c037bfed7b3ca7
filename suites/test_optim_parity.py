"""Optimizer parity: FSDP2, HSDP, FSDP+TP, DDP and ZeRO against torch.optim on one device."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness import World, parity
from harness.cases.checkpointing import SAVE_POLICIES, Checkpointing
from harness.cases.comm_hooks import ROUNDING
from harness.cases.training import OPTIMIZERS, ParityCase
from harness.parity import assert_array_equal, assert_close, assert_equal_values
from harness.profiles import costly, property_settings
from harness.strategies import (
    DTENSOR_UNSUPPORTED,
    FSDP_LAYOUTS,
    KNOB_FAMILIES,
    checkpointings,
    clip_cases,
    clippings,
    comm_hooks,
    optim_configs,
    parity_cases,
    step_cases,
)
from harness.torchkit.optim import describe_reference, reference_run
from specs.clipping import clipped_by_norm, clipped_by_value, total_norm
from suites.checks.ddp_hooks import assert_within_rounding, hooked_grads_on_rank, rounded_mean
from suites.checks.training import (
    PARITY_TOLERANCE,
    PARITY_WHY,
    assert_same_training,
    assert_trained_like,
    checkpointed_dropout_on_rank,
    clip_on_rank,
    ddp_forward_buffers_on_rank,
    differentiable_steps_on_rank,
    differentiable_steps_reference,
    step_model,
    step_on_rank,
    train_on_rank,
)

PROPERTY = property_settings()

# The distributed runs sum per-rank gradients of per-rank mean losses and divide by the
# data-parallel size, where the reference takes one mean over the global batch; TP splits
# matmuls into partial sums. Same terms, another order of floating-point additions: a few
# ulps per step (measured: float64 within 3e-14, float32 within 3e-6 over 5 Adam steps),
# far below a real defect (a wrong scale, a missing shard or a stale state moves values by
# whole percent). float32 Adam divides each gradient element by its own magnitude (+eps):
# an element the clipping made tiny turns an ulp of its gradient into up to 1.2e-4 of the
# step (measured, fsdp_tp, clip 0.05), hence 1e-3.

MIXED_WHY = "float32 rounding of the average and of vectorised kernels differs by ulps"

# DTENSOR_UNSUPPORTED: fused SGD has no DTensor sharding strategy in torch 2.13 (spec
# optim.fsdp.fused_sgd); every other (optimizer, implementation) pair is drawn for sharded
# parameters. DDP and ZeRO step plain tensors: every pair.
PLAIN_TENSORS = ("ddp", "zero")


def _check_layout(world: World, data: st.DataObject, layout: str) -> None:
    """A drawn training run under ``layout``, with every variant, against one device."""
    unsupported = frozenset() if layout in PLAIN_TENSORS else DTENSOR_UNSUPPORTED
    case = data.draw(
        parity_cases(
            world.world_size,
            layout=layout,
            unsupported=unsupported,
            variants=True,
            optimizers=OPTIMIZERS,
            accelerator=world.device != "cpu",
            ddp_controls=layout in PLAIN_TENSORS,
        ),
        label="case",
    )
    _check(world, case)


def _check(world: World, case: ParityCase) -> None:
    parity.attach(case.call())
    reference = reference_run(case)
    parity.note_reference(describe_reference(case))
    trained = world.run(train_on_rank, case)
    rtol, atol = PARITY_TOLERANCE[case.dtype]
    assert_trained_like(reference, trained, case, rtol=rtol, atol=atol, why=PARITY_WHY)


@pytest.mark.spec("optim.fsdp.parity")
@costly(4)  # 71 ms an example at world size 4
@given(data=st.data())
def test_fully_shard_training_matches_one_device(world: World, data: st.DataObject) -> None:
    _check_layout(world, data, "fsdp")


@pytest.mark.spec("optim.fsdp.fused_sgd")
@PROPERTY
@given(data=st.data())
def test_fused_sgd_steps_sharded_parameters(world: World, data: st.DataObject) -> None:
    configs = optim_configs(names=("SGD",), impls=("fused",))
    case = data.draw(parity_cases(world.world_size, layout="fsdp"), label="case")
    case = ParityCase(**{**case.__dict__, "optim": data.draw(configs, label="optim")})
    _check(world, case)


@pytest.mark.spec("optim.fsdp.fused_adagrad")
@PROPERTY
@given(data=st.data())
def test_fused_adagrad_steps_sharded_parameters(world: World, data: st.DataObject) -> None:
    _check_optimizer(world, data, "Adagrad", ("fused",))


@pytest.mark.spec("optim.fsdp.rprop")
@PROPERTY
@given(data=st.data())
def test_rprop_steps_sharded_parameters(world: World, data: st.DataObject) -> None:
    _check_optimizer(world, data, "Rprop", ("default", "foreach"))


@pytest.mark.spec("optim.fsdp.adafactor")
@PROPERTY
@given(data=st.data())
def test_adafactor_steps_sharded_parameters(world: World, data: st.DataObject) -> None:
    _check_optimizer(world, data, "Adafactor", ("default", "foreach"))


def _check_optimizer(world: World, data: st.DataObject, name: str, impls: tuple[str, ...]) -> None:
    """A fully_shard training run whose optimizer is ``name`` (one of ``impls``)."""
    configs = optim_configs(names=(name,), impls=impls)
    case = data.draw(parity_cases(world.world_size, layout="fsdp"), label="case")
    case = ParityCase(**{**case.__dict__, "optim": data.draw(configs, label="optim")})
    _check(world, case)


# A knob property draws its layout too: an example costs 0.1-1.4 s at world size 4
# (fsdp to hsdp_tp), about five placement examples on average.
KNOBS_COST = 5
KNOBS = costly(KNOBS_COST)


def _fsdp_layouts(world: World) -> tuple[str, ...]:
    """The layouts that call fully_shard; TP ones need two ranks for the TP axis."""
    if world.world_size == 1:
        return tuple(layout for layout in FSDP_LAYOUTS if layout not in ("fsdp_tp", "hsdp_tp"))
    return FSDP_LAYOUTS


def _draw_case(
    world: World, data: st.DataObject, layouts: tuple[str, ...], **options: Any
) -> ParityCase:
    """A training case on one of ``layouts`` (drawn first), its optimizer one DTensors
    serve, drawn with ``parity_cases``' ``options``."""
    layout = data.draw(st.sampled_from(layouts), label="layout")
    strategy = parity_cases(
        world.world_size, layout=layout, unsupported=DTENSOR_UNSUPPORTED, **options
    )
    return data.draw(strategy, label="case")


def _check_knob(world: World, data: st.DataObject, focus: str) -> None:
    """A drawn training run with ``focus`` turned (and others sometimes) against one device."""
    options = {"variants": True, "knob_families": KNOB_FAMILIES, "focus": focus}
    options["group_allocation"] = "process_group.allocate_tensor" not in world.lacks
    _check(world, _draw_case(world, data, _fsdp_layouts(world), **options))


@pytest.mark.spec("optim.fsdp.mixed_precision")
# mutate met fsdp.post_forward_rank_div_not_mod, which only a 2-D mesh shows, at the sixth
# example at world size 4, where the share is a third of world size 2's
@costly(KNOBS_COST - 1, needs=18)
@given(data=st.data())
def test_mixed_precision_matches_its_one_device_emulation(
    world: World, data: st.DataObject
) -> None:
    # Not under TP: a row-wise matmul's partial outputs are summed across the TP group in
    # bfloat16, a rounding one device's single matmul never does (measured: 1% of a loss).
    case = _draw_case(
        world,
        data,
        ("fsdp", "hsdp"),
        mixed_precision=True,
        variants=True,
        knob_families=KNOB_FAMILIES,
        group_allocation="process_group.allocate_tensor" not in world.lacks,
    )
    parity.attach(case.call())
    reference = reference_run(case)
    parity.note_reference(describe_reference(case) + ", each policy's casts emulated per rank")
    trained = world.run(train_on_rank, case)
    # The emulation performs the same bfloat16 operations per rank and the same float32
    # average, so only rounding differs: where backends divide the sum (sum/n or sum*(1/n))
    # and where foreach/fused kernels put an element (vector lane or scalar tail) move a
    # value by an ulp or two (measured: at most 2 ulps after 3 steps). Pure float32 compute,
    # the defect this guards against, is ~1e-3 away.
    assert_trained_like(reference, trained, case, rtol=2e-6, atol=1e-8, why=MIXED_WHY)


@pytest.mark.spec("optim.knobs.divide_factor")
@costly(12)  # 304 ms an example at world size 4
@given(data=st.data())
def test_gradient_divide_factor_scales_like_one_device(world: World, data: st.DataObject) -> None:
    _check_knob(world, data, "divide_factor")


@pytest.mark.spec("optim.knobs.divide_factor_premul_sum")
@pytest.mark.world_size(min=2)  # a shard group of one rank reduces nothing
@KNOBS
@given(data=st.data())
def test_divide_factor_by_premul_sum(world: World, data: st.DataObject) -> None:
    if "reduce_scatter.premul_sum" in world.lacks:
        pytest.skip(f"the {world.runner} runner's process group has no PreMulSum reduction")
    _check(world, _draw_case(world, data, ("fsdp", "hsdp"), premul_sum=True))


@pytest.mark.spec("optim.knobs.divide_factor_one_rank_shard")
@KNOBS
@given(data=st.data())
def test_divide_factor_on_a_one_rank_shard_group(world: World, data: st.DataObject) -> None:
    # the layouts whose shard group can have one rank at this world size
    layouts = ("fsdp", "hsdp") if world.world_size == 1 else ("hsdp", "fsdp_tp", "hsdp_tp")
    _check(world, _draw_case(world, data, layouts, one_rank_shard=True))


@pytest.mark.spec("optim.knobs.micro_batching")
@costly(12)  # 376 ms an example at world size 4
@given(data=st.data())
def test_micro_batch_controls_train_like_one_device(world: World, data: st.DataObject) -> None:
    _check_knob(world, data, "micro_batching")


@pytest.mark.spec("optim.knobs.resharding")
@costly(12)  # 395 ms an example at world size 4
@given(data=st.data())
def test_resharding_controls_train_like_one_device(world: World, data: st.DataObject) -> None:
    _check_knob(world, data, "resharding")


@pytest.mark.spec("optim.knobs.checkpointing")
@costly(12)  # 455 ms an example at world size 4
@given(data=st.data())
def test_activation_checkpointing_trains_like_one_device(world: World, data: st.DataObject) -> None:
    _check_knob(world, data, "checkpoint")


@pytest.mark.spec("optim.knobs.checkpointing_composable_hooks")
@pytest.mark.world_size(min=2)  # a TP axis of two ranks
@costly(12)  # as optim.knobs.checkpointing: one failing example suffices
@given(data=st.data())
def test_composable_selective_checkpoint_of_tp_layers(world: World, data: st.DataObject) -> None:
    case = _draw_case(world, data, ("fsdp_tp", "hsdp_tp"), variants=True)
    layers = len(case.dims) - 1
    how = Checkpointing(
        api="composable",
        layers=tuple(sorted(data.draw(st.sets(st.integers(0, layers - 1), min_size=1)))),
        save=data.draw(st.sampled_from(SAVE_POLICIES), label="save"),
        early_stop=False,
    )
    _check(world, replace(case, knobs=case.knobs.with_checkpoint(how)))


@pytest.mark.spec("optim.knobs.checkpointing_dropout")
@costly(KNOBS_COST, whole_at=1)  # the whole budget where rank threads serve it
@given(data=st.data())
def test_checkpointing_replays_dropout(world: World, data: st.DataObject) -> None:
    if world.runner == "threads" and world.world_size > 1:
        pytest.skip(
            "rank threads share one CPU generator: dropout's masks would depend on how the "
            "threads interleave (one rank thread, and rank processes, serve this property)"
        )
    families = tuple(f for f in KNOB_FAMILIES if f != "checkpoint")  # the check turns it
    case = _draw_case(world, data, ("fsdp", "hsdp"), variants=True, knob_families=families)
    how = data.draw(checkpointings(len(case.dims) - 1, random=True), label="checkpointing")
    case = replace(case, knobs=case.knobs.with_checkpoint(how))
    case = replace(case, dropout=data.draw(st.sampled_from((0.1, 0.5)), label="dropout"))
    parity.attach(f"{case.call()}, with and without {how.describe()}")
    parity.note_reference("the same layout without activation checkpointing, same seeds")
    plain, checkpointed = zip(*world.run(checkpointed_dropout_on_rank, case), strict=True)
    # Recomputation replays the same operations on the same values with the generator
    # state restored: nothing may differ, to the bit.
    assert_same_training(
        list(checkpointed),
        list(plain),
        case,
        rtol=0.0,
        atol=0.0,
        why="",
        against="no checkpointing",
    )


@pytest.mark.spec("optim.flags.parity")
@costly(7)  # 240 ms an example at world size 4
@given(data=st.data())
def test_optimizer_flags_train_like_one_device(world: World, data: st.DataObject) -> None:
    accelerator = world.device != "cpu"
    options = {"variants": True, "optim_flags": True, "accelerator": accelerator}
    _check(world, _draw_case(world, data, _fsdp_layouts(world), **options))


@pytest.mark.spec("optim.fsdp.clip_inf_norm_empty_shard")
@pytest.mark.world_size(min=2)
@PROPERTY
@given(data=st.data())
def test_clip_inf_norm_with_an_empty_shard(world: World, data: st.DataObject) -> None:
    case = data.draw(
        parity_cases(world.world_size, layout="fsdp", unsupported=DTENSOR_UNSUPPORTED),
        label="case",
    )
    # world size - 1 output features over world size ranks: the last rank holds no row
    dims = (*case.dims[:-1], world.world_size - 1)
    clipping = data.draw(clippings((math.inf,), by_value=False), label="clipping")
    case = replace(case, dims=dims, clipping=clipping)
    _check(world, case)


@pytest.mark.spec("optim.hsdp.parity")
@costly(5)  # 117 ms an example at world size 4
@given(data=st.data())
def test_hsdp_training_matches_one_device(world: World, data: st.DataObject) -> None:
    _check_layout(world, data, "hsdp")


@pytest.mark.spec("optim.fsdp_tp.parity")
@pytest.mark.world_size(min=2)
@costly(9)  # 200 ms an example at world size 4
@given(data=st.data())
def test_fsdp_tp_training_matches_one_device(world: World, data: st.DataObject) -> None:
    _check_layout(world, data, "fsdp_tp")


@pytest.mark.spec("optim.hsdp_tp.parity")
@pytest.mark.world_size(min=2)
@costly(12)  # 665 ms an example at world size 4
@given(data=st.data())
def test_hsdp_tp_training_matches_one_device(world: World, data: st.DataObject) -> None:
    _check_layout(world, data, "hsdp_tp")


@pytest.mark.spec("optim.ddp.parity")
@costly(3)  # 48 ms an example at world size 4
@given(data=st.data())
def test_ddp_training_matches_one_device(world: World, data: st.DataObject) -> None:
    _check_layout(world, data, "ddp")


@pytest.mark.spec("optim.ddp.broadcast_buffers")
@costly(2)  # 62 ms an example at world size 4
@given(data=st.data())
def test_ddp_forwards_start_from_rank0s_buffers(world: World, data: st.DataObject) -> None:
    case = data.draw(
        parity_cases(
            world.world_size,
            layout="ddp",
            variants=True,
            optimizers=OPTIMIZERS,
            accelerator=world.device != "cpu",
        ),
        label="case",
    )
    case = replace(case, micro_batches=1, sync_each_micro_batch=False)  # no_sync skips it
    parity.attach(f"DDP {case.call()}")
    seen = world.run(ddp_forward_buffers_on_rank, case)
    options = dict(case.wrapper_options)
    synced_at_start = options.get("broadcast_buffers", True)
    synced_each_forward = options.get("forward_sync_buffers", synced_at_start)
    for rank, buffers in enumerate(seen):
        # broadcast_buffers=False: each rank keeps its own (rank 0's shifted by its rank);
        # forward_sync_buffers=False: rank 0's at construction only, then each rank's own.
        start = seen[0][0] if synced_at_start else seen[0][0] + rank
        assert_array_equal(buffers[0], start, what=f"running buffer on rank {rank} at first")
        if not synced_each_forward:
            continue
        for step, (got, want) in enumerate(zip(buffers, seen[0], strict=True)):
            assert_array_equal(  # a broadcast copies bits
                got,
                want,
                what=f"running buffer at the start of forward {step} on rank {rank} (rank 0's)",
            )


@pytest.mark.spec("optim.ddp.compress_hooks")
@costly(2)  # 38 ms an example at world size 4
@given(data=st.data())
def test_ddp_compress_hooks_round_the_mean_gradient(world: World, data: st.DataObject) -> None:
    case = data.draw(parity_cases(world.world_size, layout="ddp", variants=True), label="case")
    # torch 2.13 refuses the bf16 hooks but over NCCL (CUDA 11+) or XCCL: TypeError
    names = ROUNDING if world.device != "cpu" else tuple(n for n in ROUNDING if "fp16" in n)
    hook = data.draw(comm_hooks(names), label="hook")
    case = replace(case, dtype="float32", steps=1, micro_batches=1, comm_hook=hook)
    parity.attach(f"one backward of {case.call()}")
    want = rounded_mean(case)
    parity.note_reference(f"each rank's float32 gradient rounded to {want.dtype} on one device")
    seen = world.run(hooked_grads_on_rank, case)
    for rank, grads in enumerate(seen):
        assert_equal_values(sorted(grads), sorted(want.sums), what=f"gradients on rank {rank}")
        for name, got in grads.items():
            # an all-reduce hands every rank the same bits
            assert_array_equal(got, seen[0][name], what=f"{name}.grad on rank {rank} (rank 0's)")
            # Non-zero: the sum is taken in 16 bits, in an order the backend chooses.
            assert_within_rounding(got, want, name, what=f"{name}.grad on rank {rank}")


@pytest.mark.spec("optim.ddp.static_graph_no_sync")
@PROPERTY
@given(data=st.data())
def test_ddp_static_graph_accumulates_like_one_device(world: World, data: st.DataObject) -> None:
    case = data.draw(
        parity_cases(world.world_size, layout="ddp", variants=True),
        label="case",
    )
    rows = 2 * data.draw(st.integers(1, 2), label="rows per micro-batch")
    options = {**dict(case.wrapper_options), "static_graph": True}
    case = replace(
        case,
        batch_per_rank=rows,
        micro_batches=2,
        sync_each_micro_batch=False,
        wrapper_options=tuple(options.items()),
    )
    _check(world, case)


@pytest.mark.spec("optim.zero.parity")
@costly(3)  # 69 ms an example at world size 4
@given(data=st.data())
def test_zero_training_matches_one_device(world: World, data: st.DataObject) -> None:
    _check_layout(world, data, "zero")


# The spec model computes in float64 from the same (dtype-rounded) inputs. float64: only
# the order of operations differs (lerp vs multiply-add, fused vs per-op rounding; measured
# within 2e-15 relative over 4 Adam steps). float32: torch rounds every intermediate to
# float32 (~6e-8 relative each), a few dozen operations over 4 steps.
STEP_TOLERANCE = {"float64": (1e-12, 1e-14), "float32": (2e-5, 1e-6)}  # (rtol, atol)


@pytest.mark.spec("optim.step.matches_spec")
@costly(2)  # 22 ms an example at world size 4
@given(data=st.data())
def test_optimizer_steps_match_the_spec_model(world: World, data: st.DataObject) -> None:
    case = data.draw(
        step_cases(world.world_size, dtensor_unsupported=DTENSOR_UNSUPPORTED), label="case"
    )
    parity.attach(case.call())
    expected = step_model(case)
    parity.note_reference("numpy: specs.optimizers (the torch.optim documentation's algorithms)")
    gathered = world.run(step_on_rank, case)
    rtol, atol = STEP_TOLERANCE[case.dtype]
    given = case.given_grads(case.steps - 1)
    for rank, stepped in enumerate(gathered):
        for index, (got_grad, want_grad) in enumerate(zip(stepped.grads, given, strict=True)):
            # step() reads the gradients: it must leave them as backward left them
            what = f"gradient {index} on rank {rank} after the last step (as given)"
            if want_grad is None:
                assert got_grad is None, f"{what}: got an array, should be None [{case.call()}]"
            else:
                assert got_grad is not None, f"{what}: got None [{case.call()}]"
                assert_array_equal(got_grad, want_grad.astype(case.dtype), what=what)
        for index, (got, want) in enumerate(zip(stepped.params, expected, strict=True)):
            assert_close(
                got,
                want,
                rtol=rtol,
                atol=atol,
                dtype=case.dtype,
                what=f"parameter {index} on rank {rank}",
                why="torch rounds intermediates where the float64 model does not",
                record_as=f"param/{case.dtype}",
            )


# float32: torch sums the powers per tensor, then over tensors (and over shards for DTensors),
# where the float64 model sums all at once: a few ulps of the norm and of every clipped value.
CLIP_TOLERANCE = {"float64": (1e-12, 1e-15), "float32": (1e-5, 1e-7)}  # (rtol, atol)


@pytest.mark.spec("optim.clip.matches_spec")
@PROPERTY  # whole budget: at half, ci's draws at world size 2 miss clip_nonfinite_check_misses_inf
@given(data=st.data())
def test_gradient_clipping_matches_the_spec_model(world: World, data: st.DataObject) -> None:
    case = data.draw(clip_cases(world.world_size), label="case")
    parity.attach(case.call())
    grads, clipping = case.grads(), case.clipping
    total = None if clipping.how == "value" else total_norm(grads, clipping.norm_type)
    if total is None:
        want = clipped_by_value(grads, clipping.bound)
    else:
        want = clipped_by_norm(grads, clipping.bound, total)
    parity.note_reference("numpy: specs.clipping (torch.nn.utils' documented clipping)")
    refuses = total is not None and not math.isfinite(total) and clipping.error_if_nonfinite
    rtol, atol = CLIP_TOLERANCE[case.dtype]
    for rank, clipped in enumerate(world.run(clip_on_rank, case)):
        if refuses:
            # the total norm is one value on every rank: every rank must refuse it
            refused = clipped.error or "no error"
            assert "non-finite" in refused, (
                f"rank {rank}: got {refused}, should be a RuntimeError on the non-finite "
                f"total norm {total} [{case.call()}]"
            )
            continue
        assert clipped.error is None, f"rank {rank}: got {clipped.error} [{case.call()}]"
        if total is not None:
            assert clipped.total is not None, f"rank {rank}: no total norm [{case.call()}]"
            assert_close(
                clipped.total,
                np.array(total),
                rtol=rtol,
                atol=atol,
                dtype=case.dtype,
                what=f"total norm on rank {rank}",
                why="float32 sums the powers in another order",
            )
        for index, (got, expected) in enumerate(zip(clipped.grads, want, strict=True)):
            assert_close(
                got,
                expected,
                rtol=rtol,
                atol=atol,
                dtype=case.dtype,
                what=f"gradient {index} on rank {rank}",
                why="float32 sums the powers in another order",
            )


# DTensor runs the same elementwise kernels on each piece as one device on the whole, and the
# loss's sum only feeds gradients that are elementwise too: measured equal to the bit; a
# tolerance of a few ulps leaves room for a decomposition that rounds once more.
DIFFERENTIABLE_TOLERANCE = {"float64": (1e-13, 1e-15), "float32": (1e-6, 1e-7)}
DIFFERENTIABLE_WHY = "a decomposed kernel may round once more than the fused one"


@pytest.mark.spec("optim.step.differentiable")
@costly(12)  # 329 ms an example at world size 4
@given(data=st.data())
def test_differentiable_steps_on_dtensors_match_one_device(
    world: World, data: st.DataObject
) -> None:
    case = data.draw(step_cases(world.world_size, differentiable=True), label="case")
    parity.attach(case.call())
    expected = differentiable_steps_reference(case, world.device)
    parity.note_reference(f"{world.device}: torch.optim, the same differentiable steps")
    gathered = world.run(differentiable_steps_on_rank, case)
    rtol, atol = DIFFERENTIABLE_TOLERANCE[case.dtype]
    for rank, got in enumerate(gathered):
        for kind in ("params", "param_grads", "grad_grads"):
            pairs = zip(getattr(got, kind), getattr(expected, kind), strict=True)
            for index, (value, want) in enumerate(pairs):
                what = f"{kind}[{index}] on rank {rank}"
                # torch's SGD detaches its first momentum buffer: no gradient, on one device too
                assert_equal_values(value is None, want is None, what=f"{what} is None")
                if value is not None:
                    assert_close(
                        value,
                        want,
                        rtol=rtol,
                        atol=atol,
                        dtype=case.dtype,
                        what=what,
                        why=DIFFERENTIABLE_WHY,
                        record_as=f"{kind}/{case.dtype}",
                    )
