"""Strategies for activation checkpointing (``cases.checkpointing``), valid by construction
for a model's layers."""

from __future__ import annotations

from functools import cache

from hypothesis import strategies as st

from harness.cases.checkpointing import (
    CHECKPOINT_APIS,
    LISTABLE_POLICIES,
    REENTRANT_APIS,
    SAVE_POLICIES,
    Checkpointing,
)
from harness.errors import check_int, require
from harness.strategies._common import sampled


def checkpointings(layers: int, *, random: bool = False) -> st.SearchStrategy[Checkpointing]:
    """Checkpointing of some of a model's ``layers`` layers with parameters, through any API
    of ``cases.checkpointing.CHECKPOINT_APIS``; reentrant (never on the first layer, and
    not selective) or not, selective or not, each option of the implementation drawn.
    ``random``: the layers draw random numbers (dropout), so the generator's state is
    always preserved for the recomputation. The composable checkpoint never takes a
    selective policy: torch 2.13 fails that on a layer carrying other hooks (TP's, without
    early stop; fully_shard's under mixed precision, with it too), which spec
    optim.knobs.checkpointing_composable_hooks checks alone."""
    check_int("layers", layers)
    require(isinstance(random, bool), "random", random, "a bool")
    return _checkpointings(layers, random)


@cache
@st.composite
def _checkpointings(draw: st.DrawFn, layers: int, random: bool) -> Checkpointing:
    api = draw(sampled(CHECKPOINT_APIS))
    reentrant = api in REENTRANT_APIS and layers > 1 and draw(st.booleans())
    positions = tuple(range(1 if reentrant else 0, layers))
    # apply_activation_checkpointing spells "every layer" with an auto_wrap_policy and any
    # other choice with a check_fn: drawn as often as a choice, not left to a full list.
    every = api == "apply" and not reentrant and draw(st.booleans())
    chosen = (
        list(positions)
        if every
        else draw(st.lists(sampled(positions), min_size=1, unique=True).map(sorted))
    )
    preserve_rng_state = random or draw(st.booleans())
    if reentrant:
        return Checkpointing(
            api=api,
            layers=tuple(chosen),
            reentrant=True,
            preserve_rng_state=preserve_rng_state,
        )
    save = None if api == "composable" else draw(st.none() | sampled(SAVE_POLICIES))
    return Checkpointing(
        api=api,
        layers=tuple(chosen),
        save=save,
        policy_as_list=save in LISTABLE_POLICIES and draw(st.booleans()),
        allow_cache_entry_mutation=save is not None and draw(st.booleans()),
        preserve_rng_state=preserve_rng_state,
        determinism_check=draw(sampled(("default", "none"))),
        early_stop=draw(st.booleans()),
    )
