"""specs.optimizers against torch.optim's single-tensor kernels on one device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.strategies.training import optim_configs
from specs.optimizers import OPTIMIZERS, OptimizerModel


@settings(max_examples=60, deadline=None)
@given(
    config=optim_configs(names=OPTIMIZERS, impls=("default",), groups=False),
    seed=st.integers(0, 2**16),
)
def test_model_matches_single_tensor_torch_optim(config, seed):
    rng = np.random.default_rng(seed)
    params = [rng.uniform(-1, 1, size=s) for s in ((3, 2), (4,), ())]
    tensors = [torch.tensor(p, requires_grad=True) for p in params]
    optimizer = getattr(torch.optim, config.name)(tensors, **config.kwargs())
    model = OptimizerModel(config.name, config.lr, dict(config.options))
    for _ in range(3):
        grads = [rng.uniform(-1, 1, size=p.shape) for p in params]
        for tensor, grad in zip(tensors, grads, strict=True):
            tensor.grad = torch.tensor(grad)
        optimizer.step()
        model.step(params, grads)
    for tensor, param in zip(tensors, params, strict=True):
        # float64 both sides; only the order of operations differs (lerp vs multiply-add)
        np.testing.assert_allclose(tensor.detach().numpy(), param, rtol=1e-13, atol=1e-15)


def test_sgd_with_momentum_by_hand():
    param = np.array([1.0])
    model = OptimizerModel("SGD", 0.1, {"momentum": 0.5, "dampening": 0.5})
    model.step([param], [np.array([2.0])])  # buf = 2, p = 1 - 0.2
    model.step([param], [np.array([2.0])])  # buf = 0.5*2 + 0.5*2 = 2, p = 0.8 - 0.2
    assert param.tolist() == pytest.approx([0.6])


def test_adam_first_step_moves_by_lr():
    param = np.array([0.5, -0.5])
    OptimizerModel("Adam", 0.01, {}).step([param], [np.array([3.0, -0.25])])
    assert param.tolist() == pytest.approx([0.49, -0.49], abs=1e-8)


def test_model_rejects_what_the_optimizer_does_not_take():
    with pytest.raises(
        ValueError,
        match=r"options=\{'amsgrad': True\} must be keywords SGD takes .*, without \['amsgrad'\]",
    ):
        OptimizerModel("SGD", 0.1, {"amsgrad": True})
    with pytest.raises(ValueError, match="name='Lion' must be one of"):
        OptimizerModel("Lion", 0.1)
    with pytest.raises(
        ValueError, match=r"len\(grads\)=2 must be one grad per param, len\(params\)=1"
    ):
        OptimizerModel("SGD", 0.1).step([np.zeros(1)], [np.zeros(1), np.zeros(1)])
