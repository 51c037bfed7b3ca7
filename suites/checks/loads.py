"""Rank functions of the checkpoint-loads suite: loads given what does not fit the model
(keys missing or unexpected, another shape or dtype), the StateDictOptions that choose a
state dict's keys, and a save that fails on one rank. The driver-side reads of a checkpoint
without a process group are here too (``read_*``): they touch torch, the suite does not.

Every model is an untrained ``build_mlp`` under the case's layout: a fresh model is one of
another seed, so whatever a load leaves out shows. Values go back as numpy arrays.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.nn.parallel import DistributedDataParallel

from harness import RankContext
from harness.cases.loads import (
    BUFFER,
    FailedSaveCase,
    KeyOptionsCase,
    MismatchCase,
    StrictSetCase,
)
from harness.cases.state_dict import StateDictCase
from harness.torchkit.models import build_keyed_mlp, build_mlp
from harness.torchkit.training import parallelize
from suites.checks.state_dict import _full, build, fsdp_options
from suites.checks.state_dict_full import plain

Values = dict[str, np.ndarray]


def model_of(ctx: RankContext, case: StateDictCase, frozen: tuple[str, ...] = ()) -> nn.Module:
    """The case's MLP (its seed, untrained) under its layout, ``frozen`` parameters set to
    ``requires_grad=False`` before it is sharded."""
    model = build_mlp(case.train, ctx.device)
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    wrapped, _ = parallelize(model, case.train, ctx, **fsdp_options(case))
    return wrapped


def values_of(model: nn.Module) -> Values:
    """Every parameter's full value (a collective on sharded ones)."""
    return {name: _full(param) for name, param in model.named_parameters()}


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def save_model_on_rank(ctx: RankContext, case: StateDictCase, directory: str) -> Values:
    """``dcp.save`` of the model's (sharded) state dict; the values saved."""
    model = model_of(ctx, case)
    dcp_save(get_model_state_dict(model), checkpoint_id=directory)
    return values_of(model)


@dataclass(frozen=True)
class Loaded:
    """A load into a fresh model: what it raised, the model's values before and after."""

    error: str | None
    fresh: Values
    loaded: Values
    dtypes: dict[str, str]


def _load_into(
    model: nn.Module, directory: str, planner: DefaultLoadPlanner | None = None
) -> str | None:
    """``dcp.load`` into the model's own state dict (in place), then set it; the error."""
    try:
        state_dict = get_model_state_dict(model)
        dcp_load(state_dict, checkpoint_id=directory, planner=planner)
        set_model_state_dict(model, state_dict)
    except (Exception, CheckpointException) as exc:  # a BaseException, wrapping every rank's
        return error_text(exc)
    return None


def _loaded(model: nn.Module, fresh: Values, error: str | None) -> Loaded:
    dtypes = {
        name: str(param.dtype).removeprefix("torch.") for name, param in model.named_parameters()
    }
    return Loaded(error, fresh, values_of(model), dtypes)


def load_model_on_rank(
    ctx: RankContext, case: StateDictCase, directory: str, partial: bool = False
) -> Loaded:
    """``dcp.load`` of ``directory`` into the case's model (the default planner, or
    ``DefaultLoadPlanner(allow_partial_load=True)``)."""
    model = model_of(ctx, case)
    fresh = values_of(model)
    planner = DefaultLoadPlanner(allow_partial_load=True) if partial else None
    return _loaded(model, fresh, _load_into(model, directory, planner))


# --- strict and non-strict set_*state_dict ---------------------------------------------------


@dataclass(frozen=True)
class StrictSet:
    """The state dict given, and what setting it into the changed model did."""

    saved: Values
    result: Loaded
    incompatible: tuple[list[str], list[str]] | None
    """The returned (missing, unexpected) keys; None where it raised."""


def strict_set_on_rank(ctx: RankContext, case: StrictSetCase) -> StrictSet:
    source = model_of(ctx, case.case)
    state_dict = get_model_state_dict(source, options=StateDictOptions(full_state_dict=case.full))
    saved = values_of(source)
    model = model_of(ctx, case.loading)
    fresh = values_of(model)
    options = StateDictOptions(
        full_state_dict=case.full, strict=case.strict, broadcast_from_rank0=case.broadcast
    )
    if case.broadcast and ctx.rank != 0:
        state_dict = {}  # broadcast_from_rank0's docs: rank 0 holds the full state dict
    try:
        if case.joint:
            keys = set_state_dict(
                model, [], model_state_dict=state_dict, optim_state_dict={}, options=options
            )
        else:
            keys = set_model_state_dict(model, state_dict, options=options)
    except Exception as exc:
        return StrictSet(saved, _loaded(model, fresh, error_text(exc)), None)
    incompatible = (sorted(keys.missing_keys), sorted(keys.unexpected_keys))
    return StrictSet(saved, _loaded(model, fresh, None), incompatible)


# --- another shape or dtype -------------------------------------------------------------------


def mismatch_set_on_rank(ctx: RankContext, case: MismatchCase) -> tuple[Values, Loaded]:
    """``set_model_state_dict`` of the saving model's full or sharded state dict into the
    mismatched model on the same ranks; (the values given, the load)."""
    source = model_of(ctx, case.reshard.save)
    full = StateDictOptions(full_state_dict=case.via == "set_full")
    state_dict = get_model_state_dict(source, options=full)
    model = model_of(ctx, case.loading)
    fresh = values_of(model)
    try:
        set_model_state_dict(model, state_dict, options=full)
        error = None
    except Exception as exc:
        error = error_text(exc)
    return values_of(source), _loaded(model, fresh, error)


# --- StateDictOptions --------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyOptionsSeen:
    """What ``get_model_state_dict`` gave (keys, values, devices of its tensors), the load
    of it into a fresh model (values by key, before and after), and the keys and values of
    the submodule's state dict (empty where the case takes none)."""

    keys: list[str]
    values: dict[str, Any]
    devices: set[str]
    set_error: str | None
    incompatible: tuple[list[str], list[str]] | None
    fresh: Values
    loaded: Values
    submodule_keys: list[str]
    submodule_values: dict[str, Any]


def keyed_model(ctx: RankContext, case: KeyOptionsCase, seeded: StateDictCase) -> nn.Module:
    """``seeded``'s MLP named and holding a buffer as ``case`` says, its frozen parameters
    set to ``requires_grad=False``, under its layout or DDP."""
    train = seeded.train
    model = build_keyed_mlp(train, ctx.device, case.names, BUFFER if case.buffer else None)
    for name in case.frozen:
        model.get_parameter(name).requires_grad_(False)
    if case.wrapper == "ddp":
        return DistributedDataParallel(model)
    wrapped, _ = parallelize(model, train, ctx, **fsdp_options(seeded))
    return wrapped


def keyed_values(model: nn.Module) -> Values:
    """Every entry of the model's own state dict (parameters and buffers, a DDP's without
    its ``module.``) as a full value."""
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return {name: _full(value) for name, value in inner.state_dict().items()}


def key_options_on_rank(ctx: RankContext, case: KeyOptionsCase) -> KeyOptionsSeen:
    model = keyed_model(ctx, case, case.case)
    options = StateDictOptions(
        full_state_dict=case.full,
        cpu_offload=case.cpu_offload,
        ignore_frozen_params=case.ignore_frozen,
    )
    state_dict = get_model_state_dict(model, options=options)
    devices = {v.device.type for v in state_dict.values() if isinstance(v, torch.Tensor)}
    keys, values = list(state_dict), plain(state_dict)
    sub_keys: list[str] = []
    sub_values: dict[str, Any] = {}
    if case.submodule is not None:
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        submodule = inner.get_submodule(case.names[case.submodule])
        sub_options = StateDictOptions(
            full_state_dict=case.full,
            cpu_offload=case.cpu_offload,
            ignore_frozen_params=case.submodule_ignores_frozen,
            keep_submodule_prefixes=case.keep_prefixes,
        )
        sub = get_model_state_dict(model, submodules={submodule}, options=sub_options)
        sub_keys, sub_values = list(sub), plain(sub)
    if case.full and case.cpu_offload:
        # a full state dict offloaded to the CPU is rank 0's alone (set it with
        # broadcast_from_rank0: the full suite's spec)
        return KeyOptionsSeen(keys, values, devices, None, None, {}, {}, sub_keys, sub_values)
    target = keyed_model(ctx, case, fresh_case(case.case))
    fresh = keyed_values(target)
    setting = StateDictOptions(full_state_dict=case.full, strict=case.strict)
    error, incompatible = None, None
    try:
        result = set_model_state_dict(target, state_dict, options=setting)
        incompatible = (sorted(result.missing_keys), sorted(result.unexpected_keys))
    except Exception as exc:
        error = error_text(exc)
    return KeyOptionsSeen(
        keys,
        values,
        devices,
        error,
        incompatible,
        fresh,
        keyed_values(target),
        sub_keys,
        sub_values,
    )


def fresh_case(case: StateDictCase) -> StateDictCase:
    """``case`` from another seed."""
    return replace(case, train=replace(case.train, seed=(case.train.seed + 1) % 2**32))


# --- a save that fails --------------------------------------------------------------------------


class FailingWriter(FileSystemWriter):
    """A ``FileSystemWriter`` whose ``write_data`` raises ``OSError`` where ``fails``: a rank
    whose storage fails mid-save (as root, an unwritable directory is no such failure)."""

    def __init__(self, path: str, *, fails: bool) -> None:
        super().__init__(path)
        self.fails = fails

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.fails:
            raise OSError("injected: no space left on device")
        return super().write_data(plan, planner)


@dataclass(frozen=True)
class SaveFailure:
    """What the failing save raised on one rank: its type, the ranks a CheckpointException
    names as failed, and its text (None, None, None: it raised nothing)."""

    kind: str | None
    failed_ranks: list[int] | None
    text: str | None


def failing_save_on_rank(ctx: RankContext, case: FailedSaveCase, directory: str) -> SaveFailure:
    model = model_of(ctx, case.second)
    writer = FailingWriter(directory, fails=ctx.rank == case.failing_rank)
    try:
        dcp_save(get_model_state_dict(model), storage_writer=writer)
    except CheckpointException as exc:
        return SaveFailure(type(exc).__name__, sorted(exc.failures), error_text(exc))
    except Exception as exc:
        return SaveFailure(type(exc).__name__, None, error_text(exc))
    return SaveFailure(None, None, None)


# --- without a process group (driver side) -----------------------------------------------------


def save_trained_on_rank(ctx: RankContext, case: StateDictCase, directory: str) -> Leaves:
    """One training step (the optimizer then holds state), then ``dcp.save`` of
    ``{"model": ..., "optim": ...}`` as ``get_state_dict`` gives them; every leaf saved."""
    sharded = build(ctx, case)
    sharded.train(ctx, 0, 1)
    model_sd, optim_sd = get_state_dict(sharded.model, sharded.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp_save(state, checkpoint_id=directory)
    return leaves(state)


Leaves = dict[str, Any]
"""A nested state dict's leaves by dotted path: tensors as full numpy values, the rest (an
optimizer's steps, hyper-parameters and parameter names) as they are."""


def leaves(state: Any, prefix: str = "") -> Leaves:
    """``state``'s leaves (a DTensor's full value is a collective: every rank calls alike)."""
    if isinstance(state, dict):
        items: Any = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        value = _full(state) if isinstance(state, torch.Tensor) else state
        return {prefix: value}
    found: Leaves = {}
    for key, value in items:
        found.update(leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


def model_values(saved: Leaves) -> Values:
    """The model's parameters among a saved training state's leaves, by parameter name."""
    return {k.removeprefix("model."): v for k, v in saved.items() if k.startswith("model.")}


def read_without_group(directory: str, like: Values) -> Values:
    """``dcp.load(no_dist=True)`` of a training state's model into plain zero tensors of
    ``like``'s shapes and dtypes."""
    model = {k: torch.zeros(v.shape, dtype=_dtype(v)) for k, v in like.items()}
    dcp_load({"model": model}, checkpoint_id=directory, no_dist=True)
    return {k: v.numpy() for k, v in model.items()}


def read_as_torch_save(directory: str, path: str) -> Leaves:
    """``dcp_to_torch_save(directory, path)``, then ``torch.load(path)``: every leaf."""
    dcp_to_torch_save(directory, path)
    return leaves(torch.load(path, weights_only=True))


def write_from_torch_save(like: Values, path: str, directory: str) -> None:
    """``torch.save`` of ``like`` as tensors at ``path``, then ``torch_save_to_dcp``."""
    torch.save({k: torch.from_numpy(v.copy()) for k, v in like.items()}, path)
    torch_save_to_dcp(path, directory)


def _dtype(array: np.ndarray) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=array.dtype)).dtype


def metadata_exists(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, ".metadata"))
