"""Rank functions for the ZeroRedundancyOptimizer suite, and their single-device references.

Parameters and gradients come from seeds and are the same on every rank (as if the
gradients were already averaged), so each rank's result can be compared with one
``torch.optim`` optimizer stepping the same tensors on one device.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from harness import RankContext
from harness.cases.training import OptimConfig, ParamsCase, PartitionCase
from harness.cases.zero import FrozenGroupsCase
from harness.torchkit.dtensor import to_numpy


def optimizer_class(config: OptimConfig) -> type[torch.optim.Optimizer]:
    cls: type[torch.optim.Optimizer] = getattr(torch.optim, config.name)
    return cls


def seeded_params(case: ParamsCase, device: torch.device) -> list[torch.Tensor]:
    rng = np.random.default_rng([case.seed, 0])
    return [
        torch.tensor(rng.uniform(-1, 1, size=shape), device=device, requires_grad=True)
        for shape in case.shapes
    ]


def set_grads(params: list[torch.Tensor], case: ParamsCase, step: int) -> None:
    rng = np.random.default_rng([case.seed, 1, step])
    for param in params:
        values = rng.uniform(-1, 1, size=tuple(param.shape))
        param.grad = torch.tensor(values, device=param.device)


def zero_of(
    params: list[torch.Tensor], config: OptimConfig, cls: type[Any] | None = None, **extra: Any
) -> ZeroRedundancyOptimizer:
    kwargs = {**config.kwargs(), **extra}
    return ZeroRedundancyOptimizer(params, optimizer_class=cls or optimizer_class(config), **kwargs)


# --- state dict ------------------------------------------------------------------------


@dataclass(frozen=True)
class StateDictView:
    """What one rank saw of consolidate → state_dict → load → train on."""

    error: str | None
    """The RuntimeError ``state_dict()`` raised (non-recipient ranks)."""
    groups: list[dict[str, Any]] | None
    """The recipient's state-dict param groups, tensors as numpy."""
    groups_in_sync: bool | None
    state: dict[int, dict[str, Any]] | None
    lr_after_load: float
    params: list[np.ndarray]


def zero_state_dict_on_rank(ctx: RankContext, case: ParamsCase) -> StateDictView:
    params = seeded_params(case, ctx.device)
    zero = zero_of(params, case.optim)
    for step in range(case.steps):
        set_grads(params, case, step)
        zero.step()
    zero.zero_grad()
    zero.consolidate_state_dict(to=case.recipient)
    try:
        state_dict, error = zero.state_dict(), None
    except RuntimeError as exc:
        state_dict, error = None, str(exc)
    # Snapshot now: load_state_dict below may alias these tensors and step them in place.
    snapshot = _plain(state_dict) if state_dict else None
    in_sync = _in_sync(state_dict, zero) if state_dict else None
    shared = [state_dict]
    dist.broadcast_object_list(shared, src=case.recipient)
    reloaded = zero_of(params, case.optim, lr=case.lr_after_load)
    assert shared[0] is not None, "broadcast from the recipient, which holds the state"
    reloaded.load_state_dict(shared[0])
    lr_after_load = float(reloaded.param_groups[0]["lr"])
    for step in range(case.steps, case.steps + case.steps_after):
        set_grads(params, case, step)
        reloaded.step()
    return StateDictView(
        error=error,
        groups=snapshot["param_groups"] if snapshot else None,
        groups_in_sync=in_sync,
        state=snapshot["state"] if snapshot else None,
        lr_after_load=lr_after_load,
        params=[to_numpy(p) for p in params],
    )


def _in_sync(state_dict: dict[str, Any], zero: ZeroRedundancyOptimizer) -> bool:
    """The state dict's hyper-parameters are the ones ``zero.param_groups`` exposes."""
    return all(
        group[key] == exposed[key]
        for group, exposed in zip(state_dict["param_groups"], zero.param_groups, strict=True)
        for key in group
        if key != "params"
    )


def _plain(value: Any) -> Any:
    """Tensors as numpy, containers kept: picklable and comparable in the driver."""
    if isinstance(value, torch.Tensor):
        return to_numpy(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    return value


def reference_state(case: ParamsCase) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The state dict after ``steps`` steps and the parameters after all the steps, from
    one ``torch.optim`` optimizer on one device (the reload is transparent to it)."""
    params = seeded_params(case, torch.device("cpu"))
    optimizer = optimizer_class(case.optim)(params, **case.optim.kwargs())
    state: dict[str, Any] = {}
    for step in range(case.steps + case.steps_after):
        set_grads(params, case, step)
        optimizer.step()
        if step == case.steps - 1:
            state = _plain(optimizer.state_dict())
    return state, [to_numpy(p) for p in params]


def reference_steps(case: ParamsCase, *, closure_loss: bool = False) -> list[np.ndarray]:
    """Parameters after ``steps`` steps of the configured optimizer on one device."""
    params = seeded_params(case, torch.device("cpu"))
    optimizer = optimizer_class(case.optim)(params, **case.optim.kwargs())
    for step in range(case.steps):
        set_grads(params, case, step)
        optimizer.step()
    return [to_numpy(p) for p in params]


# --- step interface --------------------------------------------------------------------


class SGDWithStepKwarg(torch.optim.SGD):
    """An optimizer whose ``step`` takes an extra keyword argument."""

    def step(self, closure: Any = None, kwarg: list[int] | None = None) -> Any:
        loss = super().step(closure)
        assert kwarg is not None
        kwarg.append(5)
        return loss


class SGDWithNewKey(torch.optim.SGD):
    """An optimizer that adds a key to its first parameter group when it steps."""

    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        self.param_groups[0]["new_key"] = 0.1
        return loss


class SGDWithoutClosure(torch.optim.SGD):
    """An optimizer whose ``step`` takes no closure at all."""

    def step(self) -> Any:  # type: ignore[override]  # no closure, on purpose
        return super().step()


STEP_VARIANTS: dict[str, type[torch.optim.SGD]] = {
    "kwarg": SGDWithStepKwarg,
    "new_key": SGDWithNewKey,
    "no_closure": SGDWithoutClosure,
}


def zero_step_variant_on_rank(ctx: RankContext, case: ParamsCase, variant: str) -> dict[str, Any]:
    """Step ZeRO wrapping an SGD subclass with an unusual ``step``; what it exposed."""
    params = seeded_params(case, ctx.device)
    zero = zero_of(params, case.optim, cls=STEP_VARIANTS[variant])
    seen: list[int] = []
    for step in range(case.steps):
        set_grads(params, case, step)
        zero.step(kwarg=seen) if variant == "kwarg" else zero.step()
    return {
        "kwarg": seen,
        "new_key": zero.param_groups[0].get("new_key"),
        "params": [to_numpy(p) for p in params],
    }


def _weights(case: ParamsCase) -> list[torch.Tensor]:
    rng = np.random.default_rng([case.seed, 2])
    return [torch.tensor(rng.uniform(-1, 1, size=shape)) for shape in case.shapes]


def closure_for(
    params: list[torch.Tensor], weights: list[torch.Tensor], zero_grad: Callable[[], None]
) -> Callable[[], torch.Tensor]:
    """``sum(p * w)`` over the parameters, its backward, its value."""

    def closure() -> torch.Tensor:
        zero_grad()
        loss = sum(
            ((p * w.to(p.device)).sum() for p, w in zip(params, weights, strict=True)),
            torch.zeros((), dtype=torch.float64, device=params[0].device),
        )
        loss.backward()
        return loss

    return closure


def zero_closure_on_rank(
    ctx: RankContext, case: ParamsCase, bucket_view: bool
) -> tuple[list[float], list[np.ndarray]]:
    params = seeded_params(case, ctx.device)
    zero = zero_of(params, case.optim, parameters_as_bucket_view=bucket_view)
    closure = closure_for(params, _weights(case), zero.zero_grad)
    losses = [float(zero.step(closure=closure)) for _ in range(case.steps)]  # type: ignore[arg-type]
    return losses, [to_numpy(p) for p in params]


def reference_closure(case: ParamsCase) -> tuple[list[float], list[np.ndarray]]:
    params = seeded_params(case, torch.device("cpu"))
    optimizer = optimizer_class(case.optim)(params, **case.optim.kwargs())
    closure = closure_for(params, _weights(case), optimizer.zero_grad)
    losses = [float(optimizer.step(closure=closure)) for _ in range(case.steps)]  # type: ignore[arg-type]
    return losses, [to_numpy(p) for p in params]


def zero_grad_on_rank(ctx: RankContext, case: ParamsCase) -> list[tuple[bool, bool]]:
    """For every parameter: whether it had a gradient before ``zero_grad``, and after."""
    params = seeded_params(case, ctx.device)
    zero = zero_of(params, case.optim)
    set_grads(params, case, 0)
    before = [p.grad is not None for p in params]
    zero.zero_grad()
    return [(b, p.grad is not None) for b, p in zip(before, params, strict=True)]


# --- construction and partition ----------------------------------------------------------


def _sparse() -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.empty((2, 0), dtype=torch.long), torch.empty(0), (2, 3))


def constructor_outcomes_on_rank(ctx: RankContext, dims: tuple[int, ...]) -> dict[str, str]:
    """The exception class (or "ok") of ZeRO built from each kind of ``params``."""
    layers = [torch.nn.Linear(a, b) for a, b in itertools.pairwise(dims)]
    params = [p for layer in layers for p in layer.parameters()]
    inputs: dict[str, Callable[[], Any]] = {
        "empty list": lambda: [],
        "a tensor": lambda: torch.zeros(1),
        "a float": lambda: 1.2,
        "a list with an int": lambda: [*params, 42],
        "parameter groups": lambda: [
            {"params": [layer.weight for layer in layers]},
            {"params": [layer.bias for layer in layers]},
        ],
        "a generator": lambda: (p for p in params),
        "a list": lambda: list(params),
        "a sparse tensor": lambda: [_sparse()],
        "float32 and float64": lambda: [torch.zeros(1), torch.zeros(1, dtype=torch.float64)],
        "dense then sparse": lambda: [
            torch.zeros(1),
            torch.zeros(1),
            _sparse(),
        ],
    }
    outcomes = {}
    for name, make in inputs.items():
        try:
            zero = ZeroRedundancyOptimizer(make(), optimizer_class=torch.optim.SGD, lr=0.01)
        except Exception as exc:
            outcomes[name] = type(exc).__name__
        else:
            outcomes[name] = (
                f"ok: {len(zero.param_groups)} group(s), local {len(zero.optim.param_groups)}"
            )
    return outcomes


def partition_on_rank(ctx: RankContext, case: PartitionCase) -> dict[str, Any]:
    """Which parameters (indices within their group) this rank's local optimizer holds."""
    groups = [[torch.zeros(n, requires_grad=True) for n in sizes] for sizes in case.all_groups()]
    zero = ZeroRedundancyOptimizer(
        [{"params": g} for g in groups[: len(case.groups)]],
        optimizer_class=torch.optim.SGD,
        lr=0.01,
    )
    if case.added is not None:
        zero.add_param_group({"params": groups[-1]})
    index = {id(p): (g, i) for g, group in enumerate(groups) for i, p in enumerate(group)}
    owned: list[list[int]] = [[] for _ in groups]
    for local in zero.optim.param_groups:
        for param in local["params"]:
            g, i = index[id(param)]
            owned[g].append(i)
    return {
        "owned": [sorted(indices) for indices in owned],
        "groups": len(zero.param_groups),
        "local_groups": len(zero.optim.param_groups),
    }


def load_keeps_argument_on_rank(ctx: RankContext, case: ParamsCase) -> tuple[Any, Any]:
    """A consolidated state dict before and after ``load_state_dict`` read it, as plain data."""
    params = seeded_params(case, ctx.device)
    zero = zero_of(params, case.optim)
    for step in range(case.steps):
        set_grads(params, case, step)
        zero.step()
    zero.consolidate_state_dict(to=case.recipient)
    shared = [zero.state_dict() if ctx.rank == case.recipient else None]
    dist.broadcast_object_list(shared, src=case.recipient)
    state_dict = shared[0]
    assert state_dict is not None, "broadcast from the recipient, which holds the state"
    before = _plain(state_dict)
    zero_of(params, case.optim).load_state_dict(state_dict)
    return before, _plain(state_dict)


# --- parameter groups with frozen parameters -----------------------------------------------


def _frozen_params(case: FrozenGroupsCase, device: torch.device) -> list[list[torch.Tensor]]:
    rng = np.random.default_rng([case.seed, 3])
    return [
        [
            torch.tensor(rng.uniform(-1, 1, size=shape), device=device).requires_grad_(not off)
            for shape, off in zip(group, frozen, strict=True)
        ]
        for group, frozen in zip(case.groups, case.frozen, strict=True)
    ]


def _frozen_groups(
    case: FrozenGroupsCase, params: list[list[torch.Tensor]]
) -> list[dict[str, Any]]:
    return [
        {"params": group, "lr": case.optim.lr * scale}
        for group, scale in zip(params, case.lr_scales, strict=True)
    ]


def _frozen_step(
    case: FrozenGroupsCase, params: list[list[torch.Tensor]], step: int, optimizer: Any
) -> None:
    """Freeze what ``step`` freezes, give every trainable parameter its seeded gradient and
    every frozen one none (as backward would), and step."""
    rng = np.random.default_rng([case.seed, 4, step])
    for group, frozen in zip(params, case.frozen_at(step), strict=True):
        for param, off in zip(group, frozen, strict=True):
            values = rng.uniform(-1, 1, size=tuple(param.shape))
            param.requires_grad_(not off)
            param.grad = None if off else torch.tensor(values, device=param.device)
    optimizer.step()


def zero_frozen_on_rank(ctx: RankContext, case: FrozenGroupsCase) -> list[np.ndarray]:
    """ZeRO over the case's groups, frozen parameters included; every parameter after the
    steps, groups flattened in order."""
    params = _frozen_params(case, ctx.device)
    zero = ZeroRedundancyOptimizer(
        _frozen_groups(case, params),
        optimizer_class=optimizer_class(case.optim),
        parameters_as_bucket_view=case.bucket_view,
        **case.optim.kwargs(),
    )
    for step in range(case.steps):
        _frozen_step(case, params, step, zero)
    return [to_numpy(p) for group in params for p in group]


def reference_frozen(case: FrozenGroupsCase) -> list[np.ndarray]:
    """The same steps with the ``torch.optim`` optimizer on one device."""
    params = _frozen_params(case, torch.device("cpu"))
    optimizer = optimizer_class(case.optim)(_frozen_groups(case, params), **case.optim.kwargs())
    for step in range(case.steps):
        _frozen_step(case, params, step, optimizer)
    return [to_numpy(p) for group in params for p in group]
