"""Strategies of the checkpoint properties (``cases.checkpoints``): the options of a DCP save
and load, async saves, DCP state dicts holding schedulers and user ``Stateful`` objects."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hypothesis import strategies as st

from harness.cases.checkpoints import (
    ASYNC_FAILURES,
    REWRITES,
    STAGING_OPTIONS,
    AsyncCase,
    AsyncFailureCase,
    CheckpointOptions,
    OptionsCase,
    StatefulCase,
)
from harness.cases.state_dict import ReshardCase, StateDictCase
from harness.errors import check_int, check_one_of
from harness.strategies._common import sampled, takes_world_size
from harness.strategies.schedules import schedules
from harness.strategies.state_dict import reshard_cases, state_dict_cases

_TRUE_FIRST = sampled((True, False))
"""A bool whose simplest value (hypothesis' first example, where it shrinks to) is True."""


def _flags(
    draw: st.DrawFn, names: Sequence[str], *, first: bool = False
) -> tuple[tuple[str, Any], ...]:
    """Each of ``names`` drawn True or False (True the simplest where ``first``); only those
    drawn away from False are kept (the others left to torch's default, which is False for
    every one of them)."""
    flag = _TRUE_FIRST if first else st.booleans()
    return tuple((name, True) for name in names if draw(flag))


@st.composite
def checkpoint_options(
    draw: st.DrawFn,
    *,
    broadcast: bool = True,
    plan_caching: bool = True,
    flattened_full_load: bool = False,
) -> CheckpointOptions:
    """Planner, writer and state-dict options of a save and a load, valid by construction.

    ``flatten_state_dict`` stays True: our state dict nests the model's and the optimizer's,
    and a nested dict unflattened is the subject of state_dict.checkpoint.unflattened_nested.
    ``dedup_replicated_tensors`` is not drawn: torch 2.13 ignores it with a deprecation
    warning. ``broadcast``: draw ``broadcast_from_rank0`` on the loading side (the thread
    runner's group has no device types, which its broadcast reads); ``plan_caching``: draw
    ``enable_plan_caching`` (its cache is a class attribute: rank threads of one process
    share it). ``flattened_full_load``: always ``flatten_optimizer_state_dict`` and a load
    with ``full_state_dict`` (set_state_dict of the two raises in torch 2.13: spec
    state_dict.checkpoint.flattened_full_load), else never the two on the loading side.

    The options whose effect shows only on a path of their own (dedup_save_to_lowest_rank,
    enable_plan_caching, overwrite=False, flatten_optimizer_state_dict) are drawn with that
    path first: a derandomized profile's few examples start from the simplest draw."""
    save_planner = list(_flags(draw, ("dedup_save_to_lowest_rank",), first=True))
    save_planner.append(("flatten_sharded_tensors", draw(st.booleans())))
    if plan_caching and draw(_TRUE_FIRST):
        save_planner.append(("enable_plan_caching", True))
    load_planner = (
        ("flatten_sharded_tensors", draw(st.booleans())),
        ("allow_partial_load", draw(st.booleans())),
    )
    writer = (
        ("single_file_per_rank", draw(st.booleans())),
        ("sync_files", draw(st.booleans())),
        ("thread_count", draw(st.integers(1, 3))),
        ("per_thread_copy_ahead", draw(sampled((10_000_000, 0, 64)))),
        ("cache_staged_state_dict", draw(st.booleans())),
        ("overwrite", not draw(_TRUE_FIRST)),
    )
    flat = flattened_full_load or draw(_TRUE_FIRST)
    save_options = (*_flags(draw, ("full_state_dict", "cpu_offload")),)
    load_options = [*_flags(draw, ("full_state_dict", "cpu_offload"))]
    if flattened_full_load and ("full_state_dict", True) not in load_options:
        load_options.insert(0, ("full_state_dict", True))
    elif flat and not flattened_full_load and ("full_state_dict", True) in load_options:
        load_options.remove(("full_state_dict", True))
    full, offload = (dict(load_options).get(k, False) for k in ("full_state_dict", "cpu_offload"))
    if full and offload and not broadcast:  # rank 0 alone would hold the values to set
        load_options.remove(("cpu_offload", True))
    elif full and broadcast and (offload or draw(st.booleans())):
        load_options.append(("broadcast_from_rank0", True))
    if flat:
        save_options += (("flatten_optimizer_state_dict", True),)
        load_options.append(("flatten_optimizer_state_dict", True))
    return CheckpointOptions(
        save_planner=tuple(save_planner),
        load_planner=load_planner,
        writer=writer,
        save_options=save_options,
        load_options=tuple(load_options),
    )


def dcp_options_cases(
    world_size: int,
    load_sizes: Sequence[int],
    *,
    broadcast: bool,
    plan_caching: bool,
    flattened_full_load: bool = False,
) -> st.SearchStrategy[OptionsCase]:
    """A ``reshard_cases`` checkpoint (the optimizers of two parameter groups) saved and
    loaded with ``checkpoint_options``, into a directory holding an earlier checkpoint or an
    empty one (with plan caching, the second save through its planner)."""
    check_int("world_size", world_size)
    sizes = tuple(load_sizes)
    return _options_cases(world_size, sizes, broadcast, plan_caching, flattened_full_load)


@st.composite
def _options_cases(
    draw: st.DrawFn,
    world_size: int,
    load_sizes: tuple[int, ...],
    broadcast: bool,
    plan_caching: bool,
    flattened_full_load: bool,
) -> OptionsCase:
    reshard = _second_group(draw(reshard_cases(world_size, load_sizes)))
    options = draw(
        checkpoint_options(
            broadcast=broadcast,
            plan_caching=plan_caching,
            flattened_full_load=flattened_full_load,
        )
    )
    # a flattened full load is the subject there: nothing written over
    rewrite = "empty" if flattened_full_load else draw(sampled(REWRITES))
    return OptionsCase(reshard, options, rewrite)


def _second_group(reshard: ReshardCase) -> ReshardCase:
    """Both sides' optimizers with a second parameter group of its own hyper-parameters (the
    last Linear's, where the MLP has two or more): per-group values then differ, as a
    flattened optimizer state dict must keep them."""
    optim = reshard.save.train.optim
    if optim.second_group is not None:
        return reshard
    second = (("lr", optim.lr / 2), ("weight_decay", 0.05))

    def grouped(case: StateDictCase) -> StateDictCase:
        train = case.train
        return replace(case, train=replace(train, optim=replace(train.optim, second_group=second)))

    return ReshardCase(grouped(reshard.save), grouped(reshard.load))


@takes_world_size
@st.composite
def async_cases(draw: st.DrawFn, world_size: int, *, accelerator: bool = False) -> AsyncCase:
    """A trained ``state_dict_cases`` case saved by ``dcp.async_save`` while it trains 1-2
    more steps. Its stager: first (the simplest draw, a derandomized profile's first
    example) the one a user gets by handing a ``FileSystemWriter`` as ``storage_writer`` and
    no ``async_stager`` (the writer is an ``AsyncStager``: it stages itself); else half the
    cases a ``DefaultStager`` of drawn ``StagingOptions`` (``use_non_blocking_copy`` only on an
    ``accelerator``), the others async_save's own. Its planner and ``use_collectives`` drawn
    too (a rank-local save is loaded back at its own layout), and first the live parameters
    changed in place at once (``AsyncCase.in_place``)."""
    case = draw(state_dict_cases(world_size))
    staging = None
    writer_stages = draw(_TRUE_FIRST)
    if not writer_stages and draw(st.booleans()):
        names = STAGING_OPTIONS + (("use_non_blocking_copy",) if accelerator else ())
        staging = tuple((name, draw(st.booleans())) for name in names)
    return AsyncCase(
        case,
        after=draw(st.integers(1, 2)),
        staging=staging,
        storage_writer=writer_stages or draw(st.booleans()),
        planner=draw(st.booleans()),
        use_collectives=draw(st.booleans()),
        in_place=draw(_TRUE_FIRST),
    )


@takes_world_size
@st.composite
def async_failure_cases(draw: st.DrawFn, world_size: int) -> AsyncFailureCase:
    """A ``state_dict_cases`` case whose async save fails (``ASYNC_FAILURES``, on a drawn
    rank), staged by the writer itself or by a ``DefaultStager``."""
    case = draw(state_dict_cases(world_size))
    size = math.prod(case.train.mesh_shape)
    return AsyncFailureCase(
        case,
        failure=draw(sampled(ASYNC_FAILURES)),
        failing_rank=draw(st.integers(0, size - 1)),
        default_stager=draw(st.booleans()),
    )


EMPTY_GROUPS = ("none", "last", "before")
"""Where ``stateful_cases`` puts an empty parameter group: none; after every other group; or
before one or more of them (torch 2.13 drops its hyper-parameters there: spec
state_dict.checkpoint.empty_group)."""


def stateful_cases(world_size: int, *, empty: str = "none") -> st.SearchStrategy[StatefulCase]:
    """A ``state_dict_cases`` MLP (1-D or HSDP mesh) trained 3-4 steps with some parameters
    frozen (never every one), the others in 1-3 parameter groups of their own lrs under a
    scheduler of ``strategies.schedules``, saved after 1..steps-1 steps; ``empty`` (one of
    ``EMPTY_GROUPS``): one more group without parameters, where it says ("last": drawn in
    half the cases)."""
    check_int("world_size", world_size)
    check_one_of("empty", empty, EMPTY_GROUPS)
    return _stateful_cases(world_size, empty)


@st.composite
def _stateful_cases(draw: st.DrawFn, world_size: int, empty: str) -> StatefulCase:
    case = draw(state_dict_cases(world_size, layouts=("fsdp", "hsdp"), steps=(3, 4)))
    dims, bias = case.train.dims, case.train.bias
    names = [f"{2 * i}.{kind}" for i in range(len(dims) - 1) for kind in ("weight", "bias")]
    names = [n for n in names if bias or n.endswith("weight")]
    frozen_flags = [draw(st.booleans()) for _ in names]
    if all(frozen_flags):
        frozen_flags[-1] = False
    frozen = tuple(n for n, f in zip(names, frozen_flags, strict=True) if f)
    trainable = [n for n in names if n not in frozen]
    count = min(draw(st.integers(2, 3)), len(trainable))
    homes = list(range(count)) + [draw(st.integers(0, count - 1)) for _ in trainable[count:]]
    groups = [
        tuple(n for n, h in zip(trainable, homes, strict=True) if h == g) for g in range(count)
    ]
    if empty == "before":
        groups.insert(draw(st.integers(0, count - 1)), ())
    elif empty == "last" and draw(st.booleans()):
        groups.append(())
    lrs = tuple(draw(sampled((0.1, 0.05, 0.01))) for _ in groups)
    schedule = draw(schedules(case.train.optim.name, steps=case.train.steps))
    train = replace(case.train, optim=replace(case.train.optim, second_group=None, tensor_lr=False))
    return StatefulCase(
        replace(case, train=train),
        frozen=frozen,
        groups=tuple(groups),
        lrs=lrs,
        schedule=schedule,
        save_at=draw(st.integers(1, case.train.steps - 1)),
    )
