"""Strategies of the ZeroRedundancyOptimizer suite's own cases: parameter groups with frozen
parameters, and DDP overlap models whose buckets ``shard_buckets=True`` can place."""

from __future__ import annotations

from hypothesis import assume
from hypothesis import strategies as st

from harness.cases.training import OverlapCase
from harness.cases.zero import FrozenGroupsCase
from harness.errors import check_int, require
from harness.strategies._common import mix, sampled, seeds, takes_world_size
from harness.strategies.training import optim_configs
from specs.zero_overlap import fits

_FROZEN = mix((2, st.just(False)), (1, st.just(True)))
_LATE_FUSED_SGD = frozenset({("SGD", "fused")})


def _with_tail(
    mask: tuple[tuple[bool, ...], ...], flags: tuple[bool, ...]
) -> tuple[tuple[bool, ...], ...]:
    """``mask`` with the last flags of its first group replaced by ``flags``."""
    first, *rest = mask
    return ((*first[: -len(flags)], *flags), *rest)


def _late_first_group(draw: st.DrawFn, world_size: int) -> tuple[tuple[int, ...], ...]:
    """A first group whose last two parameters (2 and 1 elements) ZeroRedundancyOptimizer
    gives to one rank: ``world_size - 1`` larger ones come first and take a rank each
    (its greedy partition hands the largest parameter to the least loaded rank), so the
    smallest parameter joins the 2-element one on the last rank."""
    larger = tuple((draw(st.integers(3, 2 * world_size + 3)),) for _ in range(world_size - 1))
    return (*larger, (2,), (1,))


def _shape(draw: st.DrawFn, world_size: int) -> tuple[int, ...]:
    return tuple(draw(st.integers(1, 2 * world_size + 1)) for _ in range(draw(st.integers(1, 2))))


def _mask(
    draw: st.DrawFn, groups: tuple[tuple[tuple[int, ...], ...], ...]
) -> tuple[tuple[bool, ...], ...]:
    return tuple(tuple(draw(_FROZEN) for _ in group) for group in groups)


def frozen_groups_cases(
    world_size: int, *, late_fused_sgd: bool = False
) -> st.SearchStrategy[FrozenGroupsCase]:
    """1-3 groups of 1-4 parameters (sizes around ``world_size``, so some ranks own none),
    about a third frozen, sometimes another third from a drawn step on.

    Fused SGD with momentum is not drawn where a parameter is unfrozen after the first step:
    torch 2.13 and 2.15 raise there, on one device too (spec
    zero.param_groups.late_first_grad_fused_sgd). ``late_fused_sgd``: only that path, fused
    SGD with momentum, a parameter of the first group frozen until a step after the first,
    and on its rank another of its group that trains from the first step."""
    check_int("world_size", world_size)
    require(isinstance(late_fused_sgd, bool), "late_fused_sgd", late_fused_sgd, "a bool")
    return _frozen_groups_cases(world_size, late_only=late_fused_sgd)


@takes_world_size
@st.composite
def _frozen_groups_cases(draw: st.DrawFn, world_size: int, *, late_only: bool) -> FrozenGroupsCase:
    groups = tuple(
        tuple(_shape(draw, world_size) for _ in range(draw(st.integers(1, 4))))
        for _ in range(draw(st.integers(1, 3)))
    )
    if late_only:
        groups = (_late_first_group(draw, world_size), *groups[1:])
    steps = draw(st.integers(2 if late_only else 1, 3))
    frozen = _mask(draw, groups)
    refrozen = _mask(draw, groups) if late_only or draw(st.booleans()) else None
    switch = draw(st.integers(1 if late_only else 0, steps - 1))
    if late_only:
        # the 2-element parameter trains from the first step (its momentum buffer made
        # then), the 1-element one, on the same rank, from step ``switch`` on
        assert refrozen is not None
        frozen, refrozen = _with_tail(frozen, (False, True)), _with_tail(refrozen, (False, False))
        optim = draw(optim_configs(names=("SGD",), impls=("fused",), stateful=True, groups=False))
    else:
        late = refrozen is not None and switch > 0
        unsupported = _LATE_FUSED_SGD if late else frozenset()
        optim = draw(optim_configs(groups=False, unsupported=unsupported))
    return FrozenGroupsCase(
        groups=groups,
        frozen=frozen,
        refrozen=refrozen,
        switch=switch,
        optim=optim,
        lr_scales=tuple(draw(sampled((1.0, 0.5, 2.0))) for _ in groups),
        steps=steps,
        bucket_view=draw(st.booleans()),
        seed=draw(seeds()),
    )


_SMALL = st.integers(1, 9)
_MEDIUM = st.integers(10, 128)


def fitting_overlap_cases(world_size: int) -> st.SearchStrategy[OverlapCase]:
    """DDP + ZeRO overlap with ``shard_buckets=True`` on a Linear stack (float64) whose DDP
    buckets ZeRO can cut into at most ``world_size`` pieces each (``specs.zero_overlap``),
    as upstream's Linear(1000, 2000), Linear(2000, 500) on 2-4 ranks: mostly widths of 10 to
    128 (weights large beside the biases). ``world_size`` >= 2: on one rank the threshold
    is the whole model, and the last parameter of any bucket of two always reaches it."""
    check_int("world_size", world_size, 2)
    return _fitting_overlap_cases(world_size)


@takes_world_size
@st.composite
def _fitting_overlap_cases(draw: st.DrawFn, world_size: int) -> OverlapCase:
    width = mix((3, _MEDIUM), (1, _SMALL))
    dims = tuple(draw(width) for _ in range(draw(st.integers(2, 4))))
    bias = draw(st.booleans())
    assume(fits(dims, bias, 8, world_size))
    return OverlapCase(
        dims=dims,
        inputs=draw(st.integers(1, 4)),
        interleaved=draw(st.booleans()),
        gradient_as_bucket_view=draw(st.booleans()),
        static_graph=draw(st.booleans()),
        shard_buckets=True,
        seed=draw(seeds()),
        bias=bias,
        dtype="float64",
    )
