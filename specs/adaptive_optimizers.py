"""Reference models of one step of the adaptive ``torch.optim`` optimizers beyond Adam, on
numpy arrays, as the torch.optim documentation's algorithms write them (element-wise; the
state each keeps per parameter starts empty):

- Adagrad: ``g = ±grad + wd*p``; ``sum += g²`` (from ``initial_accumulator_value``);
  ``p -= lr/(1 + (t-1)*lr_decay) * g/(sqrt(sum) + eps)``.
- RMSprop: ``g = ±grad + wd*p``; ``v = alpha*v + (1-alpha)*g²``; centered also keeps
  ``a = alpha*a + (1-alpha)*g`` and divides by ``sqrt(v - a²) + eps`` instead of
  ``sqrt(v) + eps``; with momentum ``buf = momentum*buf + g/avg`` and ``p -= lr*buf``, else
  ``p -= lr*g/avg``.
- Adamax: ``g = ±grad + wd*p``; ``m = b1*m + (1-b1)*g``; ``u = max(b2*u, |g| + eps)``;
  ``p -= lr/(1-b1^t) * m/u``.
- NAdam: ``g = ±grad`` (+ ``wd*p``, or ``p *= 1 - lr*wd`` when decoupled); ``mu_t = b1*(1 -
  0.96^(t*psi)/2)``; ``prod *= mu_t`` — torch keeps that product in float32 and multiplies
  there, so the model does too; ``m``, ``v`` as Adam; ``denom = sqrt(v/(1-b2^t)) + eps``;
  ``p -= lr*(1-mu_t)/(1-prod) * g/denom + lr*mu_{t+1}/(1-prod*mu_{t+1}) * m/denom``.
- RAdam: ``g`` as NAdam; ``m``, ``v`` as Adam; ``rho_inf = 2/(1-b2) - 1``,
  ``rho_t = rho_inf - 2t*b2^t/(1-b2^t)``; past ``rho_t > 5`` the step is rectified
  (``r = sqrt((rho_t-4)(rho_t-2)rho_inf / ((rho_inf-4)(rho_inf-2)rho_t))``):
  ``p -= lr * m/(1-b1^t) * r * sqrt(1-b2^t)/(sqrt(v) + eps)``, else ``p -= lr*m/(1-b1^t)``.
- Adadelta: ``g = ±grad + wd*p``; ``v = rho*v + (1-rho)*g²``;
  ``delta = sqrt(u + eps)/sqrt(v + eps) * g``; ``u = rho*u + (1-rho)*delta²``;
  ``p -= lr*delta``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

Rule = Callable[[np.ndarray, np.ndarray, dict[str, Any], float, Mapping[str, Any]], np.ndarray]

DEFAULTS: dict[str, dict[str, Any]] = {
    "Adagrad": {"lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0,
                "eps": 1e-10},
    "RMSprop": {"alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0,
                "centered": False},
    "Adamax": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "NAdam": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
              "momentum_decay": 0.004, "decoupled_weight_decay": False},
    "RAdam": {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
              "decoupled_weight_decay": False},
    "Adadelta": {"rho": 0.9, "eps": 1e-6, "weight_decay": 0.0},
}  # fmt: skip


def _plain_decay(param: np.ndarray, grad: np.ndarray, options: Mapping[str, Any]) -> np.ndarray:
    signed = -grad if options["maximize"] else grad
    decayed: np.ndarray = signed + options["weight_decay"] * param
    return decayed


def _adagrad(
    param: np.ndarray, grad: np.ndarray, state: dict[str, Any], lr: float, o: Mapping[str, Any]
) -> np.ndarray:
    if not state:
        state.update(t=0, sum=np.full_like(param, o["initial_accumulator_value"]))
    state["t"] += 1
    g = _plain_decay(param, grad, o)
    state["sum"] = state["sum"] + g * g
    step_size = lr / (1 + (state["t"] - 1) * o["lr_decay"])
    stepped: np.ndarray = param - step_size * g / (np.sqrt(state["sum"]) + o["eps"])
    return stepped


def _rmsprop(
    param: np.ndarray, grad: np.ndarray, state: dict[str, Any], lr: float, o: Mapping[str, Any]
) -> np.ndarray:
    if not state:
        state.update(v=np.zeros_like(param), a=np.zeros_like(param), buf=np.zeros_like(param))
    g = _plain_decay(param, grad, o)
    alpha = o["alpha"]
    state["v"] = alpha * state["v"] + (1 - alpha) * g * g
    if o["centered"]:
        state["a"] = alpha * state["a"] + (1 - alpha) * g
        avg = np.sqrt(state["v"] - state["a"] ** 2) + o["eps"]
    else:
        avg = np.sqrt(state["v"]) + o["eps"]
    if o["momentum"] > 0:
        state["buf"] = o["momentum"] * state["buf"] + g / avg
        stepped: np.ndarray = param - lr * state["buf"]
        return stepped
    plain: np.ndarray = param - lr * g / avg
    return plain


def _adamax(
    param: np.ndarray, grad: np.ndarray, state: dict[str, Any], lr: float, o: Mapping[str, Any]
) -> np.ndarray:
    if not state:
        state.update(t=0, m=np.zeros_like(param), u=np.zeros_like(param))
    state["t"] += 1
    beta1, beta2 = o["betas"]
    g = _plain_decay(param, grad, o)
    state["m"] = beta1 * state["m"] + (1 - beta1) * g
    state["u"] = np.maximum(beta2 * state["u"], np.abs(g) + o["eps"])
    stepped: np.ndarray = param - lr / (1 - beta1 ** state["t"]) * state["m"] / state["u"]
    return stepped


def _moments(
    param: np.ndarray, grad: np.ndarray, state: dict[str, Any], lr: float, o: Mapping[str, Any]
) -> tuple[np.ndarray, np.ndarray]:
    """NAdam's and RAdam's shared start: the step count, the gradient after weight decay (or
    the parameter decayed), and Adam's two moments. Returns the parameter and gradient."""
    if not state:
        state.update(t=0, m=np.zeros_like(param), v=np.zeros_like(param), prod=1.0)
    state["t"] += 1
    beta1, beta2 = o["betas"]
    g = -grad if o["maximize"] else grad
    if o["decoupled_weight_decay"]:
        param = param * (1 - lr * o["weight_decay"])
    else:
        g = g + o["weight_decay"] * param
    state["m"] = beta1 * state["m"] + (1 - beta1) * g
    state["v"] = beta2 * state["v"] + (1 - beta2) * g * g
    return param, g


def _nadam(
    param: np.ndarray, grad: np.ndarray, state: dict[str, Any], lr: float, o: Mapping[str, Any]
) -> np.ndarray:
    param, g = _moments(param, grad, state, lr, o)
    t, (beta1, beta2) = state["t"], o["betas"]
    mu = beta1 * (1 - 0.5 * 0.96 ** (t * o["momentum_decay"]))
    mu_next = beta1 * (1 - 0.5 * 0.96 ** ((t + 1) * o["momentum_decay"]))
    state["prod"] = float(np.float32(state["prod"]) * np.float32(mu))
    denom = np.sqrt(state["v"] / (1 - beta2**t)) + o["eps"]
    now = lr * (1 - mu) / (1 - state["prod"]) * g / denom
    ahead = lr * mu_next / (1 - state["prod"] * mu_next) * state["m"] / denom
    stepped: np.ndarray = param - now - ahead
    return stepped


def _radam(
    param: np.ndarray, grad: np.ndarray, state: dict[str, Any], lr: float, o: Mapping[str, Any]
) -> np.ndarray:
    param, _ = _moments(param, grad, state, lr, o)
    t, (beta1, beta2) = state["t"], o["betas"]
    corrected = state["m"] / (1 - beta1**t)
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * t * beta2**t / (1 - beta2**t)
    if rho_t <= 5:
        unrectified: np.ndarray = param - lr * corrected
        return unrectified
    rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
    adaptive = math.sqrt(1 - beta2**t) / (np.sqrt(state["v"]) + o["eps"])
    stepped: np.ndarray = param - lr * corrected * rect * adaptive
    return stepped


def _adadelta(
    param: np.ndarray, grad: np.ndarray, state: dict[str, Any], lr: float, o: Mapping[str, Any]
) -> np.ndarray:
    if not state:
        state.update(v=np.zeros_like(param), u=np.zeros_like(param))
    g = _plain_decay(param, grad, o)
    rho, eps = o["rho"], o["eps"]
    state["v"] = rho * state["v"] + (1 - rho) * g * g
    delta = np.sqrt(state["u"] + eps) / np.sqrt(state["v"] + eps) * g
    state["u"] = rho * state["u"] + (1 - rho) * delta * delta
    stepped: np.ndarray = param - lr * delta
    return stepped


RULES: dict[str, Rule] = {
    "Adagrad": _adagrad,
    "RMSprop": _rmsprop,
    "Adamax": _adamax,
    "NAdam": _nadam,
    "RAdam": _radam,
    "Adadelta": _adadelta,
}
