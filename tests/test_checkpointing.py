"""Activation checkpointing cases: drawn valid, refused when torch would refuse them, and
applied so that one device trains exactly as without them."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from torch import nn
from torch.distributed._composable.contract import _get_registry

from harness import InvalidArgument
from harness.cases.checkpointing import Checkpointing
from harness.strategies import checkpointings
from harness.torchkit.checkpointing import WRAPPED_ATTRIBUTE, checkpoint_layers


def _model(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    children: list[nn.Module] = []
    for index in range(layers):
        if index:
            children.append(nn.ReLU())
        children.append(nn.Linear(3, 3, dtype=torch.float64))
    return nn.Sequential(*children)


def _gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    x = torch.linspace(-1.0, 1.0, 6, dtype=torch.float64).reshape(2, 3)
    model(x).pow(2).sum().backward()
    return {
        name.replace(f"{WRAPPED_ATTRIBUTE}.", ""): p.grad
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def _checkpointed(module: nn.Module) -> bool:
    return hasattr(module, WRAPPED_ATTRIBUTE) or "checkpoint" in (_get_registry(module) or {})


@settings(max_examples=60, deadline=None)
@given(how=checkpointings(3))
def test_every_drawn_checkpointing_leaves_the_gradients_bit_for_bit(how):
    plain = _model(3)
    checkpointed = copy.deepcopy(plain)
    checkpoint_layers(checkpointed, [0, 2, 4], how)
    for position, index in enumerate([0, 2, 4]):
        assert _checkpointed(checkpointed[index]) == (position in how.layers), (index, how)
    want, got = _gradients(plain), _gradients(checkpointed)
    assert sorted(got) == sorted(want), how
    for name, grad in want.items():
        assert torch.equal(got[name], grad), (name, how)


@settings(max_examples=100)
@given(how=checkpointings(3, random=True))
def test_random_layers_keep_the_generator_and_the_composable_api_saves_nothing(how):
    assert how.preserve_rng_state
    assert not (how.api == "composable" and how.save is not None)
    assert not how.reentrant or 0 not in how.layers


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"api": "lambda"}, "api='lambda' must be one of"),
        ({"layers": ()}, r"layers=\(\) must be at least one layer position"),
        ({"layers": (1, 0)}, r"layers=\(1, 0\) must be distinct layer positions"),
        ({"reentrant": True, "layers": (0,)}, "no layer 0 when reentrant"),
        ({"reentrant": True, "api": "composable", "layers": (1,)}, "api='composable' must be"),
        ({"reentrant": True, "layers": (1,), "save": "save_all"}, "None when reentrant"),
        ({"save": "save_all", "policy_as_list": True}, "policy_as_list=True must be False"),
        ({"determinism_check": "strict"}, "determinism_check='strict' must be one of"),
    ],
)
def test_checkpointing_refuses_what_torch_refuses(options, message):
    with pytest.raises(InvalidArgument, match=message):
        Checkpointing(**options)


def test_checkpointings_validates_its_arguments():
    with pytest.raises(InvalidArgument, match="layers=0"):
        checkpointings(0)
    with pytest.raises(InvalidArgument, match="random=1 must be a bool"):
        checkpointings(2, random=1)  # type: ignore[arg-type]
