"""Rank functions of the state-dict suite: build and train a sharded MLP, take its state the
ways torch offers, load it into a freshly initialised one, and hand the driver plain values.

A fresh model is initialised from another seed and its optimizer built with another lr, so
a load that leaves anything out shows as a difference. Training batches always come from
the case's own seed: the fresh model continues on the batches the original would see.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor, Shard

from harness import RankContext
from harness.cases.state_dict import StateDictCase
from harness.cases.training import OptimConfig, ParityCase
from harness.parity import assert_array_equal, assert_close, assert_equal_values
from harness.torchkit.dtensor import tensor_from, to_numpy
from harness.torchkit.models import build_mlp
from harness.torchkit.optim import rows_of, step_batch
from harness.torchkit.training import optimizer_for, parallelize, train_step

FRESH_LR_FACTOR = 10.0
"""A fresh optimizer's lr (in every group) is the case's times this: loading must restore
the case's."""
FRESH_WEIGHT_DECAY = 0.03
"""Added to a fresh optimizer's weight decay in every group, likewise."""


# --- building and snapshots -------------------------------------------------------------


def largest_dim(shard_size: int, param: nn.Parameter) -> Shard:
    """Upstream's ``_shard_placement_fn``: the largest dim (the first of equal ones) when the
    shard axis divides it, else dim 0 (torch 2.13 refuses uneven shards on other dims)."""
    dim = max(range(param.ndim), key=lambda d: param.shape[d])
    return Shard(dim if param.shape[dim] % shard_size == 0 else 0)


def fsdp_options(case: StateDictCase) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if case.reshard_after_forward is not None:
        options["reshard_after_forward"] = case.reshard_after_forward
    if case.shard_largest_dim:
        options["shard_placement_fn"] = functools.partial(largest_dim, case.shard_size)
    if case.offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=case.pin_memory)
    return options


@dataclass
class Sharded:
    """A sharded model, its optimizer, this rank's data-parallel index, and the case whose
    batches it trains on."""

    model: nn.Module
    optimizer: Any
    dp_rank: int
    case: StateDictCase

    def train(self, ctx: RankContext, first: int, stop: int) -> list[float]:
        """Steps ``first..stop-1`` on this rank's rows of each step's batch; the losses."""
        return [
            train_step(self.model, self.optimizer, self.case.train, self.dp_rank, s, ctx.device)
            for s in range(first, stop)
        ]


def other_hyperparameters(train: ParityCase) -> OptimConfig:
    """The case's optimizer with another lr and weight decay in every parameter group."""
    optim = train.optim

    def moved(options: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
        chosen = dict(options)
        chosen["weight_decay"] = chosen.get("weight_decay", 0.0) + FRESH_WEIGHT_DECAY
        if "lr" in chosen:
            chosen["lr"] *= FRESH_LR_FACTOR
        return tuple(chosen.items())

    second = None if optim.second_group is None else moved(optim.second_group)
    return replace(
        optim, lr=optim.lr * FRESH_LR_FACTOR, options=moved(optim.options), second_group=second
    )


def fresh_training(train: ParityCase) -> ParityCase:
    """``train`` initialised from another seed, the optimizer with another lr and weight
    decay in every group: what a load must overwrite."""
    return replace(train, seed=(train.seed + 1) % 2**32, optim=other_hyperparameters(train))


def build(ctx: RankContext, case: StateDictCase, *, fresh: bool = False) -> Sharded:
    """The case's sharded model and optimizer; ``fresh``: those of ``fresh_training``."""
    train = fresh_training(case.train) if fresh else case.train
    model = build_mlp(train, ctx.device)
    wrapped, dp_rank = parallelize(model, train, ctx, **fsdp_options(case))
    return Sharded(wrapped, optimizer_for(wrapped, train), dp_rank, case)


def _full(value: Any) -> Any:
    """A DTensor's full value (a collective, on the mesh's device), a tensor's value, as
    numpy; others as they are."""
    if isinstance(value, DTensor):
        if value.device.type != value.device_mesh.device_type:  # offloaded to CPU
            value = value.to(value.device_mesh.device_type)
        return to_numpy(value.full_tensor())
    if isinstance(value, torch.Tensor):
        return to_numpy(value)
    return value


@dataclass(frozen=True)
class FullState:
    """Everything training depends on, as full values keyed by parameter name: parameters,
    optimizer state, and each parameter group's hyper-parameters with its parameters' names."""

    params: dict[str, np.ndarray]
    optim: dict[str, dict[str, Any]]
    groups: list[dict[str, Any]]


def full_state(model: nn.Module, optimizer: Any) -> FullState:
    """Read from the model and optimizer themselves (not through any state-dict API)."""
    named = list(model.named_parameters())
    names = {id(p): n for n, p in named}
    optim = {
        name: {key: _full(value) for key, value in sorted(optimizer.state[param].items())}
        for name, param in named
        if param in optimizer.state
    }
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [names[id(p)] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    return FullState({n: _full(p) for n, p in named}, optim, groups)


def state_changes(before: FullState, after: FullState) -> list[str]:
    """Every way ``after`` differs from ``before``, each said once and always alike (a
    known deviation's fingerprint is the whole list): parameters, groups, optimizer state."""
    changes = [
        f"parameter {n} changed"
        for n, v in before.params.items()
        if not _same(v, after.params.get(n))
    ]
    if _by_value(before.groups) != _by_value(after.groups):
        changes.append("parameter groups changed")
    created = {n: _shown(s) for n, s in after.optim.items() if n not in before.optim}
    if created and set(created) == set(after.params) and len(set(created.values())) == 1:
        changes.append(
            f"optimizer state created for every parameter ({next(iter(created.values()))})"
        )
    else:
        changes += [f"optimizer state created for {n} ({shown})" for n, shown in created.items()]
    changes += [f"optimizer state of {n} removed" for n in before.optim if n not in after.optim]
    for name, entry in before.optim.items():
        changes += [
            f"optimizer state {name}[{key!r}] changed"
            for key, value in entry.items()
            if not _same(value, after.optim.get(name, {}).get(key, value))
        ]
    return changes


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return (
            a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b, equal_nan=True))
        )
    return bool(a == b)


def _shown(state: dict[str, Any]) -> str:
    """An optimizer state entry in brief: scalars by value, arrays as 0 when all zero."""
    parts = []
    for key, value in sorted(state.items()):
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value.item()
        if isinstance(value, np.ndarray):
            value = "0" if not value.any() else "values"
        parts.append(f"{key}={value}")
    return ", ".join(parts)


def assert_same_state(
    got: FullState,
    want: FullState,
    *,
    what: str,
    rtol: float = 0.0,
    atol: float = 0.0,
    why: str = "",
) -> None:
    """Bit for bit by default: a state round trip moves values, it computes nothing. A
    caller comparing arithmetic done elsewhere states its tolerance and ``why``."""
    __tracebackhide__ = True
    assert_equal_values(list(got.params), list(want.params), what=f"parameters of {what}")
    tolerance = (rtol, atol, why)
    for name, value in want.params.items():
        _assert_value(got.params[name], value, f"{name} of {what}", tolerance)
    assert_equal_values(
        sorted(got.optim), sorted(want.optim), what=f"parameters with optimizer state in {what}"
    )
    for name, entry in want.optim.items():
        assert_equal_values(
            sorted(got.optim[name]), sorted(entry), what=f"optimizer state keys of {name} in {what}"
        )
        for key, value in entry.items():
            where = f"optimizer state {name}[{key!r}] of {what}"
            _assert_value(got.optim[name][key], value, where, tolerance)
    assert_equal_values(
        _by_value(got.groups), _by_value(want.groups), what=f"parameter groups of {what}"
    )


def assert_loaded_like(states: Sequence[FullState], *, what: str) -> None:
    """``states`` as ``set_full_on_rank`` gives them (original, loaded, each after the next
    step): what was loaded is the original, and the next step keeps them the same."""
    __tracebackhide__ = True
    original, loaded, original_next, loaded_next = states
    assert_same_state(loaded, original, what=what)
    assert_same_state(loaded_next, original_next, what=f"{what} after the next step")


def _by_value(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Hyper-parameters as values: a full state dict's round trip turns tuples (betas) into
    lists, which the optimizers read the same way."""
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()} for g in groups]


def _assert_value(got: Any, want: Any, what: str, tolerance: tuple[float, float, str]) -> None:
    __tracebackhide__ = True
    if not (isinstance(want, np.ndarray) and isinstance(got, np.ndarray)):
        assert_equal_values(got, want, what=what)
        return
    assert_equal_values(str(got.dtype), str(want.dtype), what=f"dtype of {what}")
    rtol, atol, why = tolerance
    if rtol == atol == 0:
        assert_array_equal(got, want, what=what)
    else:
        assert_close(got, want, rtol=rtol, atol=atol, dtype=str(want.dtype), what=what, why=why)


def _ptr(tensor: torch.Tensor) -> int | None:
    """The local storage address, None for an empty local piece (nothing to alias)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.data_ptr() if local.numel() else None


def _even(param: torch.Tensor) -> bool:
    """Every rank holds an equal piece: no padding for FSDP to re-pad on load."""
    assert isinstance(param, DTensor)
    mesh = param.device_mesh
    pieces = math.prod(mesh.size(i) for i, p in enumerate(param.placements) if p.is_shard())
    return param.to_local().numel() * pieces == param.numel()


def next_step(ctx: RankContext, sharded: Sharded) -> tuple[float, FullState]:
    """One more step (the one after the case's ``steps``) with the model's own optimizer."""
    step = sharded.case.train.steps
    (loss,) = sharded.train(ctx, step, step + 1)
    return loss, full_state(sharded.model, sharded.optimizer)


LoadedStates = tuple[FullState, FullState, FullState, FullState]
"""(original, loaded, original after the next step, loaded after the next step)."""


def loaded_states(ctx: RankContext, original: Sharded, loaded: Sharded) -> LoadedStates:
    """The states of a model and optimizer and of the fresh ones their state was set into,
    now and after each takes its next step."""
    original_state, loaded_state = (full_state(s.model, s.optimizer) for s in (original, loaded))
    return original_state, loaded_state, next_step(ctx, original)[1], next_step(ctx, loaded)[1]


# --- sharded state dict -------------------------------------------------------------------


@dataclass(frozen=True)
class RoundTrip:
    """``model.state_dict()`` of a trained model, loaded into a fresh one."""

    keys: list[str]
    param_names: list[str]
    facts: dict[str, dict[str, bool]]
    incompatible: tuple[list[str], list[str]]
    """``load_state_dict``'s (missing keys, unexpected keys)."""
    saved: dict[str, np.ndarray]
    loaded: dict[str, np.ndarray]
    next_steps: tuple[tuple[float, FullState], tuple[float, FullState]]
    """(loss, state) after a step with a new optimizer: the original model, the loaded one."""


SHARDED_FACTS = (
    "is a DTensor",
    "has the parameter's placements",
    "shares the parameter's local storage",
    "leaves the parameter in place",
    "loads into the parameter's storage (even pieces)",
)


def sharded_roundtrip_on_rank(ctx: RankContext, case: StateDictCase) -> RoundTrip:
    original = build(ctx, case)
    original.train(ctx, 0, case.train.steps)
    params = dict(original.model.named_parameters())
    before = {n: (_ptr(p), tuple(p.shape)) for n, p in params.items()}
    state_dict = original.model.state_dict()
    facts = {
        name: _sharded_facts(original.model, params, before, name, v)
        for name, v in state_dict.items()
    }
    fresh = build(ctx, case, fresh=True)
    storage = {n: _ptr(p) for n, p in fresh.model.named_parameters()}
    result = fresh.model.load_state_dict(state_dict)
    for name, param in fresh.model.named_parameters():
        kept = not _even(param) or _ptr(param) == storage[name]
        facts.setdefault(name, {})["loads into the parameter's storage (even pieces)"] = kept
    saved = {n: _full(p) for n, p in params.items()}
    loaded = {n: _full(p) for n, p in fresh.model.named_parameters()}
    steps = []
    for sharded in (original, fresh):  # the same new optimizer for both
        sharded.optimizer = optimizer_for(sharded.model, case.train)
        steps.append(next_step(ctx, sharded))
    return RoundTrip(
        keys=list(state_dict),
        param_names=list(params),
        facts=facts,
        incompatible=(list(result.missing_keys), list(result.unexpected_keys)),
        saved=saved,
        loaded=loaded,
        next_steps=(steps[0], steps[1]),
    )


def _sharded_facts(
    model: nn.Module,
    params: dict[str, nn.Parameter],
    before: dict[str, tuple[int | None, tuple[int, ...]]],
    name: str,
    value: Any,
) -> dict[str, bool]:
    param = params.get(name)
    if param is None:
        return {"is a parameter": False}
    ptr, shape = before[name]
    now = model.get_parameter(name)
    return {
        "is a DTensor": isinstance(value, DTensor),
        "has the parameter's placements": getattr(value, "placements", None)
        == getattr(param, "placements", ()),
        "shares the parameter's local storage": ptr is None or _ptr(value) == ptr,
        "leaves the parameter in place": now is param
        and isinstance(now, nn.Parameter)
        and tuple(now.shape) == shape,
    }


def _local_view(value: Any) -> tuple[str, np.ndarray, np.ndarray]:
    return str(value.placements), to_numpy(value.to_local()), _full(value)


def reshard_after_forward_on_rank(
    ctx: RankContext, case: StateDictCase
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state dict (placements, local piece, full value per key) before and after a
    forward that leaves the parameters as ``reshard_after_forward`` says."""
    sharded = build(ctx, case)
    sharded.train(ctx, 0, case.train.steps)
    before = {k: _local_view(v) for k, v in sharded.model.state_dict().items()}
    inputs, _ = step_batch(case.train, case.train.steps)
    rows = rows_of(case.train, sharded.dp_rank)
    sharded.model(tensor_from(inputs[rows], case.train.dtype, ctx.device))
    after = {k: _local_view(v) for k, v in sharded.model.state_dict().items()}
    return before, after


def cached_on_rank(ctx: RankContext, case: StateDictCase, moved: bool) -> list[dict[str, bool]]:
    """Take the state dict once, then train (or move the model off its device and back);
    after each step, per key: does the value still share the parameter's storage and hold
    its value."""
    sharded = build(ctx, case)
    state_dict = sharded.model.state_dict()
    seen = []
    if moved:
        sharded.model.cpu()
        sharded.model.to(ctx.device)
        return [_aliasing(sharded.model, state_dict)]
    for step in range(case.train.steps):
        sharded.train(ctx, step, step + 1)
        seen.append(_aliasing(sharded.model, state_dict))
    return seen


def _aliasing(model: nn.Module, state_dict: dict[str, Any]) -> dict[str, bool]:
    params = dict(model.named_parameters())
    facts = {}
    for name, value in state_dict.items():
        ptr = _ptr(params[name])
        same = ptr is None or _ptr(value) == ptr
        facts[name] = same and bool(np.array_equal(_full(value), _full(params[name])))
    return facts
