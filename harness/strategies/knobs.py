"""Strategies for the FSDP2 controls real training turns (``harness.cases.training.Knobs``)
and ``MixedPrecisionPolicy`` per module (``Precision``), valid by construction for a layout,
its mesh and its model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hypothesis import strategies as st

from harness.cases.knobs import FORWARD_METHODS, PRECISION_DTYPES, Knobs, Precision
from harness.cases.training import FSDP_LAYOUTS, data_parallel, shard_size
from harness.errors import check_one_of, check_subset
from harness.strategies._common import factorisations, reshard_factors, sampled
from harness.strategies.checkpointing import checkpointings

KNOB_FAMILIES = ("divide_factor", "micro_batching", "resharding", "checkpoint", "comms")
"""``divide_factor``: a gradient divide factor, sum-only collectives, HSDP's mesh flattened
for fsdp; ``micro_batching``: 2-3 micro-batches with all-reduce, resharding and the last
backward held or marked; ``resharding``: reshard to a smaller group, explicit unshard and
prefetch plans (neighbours, or any other layers); ``checkpoint``: activation checkpointing
of some Linears, through any of torch's APIs (``strategies.checkpointing``); ``comms``:
reduce-scatter of unused parameters, a separate reduce-scatter group, custom collectives
forwarding to torch's, or staging buffers from the process group."""


def uses_premul_sum(knobs: Knobs, layout: str, mesh: tuple[int, ...], reduce_dtype: str) -> bool:
    """Whether torch 2.13's ``fully_shard`` reduce-scatters these gradients with NCCL's
    PreMulSum: a float32/bfloat16 reduction, a divide factor other than the shard group's
    size, sums not forced (``_fsdp_collectives._get_gradient_divide_factors``)."""
    factor = knobs.divide_factor
    size = shard_size(layout, mesh)
    return (
        factor is not None
        and size > 1
        and reduce_dtype in ("float32", "bfloat16")
        and not knobs.force_sum_reduction
        and factor != size
    )


def divides_twice(knobs: Knobs, layout: str, mesh: tuple[int, ...], reduce_dtype: str) -> bool:
    """Whether torch 2.13's ``fully_shard`` divides these gradients by the factor twice: a
    shard group of one rank (``foreach_reduce`` divides while it copies instead of
    reduce-scattering) and a reduction that sums then divides again (sums forced, or a
    reduce dtype other than float32/bfloat16). Spec optim.knobs.divide_factor_one_rank_shard
    checks that path on its own."""
    factor = knobs.divide_factor
    sums = knobs.force_sum_reduction or reduce_dtype not in ("float32", "bfloat16")
    return factor not in (None, 1.0) and shard_size(layout, mesh) == 1 and sums


def draw_knobs(
    draw: st.DrawFn,
    *,
    layout: str,
    mesh: tuple[int, ...],
    families: Sequence[str],
    focus: str | None,
    reduce_dtype: str,
    layers: int,
    premul_sum: bool = False,
    one_rank_shard: bool = False,
    group_allocation: bool = False,
) -> tuple[Knobs, int]:
    """Knobs of ``families`` for ``layout`` on ``mesh``, each family sometimes turned and
    ``focus`` always; and the micro-batches per step (1 unless micro-batching is turned).

    A divide factor is drawn with sum-only collectives where it would otherwise need
    PreMulSum (``uses_premul_sum``), unless ``premul_sum``, which draws exactly that path;
    and never where it ``divides_twice``, unless ``one_rank_shard``, which draws exactly
    that path (on a mesh whose shard group has one rank). Staging buffers from the process
    group only with ``group_allocation`` (the World's group can allocate them)."""
    check_subset("families", families, KNOB_FAMILIES)
    check_one_of("layout", layout, FSDP_LAYOUTS)
    if focus is not None:
        check_one_of("focus", focus, tuple(families))
    turned = {f for f in families if f == focus or draw(st.booleans())}
    chosen = Knobs()
    if one_rank_shard:
        chosen = _divided_twice(draw, layout, mesh, reduce_dtype)
    elif "divide_factor" in turned or premul_sum:
        chosen = _divide_factor(draw, chosen, layout, mesh, reduce_dtype, premul_sum)
    micro_batches = 1
    if "micro_batching" in turned:
        chosen, micro_batches = _micro_batching(draw, chosen, layout)
    if "resharding" in turned:
        chosen = _resharding(draw, chosen, layout, mesh, layers, focused=focus == "resharding")
    if "checkpoint" in turned:
        chosen = chosen.with_checkpoint(draw(checkpointings(layers)))
    if "comms" in turned:
        chosen = _comms(draw, chosen, focused=focus == "comms", group_allocation=group_allocation)
    method = draw(st.none() | sampled(FORWARD_METHODS))
    return replace(chosen, keyword_input=draw(st.booleans()), forward_method=method), micro_batches


def _divide_factor(
    draw: st.DrawFn,
    chosen: Knobs,
    layout: str,
    mesh: tuple[int, ...],
    reduce_dtype: str,
    premul_sum: bool,
) -> Knobs:
    dp, size = data_parallel(layout, mesh), shard_size(layout, mesh)
    factors: tuple[float, ...] = (float(dp), float(size), 2.0 * dp, dp / 2, 1.0, 3.0)
    if premul_sum:
        factors = tuple(f for f in factors if f != size) or (size + 1.0,)
    chosen = replace(
        chosen,
        divide_factor=draw(sampled(factors)),
        deprecated_spelling=draw(st.booleans()),
        force_sum_reduction=draw(sampled((None, False) if premul_sum else (None, False, True))),
    )
    if not premul_sum and uses_premul_sum(chosen, layout, mesh, reduce_dtype):
        chosen = replace(chosen, force_sum_reduction=True)
    if divides_twice(chosen, layout, mesh, reduce_dtype):
        chosen = replace(chosen, force_sum_reduction=False)
    if divides_twice(chosen, layout, mesh, reduce_dtype):
        chosen = replace(chosen, divide_factor=None, deprecated_spelling=False)
    if layout == "fsdp" and mesh[0] > 1 and draw(st.booleans()):
        pairs = [s for s in factorisations(mesh[0], 2) if len(s) == 2]
        a, b = draw(sampled(tuple(pairs)))
        chosen = replace(chosen, flatten=(a, b))
    return chosen


def _divided_twice(draw: st.DrawFn, layout: str, mesh: tuple[int, ...], reduce_dtype: str) -> Knobs:
    dp = data_parallel(layout, mesh)
    chosen = Knobs(
        divide_factor=draw(sampled(tuple({2.0 * dp, dp / 2, 3.0} - {1.0}))),
        force_sum_reduction=reduce_dtype in ("float32", "bfloat16") or draw(st.booleans()),
    )
    assert divides_twice(chosen, layout, mesh, reduce_dtype), (chosen, layout, mesh)
    return chosen


def _micro_batching(draw: st.DrawFn, chosen: Knobs, layout: str) -> tuple[Knobs, int]:
    """Held all-reduces only where there is one (HSDP); the caller syncs every micro-batch
    when they are held (``set_requires_gradient_sync(False)`` would skip the reduction that
    ``set_requires_all_reduce`` controls)."""
    hsdp = layout in ("hsdp", "hsdp_tp")
    chosen = replace(
        chosen,
        # the held all-reduce is the family's HSDP-only path: three draws in four there
        hold_all_reduce=hsdp and draw(st.integers(0, 3)) > 0,
        hold_reshard=draw(st.booleans()),
        mark_last_backward=draw(st.booleans()),
        # recurse=False holds the root's own group only, so the Linears are never held: one
        # draw in four, the held paths staying the common case (mutate: at one in two, ci
        # lost hsdp.partial_reduce_added_after_all_reduce)
        recurse=draw(st.integers(0, 3)) > 0,
    )
    return chosen, draw(st.integers(2, 3))


def _resharding(
    draw: st.DrawFn,
    chosen: Knobs,
    layout: str,
    mesh: tuple[int, ...],
    layers: int,
    *,
    focused: bool,
) -> Knobs:
    """``focused``: at least one control turned (explicit unshard when none was drawn)."""
    smaller = reshard_factors(shard_size(layout, mesh))
    first_layer = draw(sampled((None, "stays_sharded", "unshards")))
    chosen = replace(
        chosen,
        reshard_to=draw(st.none() | sampled(smaller)) if smaller else None,
        explicit_unshard=draw(st.booleans()),
        unshard_async=draw(st.booleans()),
        forward_prefetch=draw(_prefetch_plans(layers, forward=True)),
        backward_prefetch=draw(_prefetch_plans(layers, forward=False)),
        reset_reshard_after_forward=draw(st.none() | st.tuples(st.booleans(), st.booleans())),
        first_layer_stays_sharded=first_layer == "stays_sharded",
        first_layer_unshards=first_layer == "unshards",
    )
    controls = (
        *(chosen.reshard_to, chosen.explicit_unshard, *chosen.forward_prefetch),
        *(chosen.reset_reshard_after_forward, chosen.first_layer_stays_sharded),
        chosen.first_layer_unshards,
    )
    if focused and not any(controls) and not any(chosen.backward_prefetch):
        chosen = replace(chosen, explicit_unshard=True)
    return chosen


def _comms(draw: st.DrawFn, chosen: Knobs, *, focused: bool, group_allocation: bool) -> Knobs:
    """Each control sometimes; custom collectives or process-group buffers, never both
    (torch refuses the pair), the latter turned on only with ``group_allocation`` (off:
    FSDP's default buffers, said explicitly). ``focused``: at least one control set."""
    pairs = st.none() | st.tuples(st.booleans(), st.booleans())
    custom = draw(st.booleans())
    zeroed = st.none() | st.booleans()
    chosen = replace(
        chosen,
        reduce_scatter_unused=draw(pairs),
        separate_reduce_scatter=draw(pairs),
        custom_all_gather=draw(zeroed) if custom else None,
        custom_reduce_scatter=draw(zeroed) if custom else None,
        group_allocates=None
        if custom
        else draw(sampled((None, False, *(True,) * group_allocation))),
    )
    controls = (
        *(chosen.reduce_scatter_unused, chosen.separate_reduce_scatter),
        *(chosen.custom_all_gather, chosen.custom_reduce_scatter, chosen.group_allocates),
    )
    if focused and all(control is None for control in controls):
        chosen = replace(chosen, reduce_scatter_unused=(True, True))
    return chosen


@st.composite
def _prefetch_plans(draw: st.DrawFn, layers: int, *, forward: bool) -> tuple[tuple[int, ...], ...]:
    """None, each Linear's next (forward) or previous (backward) 1-2 Linears, as torch's docs
    show, or any 0-2 other Linears each: a mistargeted prefetch must not change numbers."""
    kind = draw(sampled(("none", "neighbours", "any")))
    if kind == "none" or layers < 2:
        return ()
    if kind == "neighbours":
        count = draw(st.integers(1, 2))
        if forward:
            return tuple(tuple(range(i + 1, min(layers, i + 1 + count))) for i in range(layers))
        return tuple(tuple(range(i - 1, max(-1, i - 1 - count), -1)) for i in range(layers))
    others = [tuple(j for j in range(layers) if j != i) for i in range(layers)]
    return tuple(tuple(draw(st.lists(sampled(o), max_size=2, unique=True))) for o in others)


@st.composite
def precisions(draw: st.DrawFn, layers: int) -> Precision:
    """A policy per Linear (bfloat16 or float32 compute), the root's (casting the inputs to
    bfloat16, or nothing, or bfloat16 with ``cast_forward_inputs=False``: the inputs then
    reach the first Linear in their own dtype), float32 reduction, sometimes a float32 or
    bfloat16 output."""
    return Precision(
        layer_dtypes=tuple(draw(sampled(PRECISION_DTYPES)) for _ in range(layers)),
        root_dtype=draw(sampled((None, "bfloat16"))),
        output_dtype=draw(sampled((None, *PRECISION_DTYPES))),
        # the root's cast of the inputs is the policy's common path: cast_forward_inputs=False
        # one draw in four (at one in two, ci's draws lost fsdp.forward_kwargs_not_cast)
        root_casts_inputs=draw(st.integers(0, 3)) > 0,
    )
