"""Strategies for training cases: small models, batches and optimizer steps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hypothesis import strategies as st

from harness.cases.comm_hooks import LOSSLESS
from harness.cases.knobs import Knobs
from harness.cases.training import (
    CORE_OPTIMIZERS,
    FSDP_LAYOUTS,
    IMPLEMENTATIONS,
    LAYOUTS,
    OPTIMIZERS,
    TP_LAYOUTS,
    JoinCase,
    MLPCase,
    OptimConfig,
    OverlapCase,
    ParamsCase,
    ParityCase,
    PartitionCase,
    StepCase,
    shard_size,
)
from harness.errors import check_int, check_one_of, check_subset, fail, require
from harness.strategies._common import (
    factorisations,
    mesh_shapes,
    sampled,
    seeds,
    shapes,
    takes_world_size,
)
from harness.strategies.comm_hooks import comm_hooks
from harness.strategies.ddp import ddp_options
from harness.strategies.knobs import KNOB_FAMILIES, draw_knobs, precisions
from harness.strategies.optim_configs import CAPTURABLE, LRS
from harness.strategies.optim_configs import optim_configs as optim_configs
from harness.strategies.placements import placements
from harness.strategies.schedules import clippings
from specs.chunking import shard_sizes
from specs.optimizers import OPTIMIZERS as MODELLED

DTENSOR_UNSUPPORTED = frozenset(
    {("SGD", "fused"), ("Adagrad", "fused")}
    | {(name, impl) for name in ("Rprop", "Adafactor") for impl in ("default", "foreach")}
)
"""``(optimizer, implementation)`` pairs whose step torch 2.13's DTensor refuses (specs
optim.fsdp.fused_sgd, optim.fsdp.fused_adagrad, optim.fsdp.rprop, optim.fsdp.adafactor):
not drawn where parameters are DTensors (``fully_shard``, TP); FSDP1's and DDP's parameters
are plain tensors."""


@takes_world_size
@st.composite
def mlp_cases(draw: st.DrawFn, world_size: int) -> MLPCase:
    """MLPs whose feature sizes are drawn around the world size (uneven and empty shards)."""
    n_layers = draw(st.integers(1, 3))
    dims = tuple(draw(st.integers(1, 2 * world_size + 1)) for _ in range(n_layers + 1))
    return MLPCase(
        dims=dims,
        bias=draw(st.booleans()),
        shard_layers=draw(st.booleans()),
        batch_per_rank=draw(st.integers(1, 3)),
        lr=draw(st.sampled_from((0.1, 0.01))),
        momentum=draw(st.sampled_from((0.0, 0.9))),
        dtype=draw(st.sampled_from(("float64", "float32"))),
        seed=draw(seeds()),
    )


def parity_cases(
    world_size: int,
    *,
    layout: str,
    unsupported: frozenset[tuple[str, str]] = frozenset(),
    mixed_precision: bool = False,
    variants: bool = False,
    knob_families: Sequence[str] = (),
    focus: str | None = None,
    premul_sum: bool = False,
    one_rank_shard: bool = False,
    optim_flags: bool = False,
    accelerator: bool = False,
    optimizers: Sequence[str] = CORE_OPTIMIZERS,
    ddp_controls: bool = False,
    group_allocation: bool = False,
) -> st.SearchStrategy[ParityCase]:
    """A training run to compare under ``layout`` with one device.

    fsdp/ddp/zero use all ranks for data parallelism; hsdp draws (replicate, shard) from the
    world size's 2-D factorisations (size-1 axes included); fsdp_tp draws (dp, tp) and
    hsdp_tp (replicate, shard, tp), tp > 1 where the world size allows, and a hidden size
    the TP degree divides (torch 2.13 fails otherwise: spec tp.mlp.uneven_hidden checks
    that separately). ``variants=True`` also draws 1 or 2 micro-batches per step
    (gradients accumulated without sync until the last, or synced after each), a
    gradient clipping (``strategies.schedules.clippings``: by the 2-, 1- or inf-norm, or
    by value) and wrapper options (DDP bucketing;
    ``fully_shard``'s ``reshard_after_forward``), and for ddp/zero the all-reduce comm hook
    and ``static_graph``, ``find_unused_parameters``,
    ``broadcast_buffers``. ``mixed_precision=True`` draws a
    ``MixedPrecisionPolicy`` per module (``strategies.knobs.precisions``).

    ``knob_families`` names the families of ``strategies.knobs.KNOB_FAMILIES`` to draw (each
    sometimes turned; ``focus`` always), for the layouts that call ``fully_shard``;
    ``premul_sum=True`` draws a divide factor only torch's PreMulSum reduction serves;
    ``one_rank_shard=True`` one on a shard group of one rank, reduced by sum then division
    (``strategies.knobs.divides_twice``).
    ``optim_flags=True`` also draws a tensor learning rate and ``capturable`` where torch
    2.13 serves them (``capturable`` off the fused kernels only if ``accelerator``);
    ``accelerator=True`` (the World is on one) leaves out the fused kernels torch has on
    the CPU only. ``optimizers`` names the ``torch.optim`` optimizers to draw.
    ``ddp_controls=True`` (ddp, zero, with ``variants``) also draws DDP's options of how it
    starts and synchronises (``strategies.ddp``) and a process group as the comm hook's
    state.
    ``group_allocation=True`` (the World's process group allocates tensors) lets the
    ``comms`` knobs draw staging buffers from the process group.
    """
    check_subset("optimizers", optimizers, OPTIMIZERS, non_empty=True)
    check_one_of("layout", layout, LAYOUTS)
    check_subset("knob_families", knob_families, KNOB_FAMILIES)
    if focus is not None:
        check_one_of("focus", focus, tuple(knob_families))
    if (knob_families or premul_sum or one_rank_shard) and layout not in FSDP_LAYOUTS:
        fail("layout", layout, f"one of {FSDP_LAYOUTS} when knobs are drawn")
    if premul_sum and one_rank_shard:
        fail("one_rank_shard", one_rank_shard, "False with premul_sum=True (shard groups of 2+)")
    _check_shard_groups(world_size, layout, premul_sum=premul_sum, one_rank_shard=one_rank_shard)
    return _parity_cases(
        world_size,
        layout=layout,
        unsupported=unsupported,
        mixed_precision=mixed_precision,
        variants=variants,
        knob_families=tuple(knob_families),
        focus=focus,
        premul_sum=premul_sum,
        one_rank_shard=one_rank_shard,
        optim_flags=optim_flags,
        accelerator=accelerator,
        optimizers=tuple(optimizers),
        ddp_controls=ddp_controls,
        group_allocation=group_allocation,
    )


@takes_world_size
@st.composite
def _parity_cases(
    draw: st.DrawFn,
    world_size: int,
    *,
    layout: str,
    unsupported: frozenset[tuple[str, str]],
    mixed_precision: bool,
    variants: bool,
    knob_families: tuple[str, ...],
    focus: str | None,
    premul_sum: bool,
    one_rank_shard: bool,
    optim_flags: bool,
    accelerator: bool,
    optimizers: tuple[str, ...],
    ddp_controls: bool,
    group_allocation: bool,
) -> ParityCase:
    shard = "many" if premul_sum else ("one" if one_rank_shard else None)
    mesh = _layout_mesh(draw, world_size, layout, shard)
    tp = mesh[-1] if layout in TP_LAYOUTS else 1
    n_layers = 2 if layout in TP_LAYOUTS else draw(st.integers(1, 3))
    dims = [draw(st.integers(1, 2 * world_size + 1)) for _ in range(n_layers + 1)]
    if layout in TP_LAYOUTS:
        dims[1] = tp * draw(st.integers(1, 3))
    float32_only = mixed_precision or premul_sum
    dtype = "float32" if float32_only else draw(sampled(("float64", "float32")))
    precision = draw(precisions(n_layers)) if mixed_precision else None
    micro_batches = draw(sampled((1, 2))) if variants else 1
    turned = Knobs()
    if knob_families or premul_sum or one_rank_shard:
        reduce_dtype = "float32" if precision else dtype
        turned, knob_micro = draw_knobs(
            draw,
            layout=layout,
            mesh=mesh,
            families=knob_families,
            focus=focus,
            reduce_dtype=reduce_dtype,
            layers=n_layers,
            premul_sum=premul_sum,
            one_rank_shard=one_rank_shard,
            group_allocation=group_allocation,
        )
        micro_batches = max(micro_batches, knob_micro)
    sync_each = micro_batches > 1 and (turned.hold_all_reduce or draw(st.booleans()))
    clipping = None
    if variants:
        clipping = draw(st.none() | clippings(_clip_norm_types(layout, mesh, tuple(dims))))
    accumulates = micro_batches > 1 and not sync_each
    wrapper_options: tuple[tuple[str, Any], ...] = ()
    if variants:
        wrapper_options = _wrapper_options(draw, layout, accumulates, ddp_controls)
    comm_hook = None
    if variants and layout in ("ddp", "zero"):
        comm_hook = draw(st.none() | comm_hooks(LOSSLESS, states=ddp_controls))
    return ParityCase(
        layout=layout,
        mesh_shape=mesh,
        dims=tuple(dims),
        bias=draw(st.booleans()),
        batch_per_rank=micro_batches * draw(st.integers(1, 3)),
        dtype=dtype,
        optim=draw(
            optim_configs(
                names=optimizers,
                unsupported=unsupported,
                flags=optim_flags,
                accelerator=accelerator,
            )
        ),
        steps=draw(st.integers(1, 5)),
        precision=precision,
        seed=draw(seeds()),
        micro_batches=micro_batches,
        sync_each_micro_batch=sync_each,
        clipping=clipping,
        wrapper_options=wrapper_options,
        comm_hook=comm_hook,
        knobs=turned,
    )


def _clip_norm_types(
    layout: str, mesh: tuple[int, ...], dims: tuple[int, ...]
) -> tuple[float, ...]:
    """The norms a clipping may measure: the inf-norm only where no rank's piece of
    a gradient is empty, which torch 2.13 cannot take the maximum of (spec
    optim.fsdp.clip_inf_norm_empty_shard checks that on its own). fully_shard splits dim 0
    (the output features) over the shard axis; TP layouts' pieces are not modelled here."""
    if layout in ("ddp", "zero"):
        return (2.0, 1.0, math.inf)
    if layout in TP_LAYOUTS:
        return (2.0, 1.0)
    shard = mesh[-1]
    if any(0 in shard_sizes(d, shard) for d in dims[1:]):
        return (2.0, 1.0)
    return (2.0, 1.0, math.inf)


def _wrapper_options(
    draw: st.DrawFn, layout: str, accumulates: bool, ddp_controls: bool
) -> tuple[tuple[str, Any], ...]:
    """DDP's (``strategies.ddp.ddp_options``) or ``fully_shard``'s."""
    if layout in ("ddp", "zero"):
        return ddp_options(draw, accumulates=accumulates, controls=ddp_controls)
    return (("reshard_after_forward", draw(st.booleans())),)


def _layout_shapes(world_size: int, layout: str) -> tuple[tuple[int, ...], ...]:
    """The meshes ``layout`` is drawn on at ``world_size``: ``(world,)`` for the 1-D
    layouts; every 2-D (3-D for hsdp_tp) factorisation, those with a TP axis of 2 or more
    where the world size has one."""
    if layout not in ("hsdp", *TP_LAYOUTS):
        return ((world_size,),)
    ndim = 3 if layout == "hsdp_tp" else 2
    shapes = [s for s in factorisations(world_size, ndim) if len(s) == ndim]
    if layout in TP_LAYOUTS:
        shapes = [s for s in shapes if s[-1] > 1] or shapes
    return tuple(shapes)


def _layout_mesh(
    draw: st.DrawFn, world_size: int, layout: str, shard: str | None = None
) -> tuple[int, ...]:
    """A mesh for ``layout``; ``shard="many"``: one whose shard axis has 2 ranks or more,
    ``"one"``: 1 rank, where the world size allows."""
    shapes = _layout_shapes(world_size, layout)
    if layout not in ("hsdp", *TP_LAYOUTS):
        return shapes[0]
    if shard is not None:
        many = shard == "many"
        shapes = tuple(s for s in shapes if (shard_size(layout, s) > 1) == many)
    return draw(sampled(shapes))


def _check_shard_groups(
    world_size: int, layout: str, *, premul_sum: bool, one_rank_shard: bool
) -> None:
    """Some mesh of ``layout`` at ``world_size`` has the shard group each flag needs."""
    check_int("world_size", world_size)
    if not (premul_sum or one_rank_shard):
        return
    sizes = [shard_size(layout, s) for s in _layout_shapes(world_size, layout)]
    where = f"{layout!r} at world size {world_size}"
    if premul_sum:
        why = f"False for {where}: no shard group of 2 or more ranks"
        require(any(n > 1 for n in sizes), "premul_sum", premul_sum, why)
    else:
        why = f"False for {where}: no shard group of one rank"
        require(1 in sizes, "one_rank_shard", one_rank_shard, why)


@takes_world_size
@st.composite
def step_cases(
    draw: st.DrawFn,
    world_size: int,
    *,
    dtensor_unsupported: frozenset[tuple[str, str]] = frozenset(),
    differentiable: bool = False,
    capturable: bool = False,
) -> StepCase:
    """1-4 float32/float64 parameters of shapes near the mesh's axis sizes, as plain tensors
    or as DTensors laid out by Shard/Replicate placements (uneven and empty shards), and any
    optimizer configuration of those ``specs.optimizers`` models (for DTensors none of the
    ``dtensor_unsupported`` pairs), sometimes ``differentiable=True`` where its step
    keeps to the model (``_may_differentiate``); some parameters have no gradient at some
    steps.
    ``differentiable=True``: DTensors always, ``differentiable=True`` steps of the default
    kernels (torch's foreach and fused kernels refuse autograd), a tensor lr sometimes.
    ``capturable=True``: ``capturable=True`` on any optimizer that takes it (modelled or
    not), default or foreach kernels (the fused ones serve it on the CPU)."""
    mesh = draw(mesh_shapes(world_size))
    count = draw(st.integers(1, 4))
    drawn = tuple(draw(shapes(max_ndim=2, near=max(mesh))) for _ in range(count))
    laid_out = None
    if differentiable or draw(st.booleans()):
        laid_out = tuple(draw(placements(len(mesh), len(s), reduce_ops=())) for s in drawn)
    unsupported = dtensor_unsupported if laid_out is not None else frozenset()
    # torch's foreach and fused kernels refuse autograd; its fused ones serve capturable on
    # the CPU (drawn by the parity properties' optim_flags)
    impls: tuple[str, ...] = ("default",) if differentiable else IMPLEMENTATIONS
    impls = ("default", "foreach") if capturable else impls
    names = _step_names(differentiable=differentiable, capturable=capturable)
    optim = draw(optim_configs(names=names, unsupported=unsupported, groups=False, impls=impls))
    if capturable:
        optim = replace(optim, options=(*optim.options, ("capturable", True)))
    if differentiable:
        optim = replace(_made_differentiable(optim), tensor_lr=draw(st.booleans()))
    elif not capturable and _may_differentiate(optim, laid_out is not None):
        optim = _made_differentiable(optim) if draw(st.booleans()) else optim
    steps = draw(st.integers(1, 4))
    pairs = [(step, index) for step in range(steps) for index in range(count)]
    # every parameter stepped: a step with no gradient to take never reaches a refusal
    whole = differentiable or capturable
    idle = () if whole else draw(st.lists(sampled(tuple(pairs)), unique=True).map(sorted))
    return StepCase(
        mesh_shape=mesh,
        shapes=drawn,
        placements=laid_out,
        dtype=draw(sampled(("float64", "float32"))),
        optim=optim,
        steps=steps,
        seed=draw(seeds()),
        differentiable=differentiable,
        idle=tuple(idle),
    )


ROUNDS_DIFFERENTIABLE = ("Adam", "AdamW", "NAdam")
"""Optimizers whose differentiable step torch 2.13 computes in float32 scalars where its
plain step takes Python floats: Adam's and AdamW's bias corrections (from the float32 step
count: 4e-6 relative off the float64 model after one step of a float64 parameter), NAdam's
two step factors (from its float32 mu_product). The differentiable property holds them to
one device instead."""


def _may_differentiate(optim: OptimConfig, dtensors: bool) -> bool:
    """Whether a step case held to the spec model may draw ``differentiable=True``: default
    kernels, not ``ROUNDS_DIFFERENTIABLE``, not Adamax on DTensors (its differentiable step
    unsqueezes in place, which torch 2.13's DTensor has no sharding strategy for)."""
    if optim.impl != "default" or optim.name in ROUNDS_DIFFERENTIABLE:
        return False
    return not (dtensors and optim.name == "Adamax")


def _made_differentiable(optim: OptimConfig) -> OptimConfig:
    """``optim`` with ``differentiable=True``, without amsgrad and centered: torch 2.13's
    differentiable Adam (exp_avg_sq) and RMSprop (grad_avg) modify a state tensor in place
    after autograd saved it (one device raises from the second step on)."""
    dropped = ("amsgrad", "centered")
    kept = tuple((k, v) for k, v in optim.options if k not in dropped)
    return replace(optim, options=(*kept, ("differentiable", True)))


def _step_names(*, differentiable: bool, capturable: bool) -> tuple[str, ...]:
    if capturable:
        return CAPTURABLE
    if not differentiable:
        return MODELLED
    # The differentiable property's reference is one device, so unmodelled ASGD too. Not
    # Adamax, whose differentiable step unsqueezes in place, which torch 2.13's DTensor has
    # no sharding strategy for (aten.unsqueeze_, Replicate too: README); not Rprop, whose
    # step torch 2.13's DTensor refuses (optim.fsdp.rprop).
    return (*(n for n in MODELLED if n != "Adamax"), "ASGD")


@takes_world_size
@st.composite
def params_cases(draw: st.DrawFn, world_size: int, *, momentum: bool = False) -> ParamsCase:
    """Parameters of small shapes (empty ones included) and an optimizer to step them;
    ``momentum=True`` draws SGD with momentum, so the optimizer holds state."""
    shapes = tuple(
        tuple(draw(st.integers(0, 5)) for _ in range(draw(st.integers(1, 2))))
        for _ in range(draw(st.integers(1, 6)))
    )
    names = ("SGD",) if momentum else CORE_OPTIMIZERS
    return ParamsCase(
        shapes=shapes,
        optim=draw(optim_configs(names=names, stateful=momentum, groups=False)),
        steps=draw(st.integers(1, 3)),
        seed=draw(seeds()),
        lr_after_load=draw(sampled((0.5, 0.05))),
        steps_after=draw(st.integers(1, 3)),
        recipient=draw(st.integers(0, world_size - 1)),
    )


@st.composite
def partition_cases(draw: st.DrawFn) -> PartitionCase:
    """1-3 groups of 1-10 parameters with 0-24 elements, sometimes a group added later."""
    sizes = st.lists(st.integers(0, 24), min_size=1, max_size=10).map(tuple)
    groups = tuple(draw(sizes) for _ in range(draw(st.integers(1, 3))))
    return PartitionCase(groups, draw(st.none() | sizes))


@takes_world_size
@st.composite
def overlap_cases(draw: st.DrawFn, world_size: int, *, shard_buckets: bool) -> OverlapCase:
    """DDP + ZeRO overlap settings; ``shard_buckets`` fixed by the caller (torch 2.13 fails
    with small parameters when it is on: spec zero.ddp_overlap.shard_buckets)."""
    dims = tuple(draw(st.integers(1, 2 * world_size + 1)) for _ in range(draw(st.integers(2, 4))))
    return OverlapCase(
        dims=dims,
        inputs=draw(st.integers(1, 4)),
        interleaved=draw(st.booleans()),
        gradient_as_bucket_view=draw(st.booleans()),
        static_graph=draw(st.booleans()),
        shard_buckets=shard_buckets,
        seed=draw(seeds()),
    )


@takes_world_size
@st.composite
def join_cases(draw: st.DrawFn, world_size: int, *, options: bool = False) -> JoinCase:
    """MLPs trained on uneven inputs (rank r has r more batches); ``options=True`` also
    draws ``join``'s options: ``enable=False`` only with even inputs (uneven ones would
    hang the ranks still training), ``throw_on_early_termination`` with uneven or even
    inputs (where it never throws)."""
    dims = tuple(draw(st.integers(1, 2 * world_size + 1)) for _ in range(draw(st.integers(2, 4))))
    case = JoinCase(
        dims=dims,
        inputs=draw(st.integers(1, 3)),
        epochs=draw(st.integers(1, 2)),
        lr=draw(sampled(LRS)),
        seed=draw(seeds()),
    )
    if not options:
        return case
    enable = draw(st.booleans())
    return replace(
        case,
        bias=draw(st.booleans()),
        uneven=enable and draw(st.booleans()),
        divide_by_initial_world_size=draw(st.booleans()),
        enable=enable,
        throw_on_early_termination=draw(st.booleans()),
    )
