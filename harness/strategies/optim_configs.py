"""Strategies for ``torch.optim`` optimizer configurations: an optimizer, its
implementation and hyper-parameters, parameter groups and an lr schedule."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from hypothesis import strategies as st

from harness.cases.schedules import TENSOR_LR
from harness.cases.training import (
    CORE_OPTIMIZERS,
    FUSED,
    FUSED_CPU_ONLY,
    IMPLEMENTATIONS,
    OPTIMIZERS,
    OptimConfig,
)
from harness.errors import check_subset, require
from harness.strategies._common import sampled
from harness.strategies.schedules import schedules

LRS = (0.1, 0.01, 0.001)


@st.composite
def _sgd_options(draw: st.DrawFn, momenta: tuple[float, ...]) -> tuple[tuple[str, Any], ...]:
    momentum = draw(sampled(momenta))
    # nesterov needs momentum and no dampening (torch raises otherwise)
    nesterov = momentum > 0 and draw(st.booleans())
    dampening = 0.0 if nesterov or momentum == 0 else draw(sampled((0.0, 0.1)))
    return (
        ("momentum", momentum),
        ("dampening", dampening),
        ("nesterov", nesterov),
        ("weight_decay", draw(sampled((0.0, 0.01)))),
        ("maximize", draw(st.booleans())),
    )


@st.composite
def _adam_options(draw: st.DrawFn, name: str) -> tuple[tuple[str, Any], ...]:
    # Adam(decoupled_weight_decay=True) is AdamW (documented), which AdamW's constructor
    # does not take
    flag = name == "Adam" and draw(st.booleans())
    decoupled = flag or name == "AdamW"
    decays = (0.01, 0.1) if decoupled else (0.0, 0.01)
    chosen = (
        ("betas", draw(sampled(((0.9, 0.999), (0.8, 0.99))))),
        ("eps", draw(sampled(_EPS))),
        ("weight_decay", draw(sampled(decays))),
        ("amsgrad", draw(st.booleans())),
        ("maximize", draw(st.booleans())),
    )
    return (*chosen, ("decoupled_weight_decay", True)) if flag else chosen


_Options = tuple[tuple[str, Any], ...]


def _options(name: str, stateful: bool) -> st.SearchStrategy[_Options]:
    if name == "SGD":
        return _sgd_options((0.9,) if stateful else (0.0, 0.9))
    if name in ("Adam", "AdamW"):
        return _adam_options(name)
    return _OTHER_OPTIONS[name]


@st.composite
def _drawn(draw: st.DrawFn, /, **choices: Sequence[Any]) -> _Options:
    """Each option one of its values (every value valid with every other)."""
    return tuple((name, draw(sampled(tuple(values)))) for name, values in choices.items())


CAPTURABLE = ("Adam", "AdamW", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta", "ASGD", "Rprop")
"""The optimizers with a ``capturable`` option."""
_DECAYS = (0.0, 0.01)
_EPS = (1e-8, 1e-6)
"""Adam's family's default eps and one large enough to move a step of small gradients."""
_BOTH = (False, True)
# Values near each option's default and one that changes the arithmetic visibly within a
# few steps (a short t0 starts ASGD's averaging, a large momentum_decay NAdam's schedule).
_OTHER_OPTIONS = {
    "Adagrad": _drawn(
        lr_decay=(0.0, 0.1), weight_decay=_DECAYS, initial_accumulator_value=(0.0, 0.1),
        eps=(1e-10, 1e-6), maximize=_BOTH,
    ),
    "RMSprop": _drawn(
        alpha=(0.99, 0.9), eps=(1e-8, 1e-6), weight_decay=_DECAYS, momentum=(0.0, 0.9),
        centered=_BOTH, maximize=_BOTH,
    ),
    "Adamax": _drawn(
        betas=((0.9, 0.999), (0.8, 0.99)), eps=(1e-8, 1e-6), weight_decay=_DECAYS, maximize=_BOTH,
    ),
    "NAdam": _drawn(
        betas=((0.9, 0.999), (0.8, 0.99)), eps=_EPS, weight_decay=_DECAYS,
        momentum_decay=(0.004, 0.1),
        decoupled_weight_decay=_BOTH, maximize=_BOTH,
    ),
    "RAdam": _drawn(
        betas=((0.9, 0.999), (0.8, 0.99)), eps=_EPS, weight_decay=_DECAYS,
        decoupled_weight_decay=_BOTH,
        maximize=_BOTH,
    ),
    "Adadelta": _drawn(rho=(0.9, 0.5), eps=(1e-6, 1e-4), weight_decay=_DECAYS, maximize=_BOTH),
    "ASGD": _drawn(
        lambd=(1e-4, 1e-2), alpha=(0.75, 0.5), t0=(1e6, 1.0), weight_decay=_DECAYS, maximize=_BOTH,
    ),
    "Rprop": _drawn(
        etas=((0.5, 1.2), (0.3, 1.5)), step_sizes=((1e-6, 50.0), (1e-4, 1.0)), maximize=_BOTH,
    ),
    "Adafactor": _drawn(
        beta2_decay=(-0.8, -0.5), eps=((None, 1e-3), (1e-20, 1e-2)), d=(1.0, 2.0),
        weight_decay=_DECAYS, maximize=_BOTH,
    ),
}  # fmt: skip


def optim_configs(
    *,
    names: Sequence[str] = CORE_OPTIMIZERS,
    impls: Sequence[str] = IMPLEMENTATIONS,
    unsupported: frozenset[tuple[str, str]] = frozenset(),
    stateful: bool = False,
    groups: bool = True,
    flags: bool = False,
    accelerator: bool = False,
) -> st.SearchStrategy[OptimConfig]:
    """A ``torch.optim`` optimizer of ``names`` with valid hyper-parameters, a default,
    foreach or fused (where it has one) implementation, sometimes a second parameter group
    with its own lr and weight decay, and sometimes an lr schedule
    (``strategies.schedules``). ``unsupported`` lists
    ``(name, impl)`` pairs not to draw;
    ``stateful`` draws only optimizers that keep state (SGD only with momentum);
    ``groups=False`` never draws a second group or a scheduler. ``flags=True`` also draws
    ``capturable`` (fused kernels; every kernel if ``accelerator``: torch 2.13's
    others refuse CPU tensors) and a tensor learning rate (not for foreach without
    ``capturable``, which torch refuses). ``accelerator``: the parameters live on an
    accelerator, where fused Adagrad is not drawn (``cases.training.FUSED_CPU_ONLY``)."""
    check_subset("names", names, OPTIMIZERS, non_empty=True)
    check_subset("impls", impls, IMPLEMENTATIONS, non_empty=True)
    pairs = tuple(
        (n, i)
        for n in names
        for i in impls
        if (n, i) not in unsupported and (i != "fused" or _has_fused(n, accelerator))
    )
    leaves_one = "pairs that leave some optimizer of names × impls to draw"
    require(bool(pairs), "unsupported", sorted(unsupported), leaves_one)
    return _optim_configs(pairs, stateful, groups, flags, accelerator)


def _has_fused(name: str, accelerator: bool) -> bool:
    return name in FUSED and not (accelerator and name in FUSED_CPU_ONLY)


@cache
@st.composite
def _optim_configs(
    draw: st.DrawFn,
    pairs: tuple[tuple[str, str], ...],
    stateful: bool,
    groups: bool,
    flags: bool,
    accelerator: bool,
) -> OptimConfig:
    name, impl = draw(sampled(pairs))
    lr = draw(sampled(LRS))
    second, scheduler = None, None
    if groups and draw(st.booleans()):
        second = (("lr", lr / 2), ("weight_decay", draw(sampled((0.0, 0.05)))))
    if groups:
        scheduler = draw(st.none() | schedules(name))
    options = draw(_options(name, stateful))
    tensor_lr = False
    if flags:
        takes = name in CAPTURABLE and (impl == "fused" or accelerator)
        capturable = takes and draw(st.booleans())
        options = (*options, ("capturable", True)) if capturable else options
        tensor_lr = name in TENSOR_LR and (impl != "foreach" or capturable)
        tensor_lr = tensor_lr and draw(st.booleans())
    return OptimConfig(name, impl, lr, options, second, scheduler, tensor_lr=tensor_lr)
