"""Loads that do not fit the model, and checkpoints read or written the hard way: a strict
load refuses what does not fit and a partial one fills exactly what is there (dcp.load's
planner, set_*state_dict's strict); a tensor of another shape or dtype is refused or, where
torch documents it, cast; the StateDictOptions that choose a state dict's keys (frozen
parameters, submodules); a checkpoint saved at N ranks read without a process group (and
through torch.save files); a save that fails on one rank; how a save's and a load's ranks
coordinate (process_group, use_collectives, no_dist); the state-dict functions one by one
against get/set_state_dict.

Every comparison is exact: loading moves values, and a documented cast is numpy's cast.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness import World, Worlds, parity
from harness.cases.load_options import CoordinationCase
from harness.cases.loads import BUFFER, KeyOptionsCase, StrictSetCase, linear_keys
from harness.parity import assert_array_equal, assert_equal_values, failure
from harness.profiles import costly
from harness.strategies import (
    api_options_cases,
    coordination_cases,
    failed_save_cases,
    key_options_cases,
    mismatch_cases,
    partial_load_cases,
    rank_local_no_dist_cases,
    rank_local_reshard_cases,
    single_process_cases,
    strict_set_cases,
)
from harness.torchkit.models import build_keyed_mlp, build_mlp
from suites.checks import loads as checks
from suites.checks import loads_api
from suites.checks import state_dict as checks_sd
from suites.checks.directories import driver_directory
from suites.checks.loads import Loaded, Values

# Each example builds one or two sharded models (no training) and most write and read a
# checkpoint: 0.2-0.8 s on threads, so the floor of 8 examples at world size 2 (ci, ws1-4:
# state_dict_options 4 s, single_process 14 s).
PROPERTY = costly(12)
# A property split over parameters (each a test of its own): 2 examples each at world size 2
# (ci, ws1-4: failed_save 7 s, mismatch_refused 18 s, strict_and_partial 23 s).
SPLIT = costly(50)


def _refused_naming(errors: Sequence[str | None], keys: Sequence[str], what: str) -> None:
    """Every rank raised, naming at least one of ``keys``."""
    for rank, error in enumerate(errors):
        if error is None or not any(key in error for key in keys):
            raise failure(
                f"{what}, rank {rank} of {len(errors)}: got {error!r}, should be an error "
                f"naming one of {list(keys)}"
            )


def _assert_values(got: Values, want: Values, keys: Sequence[str], what: str) -> None:
    for key in keys:  # exact: loading copies values
        assert_array_equal(got[key], want[key], what=f"{key} {what}")


# --- strict and partial loads -------------------------------------------------------------


@pytest.mark.spec("state_dict.loads.strict_and_partial")
@pytest.mark.parametrize("change", ["grown", "shrunk"])
@SPLIT
@given(data=st.data())
def test_dcp_strict_load_refuses_missing_keys_and_a_partial_load_fills_what_is_there(
    world: World, worlds: Worlds, data: st.DataObject, change: str
) -> None:
    case = data.draw(partial_load_cases(world.world_size, worlds.sizes, change), label="case")
    parity.attach(case.call())
    saved_keys = linear_keys(case.reshard.save.train.dims, case.reshard.save.train.bias)
    keys = linear_keys(case.loading.train.dims, case.loading.train.bias)
    missing = [k for k in keys if k not in saved_keys]
    loading = worlds.get(case.loading_size)
    with driver_directory("distconf-loads-") as root:
        saved = world.run(checks.save_model_on_rank, case.reshard.save, root)[0]
        strict = loading.run(checks.load_model_on_rank, case.loading, root)
        partial = loading.run(checks.load_model_on_rank, case.loading, root, True)
    if missing:
        what = "dcp.load (default planner) of a checkpoint lacking keys"
        _refused_naming([seen.error for seen in strict], missing, what)
    else:  # documented: only a key of the state dict missing from the checkpoint is refused
        for rank, seen in enumerate(strict):
            what = f"dcp.load (default planner) of a checkpoint with extra keys, rank {rank}"
            assert_equal_values(seen.error, None, what=f"error of {what}")
            _assert_values(seen.loaded, saved, keys, f"after {what}")
    for rank, seen in enumerate(partial):
        what = f"after dcp.load(allow_partial_load=True) on rank {rank}"
        assert_equal_values(seen.error, None, what=f"error {what}")
        _assert_values(seen.loaded, saved, [k for k in keys if k in saved_keys], what)
        _assert_values(seen.loaded, seen.fresh, missing, f"(not in the checkpoint) {what}")


BROADCAST_ON_THREADS = (
    "broadcast_from_rank0 broadcasts on the group's device types, which the threaded process "
    "group does not register: the processes runner (gloo) serves it"
)
"""Why broadcast_from_rank0 runs on rank processes only (``suites.test_checkpoints`` draws it
where ``world.runner != "threads"`` alike)."""


@pytest.mark.spec("state_dict.loads.strict_and_partial")
@pytest.mark.parametrize(
    "given_state",
    [
        "sharded-grown",
        "sharded-shrunk",
        "full-grown",
        "full-shrunk",
        "broadcast-grown",
    ],
)
@SPLIT
@given(data=st.data())
def test_set_state_dict_strict_refuses_and_non_strict_reports_the_keys(
    world: World, data: st.DataObject, given_state: str
) -> None:
    kind, change = given_state.split("-")
    broadcast = kind == "broadcast"
    if broadcast and world.runner == "threads":
        pytest.skip(BROADCAST_ON_THREADS)
    strategy = strict_set_cases(world.world_size, change, kind != "sharded", broadcast)
    case = data.draw(strategy, label="case")
    parity.attach(case.call())
    # the reference: nn.Module.load_state_dict(strict=False) on one device
    source = build_mlp(case.case.train, torch.device("cpu")).state_dict()
    keys = build_mlp(case.loading.train, torch.device("cpu")).load_state_dict(source, strict=False)
    missing, unexpected = sorted(keys.missing_keys), sorted(keys.unexpected_keys)
    # broadcast_from_rank0 reaches strict through a path of its own: both ways each example,
    # strict first
    for each in (replace(case, strict=True), replace(case, strict=False)) if broadcast else (case,):
        parity.attach(each.call())
        _assert_strict_set(world, each, missing, unexpected)


def _assert_strict_set(
    world: World, case: StrictSetCase, missing: list[str], unexpected: list[str]
) -> None:
    how = "set_state_dict" if case.joint else "set_model_state_dict"
    broadcast = "broadcast_from_rank0=True, " if case.broadcast else ""
    what = f"{how}(full_state_dict={case.full}, {broadcast}strict={case.strict})"
    seen = world.run(checks.strict_set_on_rank, case)
    if case.strict:
        _refused_naming([s.result.error for s in seen], missing + unexpected, what)
        return
    for rank, got in enumerate(seen):
        assert_equal_values(got.result.error, None, what=f"error of {what} on rank {rank}")
        where = f"(missing, unexpected) keys {what} returned on rank {rank}"
        assert_equal_values(got.incompatible, (missing, unexpected), what=where)
        common = [k for k in got.result.loaded if k not in missing]
        _assert_values(got.result.loaded, got.saved, common, f"after {what} on rank {rank}")
        fresh = f"(missing) after {what} on rank {rank}"
        _assert_values(got.result.loaded, got.result.fresh, missing, fresh)


# --- another shape or dtype ---------------------------------------------------------------


@pytest.mark.spec("state_dict.loads.mismatch_refused")
@pytest.mark.parametrize(
    "mismatch_via",
    [
        "shape-dcp",
        "shape-set_full",
        "shape-set_sharded",
        "dtype-dcp",
        "dtype-set_full",
        "dtype-set_sharded",
    ],
)
@SPLIT
@given(data=st.data())
def test_a_tensor_of_another_shape_or_dtype_is_refused_or_cast_as_documented(
    world: World, worlds: Worlds, data: st.DataObject, mismatch_via: str
) -> None:
    mismatch, via = mismatch_via.split("-")
    case = data.draw(mismatch_cases(world.world_size, worlds.sizes, mismatch, via), label="case")
    parity.attach(case.call())
    if via == "dcp":
        with driver_directory("distconf-loads-") as root:
            saved = world.run(checks.save_model_on_rank, case.reshard.save, root)[0]
            seen = worlds.get(case.load_size).run(checks.load_model_on_rank, case.loading, root)
    else:
        pairs = world.run(checks.mismatch_set_on_rank, case)
        saved, seen = pairs[0][0], [loaded for _, loaded in pairs]
    keys = linear_keys(case.loading.train.dims, case.loading.train.bias)
    what = f"{case.call()}"
    if mismatch == "shape" or via == "dcp":
        # a load copies into the tensors in place: another shape never fits, and DCP's
        # checkpoint records each tensor's dtype, which nothing documents it casts from
        wrong = keys[:1] if mismatch == "shape" else keys
        _refused_naming([s.error for s in seen], wrong, what)
        return
    # load_state_dict(assign=False), which set_model_state_dict calls: "the properties of
    # the tensors in the current module are preserved" (its docs): a documented cast
    dtype = case.loading.train.dtype
    _check_cast(seen, saved, keys, dtype, what)


def _check_cast(
    seen: Sequence[Loaded], saved: Values, keys: list[str], dtype: str, what: str
) -> None:
    for rank, got in enumerate(seen):
        assert_equal_values(got.error, None, what=f"error of {what} on rank {rank}")
        assert_equal_values(got.dtypes, dict.fromkeys(keys, dtype), what=f"dtypes on rank {rank}")
        cast = {k: v.astype(dtype) for k, v in saved.items()}  # exact: numpy's rounding cast
        _assert_values(got.loaded, cast, keys, f"(cast to {dtype}) after {what} on rank {rank}")


# --- StateDictOptions -----------------------------------------------------------------------


@pytest.mark.spec("state_dict.loads.state_dict_options")
@PROPERTY
@given(data=st.data())
def test_state_dict_options_choose_the_keys_and_keep_the_values(
    world: World, data: st.DataObject
) -> None:
    case = data.draw(key_options_cases(world.world_size), label="case")
    parity.attach(case.call())
    buffer = BUFFER if case.buffer else None
    model = build_keyed_mlp(case.case.train, torch.device("cpu"), case.names, buffer)
    reference = {k: v.numpy() for k, v in model.state_dict().items()}
    held_by = 1 if case.full and case.cpu_offload else world.world_size  # documented: rank 0
    ignored = [k for k in case.frozen if case.ignore_frozen]
    for rank, seen in enumerate(world.run(checks.key_options_on_rank, case)):
        held = rank < held_by
        want = case.expected_keys if held else []
        assert_equal_values(seen.keys, want, what=f"keys of {case.options()} on rank {rank}")
        if case.cpu_offload and held:
            assert_equal_values(seen.devices, {"cpu"}, what=f"devices on rank {rank}")
        for key in want:  # exact: a state dict holds the model's values
            assert_array_equal(seen.values[key], reference[key], what=f"{key} on rank {rank}")
        if case.submodule is not None:
            _assert_submodule_keys(case, seen, reference, rank if held else None)
        if case.full and case.cpu_offload:
            continue  # rank 0's alone
        what = f"set_model_state_dict(strict={case.strict}) of it on rank {rank}"
        # A full state dict lacking keys is neither refused nor its keys reported missing
        # (torch fills them from the model itself): state_dict.loads.strict_and_partial's
        # deviation, so here only its values are checked.
        if ignored and case.strict and not case.full:
            _refused_naming([seen.set_error], ignored, what)
            continue
        assert_equal_values(seen.set_error, None, what=f"error of {what}")
        if not case.full:
            reported: tuple[list[str], list[str]] = (sorted(ignored), [])
            # a DDP model's are named with its module. prefix in torch 2.13: spec
            # state_dict.loads.wrapped_missing_keys
            assert_equal_values(
                _unwrapped(seen.incompatible), reported, what=f"keys {what} returned"
            )
        loaded = [k for k in case.keys if k not in ignored]
        _assert_values(seen.loaded, reference, loaded, f"after {what}")
        _assert_values(seen.loaded, seen.fresh, ignored, f"(left out) after {what}")


def _unwrapped(keys: tuple[list[str], list[str]] | None) -> tuple[list[str], list[str]] | None:
    if keys is None:
        return None
    missing, unexpected = keys
    return [k.removeprefix("module.") for k in missing], [
        k.removeprefix("module.") for k in unexpected
    ]


# A DDP model built, its state dict taken and set: about twice a placement example (ci,
# ws1-4: 3 s).
WRAPPED_MISSING = costly(50)


@pytest.mark.spec("state_dict.loads.wrapped_missing_keys")
@WRAPPED_MISSING
@given(data=st.data())
def test_a_wrapped_model_reports_missing_keys_by_their_fqns(
    world: World, data: st.DataObject
) -> None:
    case = data.draw(key_options_cases(world.world_size, wrapped_missing=True), label="case")
    parity.attach(case.call())
    ignored = sorted(case.frozen)
    for rank, seen in enumerate(world.run(checks.key_options_on_rank, case)):
        what = f"set_model_state_dict(strict=False) of a DDP model's state dict on rank {rank}"
        assert_equal_values(seen.set_error, None, what=f"error of {what}")
        # "the missing keys of the model state_dict" (its docs): the state dict the API
        # gives and takes, keyed by canonical FQNs, without DDP's module. prefix
        what = f"(missing, unexpected) keys {what} returned"
        assert_equal_values(seen.incompatible, (ignored, []), what=what)


def _assert_submodule_keys(
    case: KeyOptionsCase, seen: checks.KeyOptionsSeen, reference: Values, rank: int | None
) -> None:
    """The submodule's state dict holds its keys alone (no sibling's whose name extends its
    own), its prefix kept as keep_submodule_prefixes says, the model's values; rank None:
    one that holds nothing (cpu_offload's full state dict is rank 0's)."""
    prefix = case.submodule_prefix
    # ignore_frozen_params is drawn for a submodule only where nothing is frozen
    full_keys = [k for k in case.keys if k.startswith(prefix)]
    want = case.submodule_keys if rank is not None else []
    what = (
        f"keys of submodules={{model.{prefix[:-1]}}}'s state dict "
        f"(keep_submodule_prefixes={case.keep_prefixes}) on rank {rank}"
    )
    assert_equal_values(seen.submodule_keys, want, what=what)
    for key, full_key in zip(want, full_keys, strict=False):
        got = seen.submodule_values[key]
        assert_array_equal(got, reference[full_key], what=f"submodule's {key} on rank {rank}")


# --- without a process group ------------------------------------------------------------------


@pytest.mark.spec("state_dict.loads.single_process")
@PROPERTY
@given(data=st.data())
def test_a_checkpoint_of_n_ranks_reads_without_a_process_group(
    world: World, worlds: Worlds, data: st.DataObject
) -> None:
    case = data.draw(single_process_cases(world.world_size, worlds.sizes), label="case")
    parity.attach(f"{case.call()}; dcp.load(no_dist=True), dcp_to_torch_save, torch_save_to_dcp")
    loading = worlds.get(int(np.prod(case.load.train.mesh_shape)))
    with driver_directory("distconf-loads-") as root:
        state = world.run(checks.save_trained_on_rank, case.save, root)[0]
        saved = checks.model_values(state)
        read = checks.read_without_group(root, saved)
        converted = checks.read_as_torch_save(root, os.path.join(root, "state.pt"))
        again = os.path.join(root, "again")
        checks.write_from_torch_save(saved, os.path.join(root, "saved.pt"), again)
        reloaded = loading.run(checks.load_model_on_rank, case.load, again)
    keys = list(saved)
    _assert_values(read, saved, keys, "read by dcp.load(no_dist=True) in one process")
    # the whole training state, optimizer steps and hyper-parameters too: a conversion
    # moves every entry, computing nothing (exact)
    what = "entries of dcp_to_torch_save's file (model and optimizer)"
    assert_equal_values(sorted(converted), sorted(state), what=what)
    for path, value in state.items():
        if isinstance(value, np.ndarray):
            assert_array_equal(converted[path], value, what=f"{path} of dcp_to_torch_save's file")
        else:
            assert_equal_values(converted[path], value, what=f"{path} of dcp_to_torch_save's file")
    for rank, seen in enumerate(reloaded):
        what = f"of torch_save_to_dcp's checkpoint loaded on rank {rank} of {loading.world_size}"
        assert_equal_values(seen.error, None, what=f"error {what}")
        _assert_values(seen.loaded, saved, keys, what)


# --- a save that fails ------------------------------------------------------------------------


@pytest.mark.spec("state_dict.loads.failed_save")
@pytest.mark.parametrize("target", ["new", "same"])
@SPLIT
@given(data=st.data())
def test_a_failed_save_raises_everywhere_and_leaves_the_last_checkpoint(
    world: World, worlds: Worlds, data: st.DataObject, target: str
) -> None:
    case = data.draw(failed_save_cases(world.world_size, worlds.sizes, target), label="case")
    parity.attach(case.call())
    loading = worlds.get(int(np.prod(case.load.train.mesh_shape)))
    with driver_directory("distconf-loads-") as root:
        first = os.path.join(root, "first")
        second = first if target == "same" else os.path.join(root, "second")
        saved = world.run(checks.save_model_on_rank, case.case, first)[0]
        failures = world.run(checks.failing_save_on_rank, case, second)
        left = checks.metadata_exists(second) if target == "new" else False
        loaded = loading.run(checks.load_model_on_rank, case.load, first)
    for rank, raised in enumerate(failures):
        what = f"what the failing save raised on rank {rank} (text: {raised.text!r})"
        got = (raised.kind, raised.failed_ranks)
        assert_equal_values(got, ("CheckpointException", [case.failing_rank]), what=what)
    assert_equal_values(left, False, what="a .metadata in the failed save's new directory")
    keys = list(saved)
    for rank, seen in enumerate(loaded):
        what = f"the first checkpoint loaded after a failed save into {target} directory"
        assert_equal_values(seen.error, None, what=f"error of {what}, rank {rank}")
        _assert_values(seen.loaded, saved, keys, f"of {what}, rank {rank}")


# --- how the ranks coordinate ------------------------------------------------------------------


@pytest.mark.spec("state_dict.loads.coordination")
@PROPERTY
@given(data=st.data())
def test_process_group_use_collectives_and_no_dist_load_back_what_was_saved(
    world: World, worlds: Worlds, data: st.DataObject
) -> None:
    _check_coordination(
        world, worlds, data.draw(coordination_cases(world.world_size, worlds.sizes), label="case")
    )


@pytest.mark.spec("state_dict.loads.rank_local_no_dist")
@pytest.mark.world_size(min=2)
@PROPERTY
@given(data=st.data())
def test_a_rank_local_checkpoint_loaded_no_dist_on_every_rank_loads_each_ranks_pieces(
    world: World, worlds: Worlds, data: st.DataObject
) -> None:
    case = data.draw(rank_local_no_dist_cases(world.world_size), label="case")
    _check_coordination(world, worlds, case)


def _check_coordination(world: World, worlds: Worlds, case: CoordinationCase) -> None:
    parity.attach(case.call())
    with driver_directory("distconf-loads-") as root:
        saved = world.run(loads_api.coordinated_save_on_rank, case, root)[0]
        seen = worlds.get(case.load_size).run(loads_api.coordinated_load_on_rank, case, root)
    for rank, got in enumerate(seen):
        what = f"{case.save_how} save loaded {case.load_how} on rank {rank}"
        assert_equal_values(got.error, None, what=f"error of the {what}")
        _assert_values(got.loaded, saved, list(saved), f"after the {what}")


@pytest.mark.spec("state_dict.loads.rank_local_resharded")
@PROPERTY
@given(data=st.data())
def test_a_rank_local_checkpoint_loaded_at_another_layout_is_refused_or_loads(
    world: World, data: st.DataObject
) -> None:
    if world.world_size < 2:
        pytest.skip("a rank-local checkpoint read for other ranks' pieces needs 2+ ranks")
    case = data.draw(rank_local_reshard_cases(world.world_size), label="case")
    parity.attach(case.call())
    with driver_directory("distconf-loads-") as root:
        saved = world.run(loads_api.rank_local_save_on_rank, case, root)[0]
        seen = world.run(loads_api.rank_local_load_on_rank, case, root)
    if all(got.error is not None for got in seen):
        return  # refused on every rank: what the spec allows
    for rank, got in enumerate(seen):
        what = f"a use_collectives=False checkpoint loaded replicated on rank {rank}"
        assert_equal_values(got.error, None, what=f"error of {what} (others did not raise)")
        _assert_values(got.loaded, saved, list(saved), f"of {what}")


# --- the functions one by one ------------------------------------------------------------------


def _assert_same_tree(got: object, want: object, what: str) -> None:
    """Nested dicts and lists of numpy arrays and plain values, keys in order, exactly."""
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{what}: got {type(got).__name__}, should be a dict"
        assert_equal_values(list(got), list(want), what=f"keys of {what}")
        for key, value in want.items():
            _assert_same_tree(got[key], value, f"{what}[{key!r}]")
    elif isinstance(want, list | tuple):
        assert_equal_values(len(got), len(want), what=f"length of {what}")  # type: ignore[arg-type]
        for index, value in enumerate(want):
            _assert_same_tree(got[index], value, f"{what}[{index}]")  # type: ignore[index]
    elif isinstance(want, np.ndarray):
        assert_array_equal(got, want, what=what)  # type: ignore[arg-type]
    else:
        assert_equal_values(got, want, what=what)


@pytest.mark.spec("state_dict.loads.api_options")
@PROPERTY
@given(data=st.data())
def test_the_state_dict_functions_one_by_one_agree_with_get_and_set_state_dict(
    world: World, data: st.DataObject
) -> None:
    case = data.draw(api_options_cases(world.world_size), label="case")
    parity.attach(case.call())
    for rank, seen in enumerate(world.run(loads_api.api_options_on_rank, case)):
        where = f"with {case.options()} on rank {rank}"
        _assert_same_tree(seen.separate[0], seen.joint[0], f"get_model_state_dict {where}")
        _assert_same_tree(seen.separate[1], seen.joint[1], f"get_optimizer_state_dict {where}")
        if seen.set_jointly is None or seen.set_separately is None:
            continue  # a submodule's state dicts: not the model's to set
        what = f"the trained state set {where}"
        checks_sd.assert_same_state(
            seen.set_jointly, seen.trained, what=f"{what} by set_state_dict"
        )
        by_two = "set_model_state_dict + set_optimizer_state_dict"
        checks_sd.assert_same_state(seen.set_separately, seen.trained, what=f"{what} by {by_two}")
