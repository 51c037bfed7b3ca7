"""Strategies of the checkpoint-loads properties on DCP's coordination options and the
state-dict functions called one by one (``harness.cases.load_options``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hypothesis import strategies as st

from harness.cases.load_options import (
    FQN_MODIFIERS,
    LOAD_COORDINATIONS,
    SAVE_COORDINATIONS,
    ApiOptionsCase,
    CoordinationCase,
    RankLocalReshardCase,
)
from harness.cases.state_dict import ReshardCase, StateDictCase
from harness.errors import check_int, require
from harness.strategies._common import sampled
from harness.strategies.state_dict import reshard_cases, state_dict_cases


def coordination_cases(
    world_size: int, load_sizes: Sequence[int]
) -> st.SearchStrategy[CoordinationCase]:
    """A model of any sharded layout saved at ``world_size`` ranks and loaded at a size of
    ``load_sizes`` (any layout), each side's coordination drawn; a rank-local save is
    loaded by its own layout (``CoordinationCase``)."""
    check_int("world_size", world_size)
    require(len(load_sizes) > 0, "load_sizes", tuple(load_sizes), "a non-empty sequence")
    for size in load_sizes:
        check_int("load_sizes[...]", size)
    return _coordination_cases(world_size, tuple(load_sizes))


@st.composite
def _coordination_cases(
    draw: st.DrawFn, world_size: int, load_sizes: tuple[int, ...]
) -> CoordinationCase:
    reshard = draw(reshard_cases(world_size, load_sizes))
    save = replace(reshard.save, train=replace(reshard.save.train, steps=0))
    save_how = draw(sampled(SAVE_COORDINATIONS))
    if save_how == "rank_local":
        seed = (save.train.seed + 1) % 2**32
        load = replace(save, train=replace(save.train, seed=seed))
    else:
        load = replace(reshard.load, train=replace(reshard.load.train, steps=0))
    loads = RANK_LOCAL_LOADS if save_how == "rank_local" else LOAD_COORDINATIONS
    return CoordinationCase(ReshardCase(save, load), save_how, draw(sampled(loads)))


RANK_LOCAL_LOADS = tuple(how for how in LOAD_COORDINATIONS if how != "no_dist")
"""How ``coordination_cases`` loads a rank-local checkpoint: a ``no_dist`` load of one is
``rank_local_no_dist_cases``' (every rank reads rank 0's metadata in torch 2.13 and 2.15)."""


def rank_local_no_dist_cases(world_size: int) -> st.SearchStrategy[CoordinationCase]:
    """An fsdp model of 2+ ranks (each holding rows of its first weight) saved rank-locally
    (``use_collectives=False``) and loaded by the same layout (another seed) with
    ``no_dist=True`` on every rank."""
    check_int("world_size", world_size, 2)
    return _rank_local_no_dist_cases(world_size)


@st.composite
def _rank_local_no_dist_cases(draw: st.DrawFn, world_size: int) -> CoordinationCase:
    # every rank holds rows of the first weight: none is left with an empty piece
    save = draw(_untrained_fsdp_cases(world_size, first_rows=world_size))
    load = replace(save, train=replace(save.train, seed=(save.train.seed + 1) % 2**32))
    return CoordinationCase(ReshardCase(save, load), "rank_local", "no_dist")


def rank_local_reshard_cases(world_size: int) -> st.SearchStrategy[RankLocalReshardCase]:
    """An untrained fsdp MLP on 2+ ranks whose first Linear has 2+ output features."""
    check_int("world_size", world_size, 2)
    return _rank_local_reshard_cases(world_size)


@st.composite
def _rank_local_reshard_cases(draw: st.DrawFn, world_size: int) -> RankLocalReshardCase:
    case = draw(_untrained_fsdp_cases(world_size, first_rows=2))
    train = replace(case.train, mesh_shape=(world_size,))
    return RankLocalReshardCase(replace(case, train=train, reshard_after_forward=None))


@st.composite
def _untrained_fsdp_cases(draw: st.DrawFn, world_size: int, first_rows: int) -> StateDictCase:
    """An untrained fsdp MLP whose first Linear has ``first_rows`` output features or more."""
    case = draw(state_dict_cases(world_size, layouts=("fsdp",), steps=(0, 0)))
    dims = case.train.dims
    dims = (dims[0], max(dims[1], first_rows), *dims[2:])
    return replace(case, train=replace(case.train, dims=dims))


@st.composite
def api_options_cases(draw: st.DrawFn, world_size: int) -> ApiOptionsCase:
    """An fsdp/hsdp model trained 1-2 steps, the options and submodule of its state dicts
    drawn."""
    check_int("world_size", world_size)
    case = draw(state_dict_cases(world_size, layouts=("fsdp", "hsdp"), steps=(1, 2)))
    full = draw(st.booleans())
    linears = tuple(range(0, 2 * (len(case.train.dims) - 1), 2))
    # torch 2.13: set_state_dict / set_optimizer_state_dict with full_state_dict=True and
    # flatten_optimizer_state_dict=True raise KeyError('param_groups.0.params.0') in
    # _load_optim_state_dict (seen at 2 ranks, fsdp): not drawn together here
    return ApiOptionsCase(
        case,
        full=full,
        cpu_offload=not full and draw(st.booleans()),
        flatten_optimizer=not full and draw(st.booleans()),
        modifiers=draw(sampled(FQN_MODIFIERS)),
        submodule=draw(sampled((*linears, None))),
    )
