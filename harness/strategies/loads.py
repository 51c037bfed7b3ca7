"""Strategies of the checkpoint-loads properties (``harness.cases.loads``): loads that do
not fit the model, the options that choose a state dict's keys, and failing saves."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from hypothesis import strategies as st

from harness.cases.loads import (
    CHANGES,
    FLOAT_DTYPES,
    MISMATCH_VIAS,
    MISMATCHES,
    TARGETS,
    UNTP_LAYOUTS,
    FailedSaveCase,
    KeyOptionsCase,
    MismatchCase,
    PartialLoadCase,
    StrictSetCase,
    linear_keys,
)
from harness.cases.state_dict import SHARDED_LAYOUTS, ReshardCase, StateDictCase
from harness.errors import check_int, check_one_of, require
from harness.strategies._common import sampled
from harness.strategies.state_dict import reshard_cases, state_dict_cases


def _sizes(load_sizes: Sequence[int]) -> tuple[int, ...]:
    for size in load_sizes:
        check_int("load_sizes[...]", size)
    require(len(load_sizes) > 0, "load_sizes", tuple(load_sizes), "a non-empty sequence")
    return tuple(load_sizes)


def _untrained(case: StateDictCase) -> StateDictCase:
    """No training: a load shows against a fresh model of another seed, and these
    properties take state dicts of models, not of optimizers."""
    return replace(case, train=replace(case.train, steps=0))


def _untrained_reshard(reshard: ReshardCase) -> ReshardCase:
    return ReshardCase(_untrained(reshard.save), _untrained(reshard.load))


def _float(case: StateDictCase) -> StateDictCase:
    """``case`` in a dtype of ``FLOAT_DTYPES`` (the one it has when it is one)."""
    if case.train.dtype in FLOAT_DTYPES:
        return case
    return replace(case, train=replace(case.train, dtype="float32"))


@st.composite
def partial_load_cases(
    draw: st.DrawFn, world_size: int, load_sizes: Sequence[int], change: str
) -> PartialLoadCase:
    """A checkpoint of an fsdp/hsdp MLP saved at ``world_size`` ranks, loaded at a size of
    ``load_sizes`` into a model one Linear ``change``d."""
    check_one_of("change", change, CHANGES)
    reshard = draw(reshard_cases(world_size, _sizes(load_sizes), layouts=UNTP_LAYOUTS))
    if change == "shrunk" and len(reshard.save.train.dims) < 3:
        dims = reshard.save.train.dims
        save = replace(reshard.save, train=replace(reshard.save.train, dims=(*dims, dims[-1])))
        load = replace(reshard.load, train=replace(reshard.load.train, dims=(*dims, dims[-1])))
        reshard = ReshardCase(save, load)
    return PartialLoadCase(_untrained_reshard(reshard), change)


@st.composite
def strict_set_cases(
    draw: st.DrawFn, world_size: int, change: str, full: bool, broadcast: bool = False
) -> StrictSetCase:
    """A fsdp/hsdp model's state dict (``full`` or sharded) set into a model one Linear
    ``change``d, strict or not, by ``set_state_dict`` or ``set_model_state_dict``; with
    ``broadcast`` (and ``full``), ``broadcast_from_rank0`` by ``set_model_state_dict`` (one
    ``set_state_dict`` call hangs where rank 0 alone holds the values: spec
    state_dict.full.broadcast_from_rank0_joint)."""
    check_one_of("change", change, CHANGES)
    case = _untrained(draw(state_dict_cases(world_size, layouts=UNTP_LAYOUTS, steps=(0, 0))))
    dims = case.train.dims
    if change == "shrunk" and len(dims) < 3:
        case = replace(case, train=replace(case.train, dims=(*dims, dims[-1])))
    joint = not broadcast and draw(st.booleans())
    strict = draw(st.booleans())
    return StrictSetCase(case, change, full, joint=joint, strict=strict, broadcast=broadcast)


@st.composite
def mismatch_cases(
    draw: st.DrawFn, world_size: int, load_sizes: Sequence[int], mismatch: str, via: str
) -> MismatchCase:
    """A state dict of any sharded layout loaded ``via`` into a model differing by
    ``mismatch``."""
    check_one_of("mismatch", mismatch, MISMATCHES)
    check_one_of("via", via, MISMATCH_VIAS)
    sizes = _sizes(load_sizes) if via == "dcp" else (world_size,)
    # torch 2.13: a full state dict of another dtype set into an FSDP+TP model raises a bare
    # AssertionError in torch where FSDP and HSDP cast as documented: not drawn
    layouts = UNTP_LAYOUTS if (mismatch, via) == ("dtype", "set_full") else SHARDED_LAYOUTS
    reshard = draw(reshard_cases(world_size, sizes, layouts=layouts))
    save, load = _float(reshard.save), reshard.load
    load = replace(load, train=replace(load.train, dtype=save.train.dtype))
    return MismatchCase(_untrained_reshard(ReshardCase(save, load)), mismatch, via)


@st.composite
def key_options_cases(
    draw: st.DrawFn, world_size: int, *, wrapped_missing: bool = False
) -> KeyOptionsCase:
    """Any sharded layout or DDP, an MLP of two or more Linears (a buffer on the first; its
    children indexed or named so that one's name prefixes a sibling's), some parameters
    frozen, every option of ``StateDictOptions`` that chooses keys drawn, and maybe a
    submodule's state dict too. The paths where an option shows (DDP's prefix, prefixing
    names, a frozen first parameter left out by ignore_frozen_params, a non-strict set, the
    first Linear's submodule) are each one's simplest draw: hypothesis' first example.
    ``wrapped_missing``: only a DDP model's sharded state dict without its frozen keys (one
    or more) set with strict=False, and no submodule (spec
    state_dict.loads.wrapped_missing_keys)."""
    case = _untrained(draw(state_dict_cases(world_size, steps=(0, 0))))
    dims = case.train.dims
    if len(dims) < 3:  # siblings: two Linears or more
        case = replace(case, train=replace(case.train, dims=(*dims, dims[-1])))
    wrapper = "ddp" if wrapped_missing else draw(sampled(("ddp", "fully_shard")))
    untp = wrapper == "ddp" or case.train.layout in UNTP_LAYOUTS
    naming = draw(sampled(("prefixing", "indexed") if untp else ("indexed",)))
    keys = linear_keys(case.train.dims, case.train.bias, naming)
    flags = [draw(sampled((k == keys[0], k != keys[0]))) for k in keys]
    if wrapped_missing:
        flags[0] = True
    if all(flags):  # DDP refuses a model without a parameter that requires a gradient
        flags[-1] = False
    frozen = tuple(k for k, flag in zip(keys, flags, strict=True) if flag)
    linears = tuple(range(0, 2 * (len(case.train.dims) - 1), 2))
    return KeyOptionsCase(
        case,
        frozen=frozen,
        ignore_frozen=wrapped_missing or draw(sampled((True, False))),
        full=not wrapped_missing and draw(st.booleans()),
        cpu_offload=draw(st.booleans()),
        submodule=None if wrapped_missing else draw(sampled((*linears, None))),
        keep_prefixes=draw(st.booleans()),
        strict=not wrapped_missing and draw(st.booleans()),
        wrapper=wrapper,
        naming=naming,
        buffer=True,
    )


@st.composite
def single_process_cases(
    draw: st.DrawFn, world_size: int, load_sizes: Sequence[int]
) -> ReshardCase:
    """A model of any sharded layout saved at ``world_size`` ranks, loaded again at a size
    of ``load_sizes``."""
    return _untrained_reshard(draw(reshard_cases(world_size, _sizes(load_sizes))))


@st.composite
def failed_save_cases(
    draw: st.DrawFn, world_size: int, load_sizes: Sequence[int], target: str
) -> FailedSaveCase:
    """A model of any sharded layout saved at ``world_size`` ranks, a second save failing on
    a drawn rank, the first loaded at a size of ``load_sizes``.

    ``target="same"`` draws fsdp (a 1-D mesh) with a failing rank other than 0 wherever
    there is one: rank 0 then holds a piece of every tensor and writes it, so what torch does
    to the first checkpoint's files shows on every draw, never on some only."""
    check_one_of("target", target, TARGETS)
    layouts = ("fsdp",) if target == "same" else SHARDED_LAYOUTS
    reshard = draw(reshard_cases(world_size, _sizes(load_sizes), layouts=layouts))
    size = math.prod(reshard.save.train.mesh_shape)
    first = 1 if target == "same" and size > 1 else 0
    failing = draw(st.integers(first, size - 1))
    reshard = _untrained_reshard(reshard)
    return FailedSaveCase(reshard.save, failing, target, reshard.load)
