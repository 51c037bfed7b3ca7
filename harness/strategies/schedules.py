"""Strategies for what a training step does around ``optimizer.step()``: lr schedules and
gradient clipping (``cases.schedules``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np
from hypothesis import strategies as st

from harness.cases.schedules import (
    CLIPS,
    LR_LAMBDAS,
    MOMENTUM_CYCLED,
    NONFINITE,
    PER_GROUP,
    REPEATS_ITS_CHANGE,
    RESUMABLE,
    SCHEDULED_OPTIMIZERS,
    SCHEDULERS,
    TENSOR_LR,
    ClipCase,
    Clipping,
    Schedule,
    ScheduleCase,
    changes_lr_at,
)
from harness.cases.training import OPTIMIZERS
from harness.errors import check_int, check_one_of, check_subset
from harness.strategies._common import mesh_shapes, sampled, seeds, shapes, takes_world_size
from harness.strategies.placements import placements
from specs.placements import Placement, local_arrays

Options = tuple[tuple[str, Any], ...]
NORM_TYPES = (2.0, 1.0, math.inf)


def schedules(optimizer: str, *, steps: int = 5) -> st.SearchStrategy[Schedule]:
    """A scheduler of ``cases.schedules.SCHEDULERS`` for ``optimizer`` (``OneCycleLR``
    cycles its momentum only where it has one) that can be stepped ``steps`` times."""
    check_one_of("optimizer", optimizer, OPTIMIZERS)
    check_int("steps", steps)
    return _schedules(optimizer in MOMENTUM_CYCLED, steps)


@cache
def _schedules(has_momentum: bool, steps: int) -> st.SearchStrategy[Schedule]:
    simple = _simple()
    return st.one_of(
        simple,
        st.builds(_sequential, st.lists(simple, min_size=2, max_size=2), sampled((1, 2))),
        _one_cycle(has_momentum, steps),
        _plateau(),
    )


def _schedule(name: str, **options: st.SearchStrategy[Any]) -> st.SearchStrategy[Schedule]:
    return st.fixed_dictionaries(options).map(
        lambda drawn: Schedule(name, tuple(sorted(drawn.items())))
    )


def _simple() -> st.SearchStrategy[Schedule]:
    """The schedulers that take nothing but the optimizer and their own numbers."""
    return st.one_of(*_simple_by_name().values())


@cache
def _simple_by_name() -> dict[str, st.SearchStrategy[Schedule]]:
    gamma = sampled((0.5, 0.9))
    milestones = st.lists(sampled((1, 2, 3)), min_size=1, max_size=3, unique=True)
    return {
        "StepLR": _schedule("StepLR", step_size=sampled((1, 2)), gamma=gamma),
        "MultiStepLR": _schedule(
            "MultiStepLR", milestones=milestones.map(sorted).map(tuple), gamma=gamma
        ),
        "ConstantLR": _schedule(
            "ConstantLR", factor=sampled((0.5, 0.25)), total_iters=sampled((1, 3))
        ),
        "LinearLR": _schedule(
            "LinearLR",
            start_factor=sampled((0.25, 1.0)),
            end_factor=sampled((1.0, 0.5)),
            total_iters=sampled((2, 4)),
        ),
        "ExponentialLR": _schedule("ExponentialLR", gamma=gamma),
        "CosineAnnealingLR": _schedule(
            "CosineAnnealingLR", T_max=sampled((2, 5)), eta_min=sampled((0.0, 0.001))
        ),
        "LambdaLR": _schedule("LambdaLR", lr_lambda=sampled(LR_LAMBDAS)),
    }


def _sequential(parts: list[Schedule], milestone: int) -> Schedule:
    return Schedule("SequentialLR", (("milestones", (milestone,)),), tuple(parts))


def _one_cycle(has_momentum: bool, steps: int) -> st.SearchStrategy[Schedule]:
    """``OneCycleLR`` over more than ``steps`` steps and never under 5: given as
    ``total_steps`` or as epochs × steps per epoch. (torch 2.13 goes on past the cycle's last
    step to a negative lr; over fewer steps a phase may span none, and it divides by the
    phase's length: ZeroDivisionError.)"""
    shortest = max(steps + 1, 5)
    length = st.one_of(
        st.fixed_dictionaries({"total_steps": sampled((shortest, shortest + 3))}),
        st.fixed_dictionaries(
            {"epochs": st.just(2), "steps_per_epoch": sampled((shortest // 2 + 1, shortest))}
        ),
    )
    momenta = sampled(((0.85, 0.95), (0.8, 0.9)))
    options = st.fixed_dictionaries(
        {
            "max_lr": sampled((0.1, 0.05)),
            "pct_start": sampled((0.3, 0.5)),
            "anneal_strategy": sampled(("cos", "linear")),
            "cycle_momentum": st.booleans() if has_momentum else st.just(False),
            "momenta": momenta,
            "div_factor": sampled((25.0, 4.0)),
            "final_div_factor": sampled((1e4, 10.0)),
            "three_phase": st.booleans(),
        }
    )
    return st.builds(_one_cycle_of, length, options)


def _one_cycle_of(length: dict[str, int], options: dict[str, Any]) -> Schedule:
    base, top = options.pop("momenta")
    drawn = {**length, **options, "base_momentum": base, "max_momentum": top}
    return Schedule("OneCycleLR", tuple(sorted(drawn.items())))


def _plateau() -> st.SearchStrategy[Schedule]:
    return _schedule(
        "ReduceLROnPlateau",
        mode=sampled(("min", "max")),
        factor=sampled((0.5, 0.1)),
        patience=sampled((0, 1)),
        threshold=sampled((1e-4, 0.1)),
        threshold_mode=sampled(("rel", "abs")),
        cooldown=sampled((0, 1)),
        min_lr=sampled((0.0, 0.01)),
        eps=sampled((1e-8, 1e-3)),
    )


def clippings(
    norm_types: Sequence[float] = NORM_TYPES, *, by_value: bool = True
) -> st.SearchStrategy[Clipping]:
    """Gradient clipping by ``clip_grad_norm_``, by ``get_total_norm`` then
    ``clip_grads_with_norm_``, of a norm of ``norm_types``, or (``by_value``) by
    ``clip_grad_value_``; ``foreach`` unset, on or off; ``error_if_nonfinite`` either way
    (the gradients are finite: it only adds the check)."""
    check_subset("norm_types", norm_types, NORM_TYPES, non_empty=True)
    return _clippings(tuple(norm_types), by_value)


@cache
def _clippings(norm_types: tuple[float, ...], by_value: bool) -> st.SearchStrategy[Clipping]:
    foreach = sampled((None, True, False))
    by_norm = st.builds(
        Clipping,
        how=sampled(tuple(how for how in CLIPS if how != "value")),
        bound=sampled((1.0, 0.05)),
        norm_type=sampled(norm_types),
        foreach=foreach,
        error_if_nonfinite=st.booleans(),
    )
    if not by_value:
        return by_norm
    value = st.builds(Clipping, how=st.just("value"), bound=sampled((0.1, 0.01)), foreach=foreach)
    return by_norm | value


@takes_world_size
@st.composite
def clip_cases(draw: st.DrawFn, world_size: int) -> ClipCase:
    """1-4 gradients of shapes near the mesh's axis sizes, as plain tensors or as DTensors
    laid out by Shard/Replicate placements (uneven and empty shards), scaled so that the
    total norm falls on either side of the bound, clipped by any drawn clipping; sometimes
    with inf or nan at one element (wherever it lands: on one rank's shard only, or
    replicated). Never the inf-norm where a gradient or a rank's piece of it is empty:
    torch 2.13's foreach inf-norm refuses an empty tensor (spec
    optim.fsdp.clip_inf_norm_empty_shard checks that path)."""
    mesh = draw(mesh_shapes(world_size))
    count = draw(st.integers(1, 4))
    drawn = tuple(draw(shapes(max_ndim=2, near=max(mesh))) for _ in range(count))
    laid_out = None
    if draw(st.booleans()):
        laid_out = tuple(draw(placements(len(mesh), len(s), reduce_ops=())) for s in drawn)
    elements = [(i, flat) for i, shape in enumerate(drawn) for flat in range(math.prod(shape))]
    nonfinite = draw(st.none() | sampled(NONFINITE)) if elements else None
    clipping = draw(clippings())
    if clipping.norm_type == math.inf and _has_empty_piece(mesh, drawn, laid_out):
        clipping = dataclasses.replace(clipping, norm_type=2.0)
    return ClipCase(
        mesh_shape=mesh,
        shapes=drawn,
        placements=laid_out,
        dtype=draw(sampled(("float64", "float32"))),
        seed=draw(seeds()),
        clipping=clipping,
        scale=draw(sampled((1.0, 0.01))),
        nonfinite=nonfinite,
        at=draw(sampled(tuple(elements))) if nonfinite else (0, 0),
    )


def _has_empty_piece(
    mesh: tuple[int, ...],
    drawn: tuple[tuple[int, ...], ...],
    laid_out: tuple[tuple[Placement, ...], ...] | None,
) -> bool:
    if laid_out is None:
        return any(math.prod(shape) == 0 for shape in drawn)
    return any(
        piece.size == 0
        for shape, layout in zip(drawn, laid_out, strict=True)
        for piece in local_arrays(np.zeros(shape), mesh, layout).values()
    )


SCHEDULE_LRS = (0.1, 0.05, 0.02, 0.01)
"""The groups' initial lrs a schedule case draws (distinct within a case)."""
PLATEAU_METRICS = (1.0, 0.99995, 0.95, 0.5, 1.2)
"""The metrics ``ReduceLROnPlateau`` is stepped with: the same again, better or worse by
less than a relative threshold of 1e-4, by less than an absolute one of 0.1, or by more."""
_GROUP_VALUES: dict[str, tuple[Any, ...]] = {
    "max_lr": (0.1, 0.05, 0.2),
    "base_momentum": (0.85, 0.8),
    "max_momentum": (0.95, 0.9),
    "min_lr": (0.0, 0.01, 0.001),
    "lr_lambda": LR_LAMBDAS,
}


@takes_world_size
@st.composite
def schedule_cases(draw: st.DrawFn, world_size: int) -> ScheduleCase:
    """2-3 parameter groups of distinct initial lrs (float lrs, or 0-d tensors for the
    optimizers documented to take one) over 1-4 parameters of shapes near the mesh's axis
    sizes, plain or DTensors laid out by Shard/Replicate placements; 1-4 optimizers of one
    kind over them, each with a scheduler of ``cases.schedules.SCHEDULERS`` (``OneCycleLR``
    cycling the momentum only where the optimizer has one), stepped 1-8 times. Per-group
    options (``PER_GROUP``) are sometimes one value per group. A third of the schedulers are
    ``SequentialLR``s of 2-3 simple schedulers, milestones anywhere from 0 (its first
    scheduler never runs, an edge torch got wrong: pytorch/pytorch#185872) to past the last
    step, twice the same sometimes. ``ReduceLROnPlateau`` gets a metric a step
    (``PLATEAU_METRICS``)."""
    mesh = draw(mesh_shapes(world_size))
    # one group is the same arithmetic on one row, which the parity properties step often
    groups = draw(st.integers(2, 3))
    lrs = draw(st.lists(sampled(SCHEDULE_LRS), min_size=groups, max_size=groups, unique=True))
    count = draw(st.integers(groups, 4))
    drawn = tuple(draw(shapes(max_ndim=2, near=max(mesh))) for _ in range(count))
    laid_out = None
    if draw(st.booleans()):
        laid_out = tuple(draw(placements(len(mesh), len(s), reduce_ops=())) for s in drawn)
    optimizer = draw(sampled(SCHEDULED_OPTIMIZERS))
    steps = draw(st.integers(1, 8))
    each = _case_schedules(optimizer in MOMENTUM_CYCLED, steps, groups)
    scheduled = tuple(draw(st.lists(each, min_size=1, max_size=4)))
    metrics: tuple[float, ...] = ()
    if any(schedule.name == "ReduceLROnPlateau" for schedule in scheduled):
        metrics = tuple(draw(st.lists(sampled(PLATEAU_METRICS), min_size=steps, max_size=steps)))
    return ScheduleCase(
        mesh_shape=mesh,
        shapes=drawn,
        placements=laid_out,
        dtype=draw(sampled(("float64", "float32"))),
        seed=draw(seeds()),
        optimizer=optimizer,
        lrs=tuple(lrs),
        schedules=scheduled,
        steps=steps,
        metrics=metrics,
        tensor_lr=optimizer in TENSOR_LR and draw(st.booleans()),
    )


@st.composite
def _case_schedules(draw: st.DrawFn, has_momentum: bool, steps: int, groups: int) -> Schedule:
    """A ``SequentialLR`` a third of the time (it runs the simple schedulers in turn, each
    from its own step 0, so it exercises them too), else any other scheduler, each alike:
    drawn by name, since ``st.one_of`` favours some of its branches."""
    if draw(sampled((False, True, False))):
        return draw(_sequentials(steps, groups))
    name = draw(sampled(tuple(name for name in SCHEDULERS if name != "SequentialLR")))
    return draw(_by_name(has_momentum, steps, groups)[name])


@cache
def _by_name(has_momentum: bool, steps: int, groups: int) -> dict[str, st.SearchStrategy[Schedule]]:
    return {
        **{name: _per_group(simple, groups) for name, simple in _simple_by_name().items()},
        "OneCycleLR": _per_group(_one_cycle(has_momentum, steps), groups),
        "ReduceLROnPlateau": _per_group(_plateau(), groups),
    }


@st.composite
def _per_group(draw: st.DrawFn, schedules: st.SearchStrategy[Schedule], groups: int) -> Schedule:
    """A schedule of ``schedules`` whose per-group options are sometimes one value a group."""
    schedule = draw(schedules)
    options = dict(schedule.options)
    for name in PER_GROUP.get(schedule.name, ()):
        if groups > 1 and draw(st.booleans()):
            options[name] = tuple(draw(sampled(_GROUP_VALUES[name])) for _ in range(groups))
    return dataclasses.replace(schedule, options=tuple(sorted(options.items())))


@st.composite
def _sequentials(draw: st.DrawFn, steps: int, groups: int) -> Schedule:
    """2-3 simple schedulers (each alike, by name), milestones from 0 to past the last step."""
    simple = _by_name(False, steps, groups)
    names = tuple(_simple_by_name())
    parts = [draw(simple[draw(sampled(names))]) for _ in range(draw(st.integers(2, 3)))]
    milestone = st.just(0) | st.integers(0, steps + 1)
    milestones = sorted(draw(milestone) for _ in range(len(parts) - 1))
    return Schedule("SequentialLR", (("milestones", tuple(milestones)),), tuple(parts))


@takes_world_size
@st.composite
def resumed_schedule_cases(
    draw: st.DrawFn, world_size: int, *, at_a_change: bool = False
) -> ScheduleCase:
    """A ``schedule_cases`` case of 1-3 schedulers resumed after a drawn step
    (``ScheduleCase.resume_after``): any scheduler but ``ReduceLROnPlateau`` (no
    ``last_epoch``) and ``SequentialLR`` (``resumed_sequential_cases``), none changing the lr
    at the resumed epoch where torch 2.13 changes it twice (``changes_lr_at``: such a
    scheduler's option is moved off that epoch). ``at_a_change``: one ``StepLR``,
    ``MultiStepLR`` or ``ConstantLR`` resumed exactly where it changes the lr."""
    base = draw(schedule_cases(world_size))
    steps = max(base.steps, 4 if at_a_change else 2)
    by_name = _by_name(base.optimizer in MOMENTUM_CYCLED, steps, len(base.lrs))
    if at_a_change:
        schedule = draw(by_name[draw(sampled(REPEATS_ITS_CHANGE))])
        changes = tuple(epoch for epoch in range(1, steps) if changes_lr_at(schedule, epoch))
        return dataclasses.replace(
            base,
            schedules=(schedule,),
            steps=steps,
            metrics=(),
            resume_after=draw(sampled(changes)),
        )
    after = draw(st.integers(1, steps - 1))
    names = tuple(name for name in RESUMABLE if name != "SequentialLR")
    count = draw(st.integers(1, 3))
    scheduled = tuple(_off(draw(by_name[draw(sampled(names))]), after) for _ in range(count))
    return dataclasses.replace(
        base, schedules=scheduled, steps=steps, metrics=(), resume_after=after
    )


def _off(schedule: Schedule, epoch: int) -> Schedule:
    """``schedule`` with the option that makes it change the lr at ``epoch`` moved past it."""
    if not changes_lr_at(schedule, epoch):
        return schedule
    options = dict(schedule.options)
    if schedule.name == "StepLR":
        options["step_size"] = epoch + 1
    elif schedule.name == "MultiStepLR":
        kept = tuple(m for m in options["milestones"] if m != epoch)
        options["milestones"] = kept or (epoch + 1,)
    else:
        options["total_iters"] = epoch + 1
    return dataclasses.replace(schedule, options=tuple(sorted(options.items())))


@takes_world_size
@st.composite
def resumed_sequential_cases(draw: st.DrawFn, world_size: int) -> ScheduleCase:
    """A ``SequentialLR`` of two schedulers that change the lr every step (``StepLR`` of
    step 1 or ``ExponentialLR``, then ``ExponentialLR``), resumed after a step past its
    milestone: the path pytorch/pytorch#162591 reports."""
    base = draw(schedule_cases(world_size))
    steps = max(base.steps, 3)
    gamma = sampled((0.5, 0.9))
    first = st.one_of(
        _schedule("StepLR", step_size=st.just(1), gamma=gamma),
        _schedule("ExponentialLR", gamma=gamma),
    )
    milestone = draw(st.integers(1, steps - 2))
    sequential = _sequential(
        [draw(first), draw(_schedule("ExponentialLR", gamma=gamma))], milestone
    )
    after = draw(st.integers(milestone + 1, steps - 1))
    return dataclasses.replace(
        base, schedules=(sequential,), steps=steps, metrics=(), resume_after=after
    )
