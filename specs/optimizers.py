"""Reference model of one ``torch.optim`` step on numpy arrays: SGD, Adam and AdamW here,
the other adaptive optimizers in ``specs.adaptive_optimizers``.

The update rules are the algorithms of the torch.optim documentation (the pseudo-code of
``SGD``, ``Adam`` and ``AdamW``), written once, element-wise and without any of torch's
implementation choices (single-tensor, foreach or fused kernels, ``lerp`` or multiply-add):

- SGD: ``g = ±grad + wd*p``; with momentum the buffer starts as ``g`` and then becomes
  ``momentum*buf + (1-dampening)*g``; Nesterov steps along ``g + momentum*buf``, plain
  momentum along ``buf``; ``p -= lr*step``. ``maximize`` negates the gradient first.
- Adam: ``t += 1``; ``g = ±grad + wd*p`` (AdamW, and Adam with ``decoupled_weight_decay``,
  instead multiplies ``p`` by ``1 - lr*wd``);
  ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*g²``; AMSGrad keeps the running maximum of
  ``v``; ``p -= lr/(1-b1^t) * m / (sqrt(v̂)/sqrt(1-b2^t) + eps)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harness.errors import check_one_of, fail
from specs import adaptive_optimizers

_DEFAULTS: dict[str, dict[str, Any]] = {
    "SGD": {"momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0},
    "Adam": {
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
        "amsgrad": False,
        "decoupled_weight_decay": False,
    },
    "AdamW": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "amsgrad": False},
    **adaptive_optimizers.DEFAULTS,
}
OPTIMIZERS = tuple(_DEFAULTS)
"""The optimizers modelled: SGD, Adam, AdamW here, the others in ``adaptive_optimizers``."""
# differentiable (autograd records the step) changes none of the algorithm's values
_COMMON = {"lr", "maximize", "differentiable"}


@dataclass
class OptimizerModel:
    """An optimizer over a list of parameters: ``step`` updates them in place, in float64."""

    name: str
    lr: float
    options: Mapping[str, Any] = field(default_factory=dict)
    state: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_one_of("name", self.name, OPTIMIZERS)
        takes = set(_DEFAULTS[self.name]) | _COMMON
        if unknown := sorted(set(self.options) - takes):
            expected = f"keywords {self.name} takes ({sorted(takes)}), without {unknown}"
            fail("options", dict(self.options), expected)
        self.options = {**_DEFAULTS[self.name], "maximize": False, **self.options}

    def step(self, params: Sequence[np.ndarray], grads: Sequence[np.ndarray | None]) -> None:
        """Each parameter stepped by its gradient; one without (None) is skipped, its state
        untouched (its step count stays behind), as torch.optim skips a ``grad`` of None."""
        if len(params) != len(grads):
            fail("len(grads)", len(grads), f"one grad per param, len(params)={len(params)}")
        while len(self.state) < len(params):
            self.state.append({})
        for param, grad, state in zip(params, grads, self.state, strict=False):
            if grad is None:
                continue
            if param.shape != grad.shape:
                fail("grad.shape", grad.shape, f"the param's shape {param.shape}")
            param[...] = self._rule(param, grad, state)

    def _rule(self, param: np.ndarray, grad: np.ndarray, state: dict[str, Any]) -> np.ndarray:
        if self.name == "SGD":
            return _sgd(param, grad, state, self.name, self.lr, self.options)
        if self.name in ("Adam", "AdamW"):
            return _adam(param, grad, state, self.name, self.lr, self.options)
        return adaptive_optimizers.RULES[self.name](param, grad, state, self.lr, self.options)


def _signed(grad: np.ndarray, options: Mapping[str, Any]) -> np.ndarray:
    return -grad if options["maximize"] else grad


def _sgd(
    param: np.ndarray,
    grad: np.ndarray,
    state: dict[str, Any],
    name: str,
    lr: float,
    options: Mapping[str, Any],
) -> np.ndarray:
    g = _signed(grad, options) + options["weight_decay"] * param
    momentum = options["momentum"]
    if momentum != 0:
        if "buf" not in state:
            state["buf"] = g.copy()
        else:
            state["buf"] = momentum * state["buf"] + (1 - options["dampening"]) * g
        g = g + momentum * state["buf"] if options["nesterov"] else state["buf"]
    stepped: np.ndarray = param - lr * g
    return stepped


def _adam(
    param: np.ndarray,
    grad: np.ndarray,
    state: dict[str, Any],
    name: str,
    lr: float,
    options: Mapping[str, Any],
) -> np.ndarray:
    beta1, beta2 = options["betas"]
    weight_decay = options["weight_decay"]
    if not state:
        state.update(t=0, m=np.zeros_like(param), v=np.zeros_like(param))
        state["v_max"] = np.zeros_like(param)
    state["t"] += 1
    g = _signed(grad, options)
    if name == "AdamW" or options.get("decoupled_weight_decay", False):
        param = param * (1 - lr * weight_decay)
    else:
        g = g + weight_decay * param
    state["m"] = beta1 * state["m"] + (1 - beta1) * g
    state["v"] = beta2 * state["v"] + (1 - beta2) * g * g
    second = state["v"]
    if options["amsgrad"]:
        state["v_max"] = second = np.maximum(state["v_max"], state["v"])
    t = state["t"]
    denom = np.sqrt(second) / np.sqrt(1 - beta2**t) + options["eps"]
    stepped: np.ndarray = param - lr / (1 - beta1**t) * state["m"] / denom
    return stepped
