"""The pieces behind the optimizer suites: the ZeRO partition model, optimizer-config and
parity-case strategies, parameter groups and the single-device reference."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from hypothesis import assume, find, given, settings
from hypothesis import strategies as st

from harness.cases.training import (
    FUSED,
    LAYOUTS,
    OPTIMIZERS,
    TP_LAYOUTS,
    OptimConfig,
    ParityCase,
)
from harness.errors import InvalidArgument
from harness.strategies.training import (
    optim_configs,
    params_cases,
    parity_cases,
    partition_cases,
    step_cases,
)
from harness.strategies.zero import frozen_groups_cases
from harness.torchkit.models import build_mlp
from harness.torchkit.optim import build_optimizer, param_groups, reference_run
from specs.zero import partition, rank_totals


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_partition_balances_upstreams_sizes(world_size):
    """Upstream's test_sharding: sizes [9, 7, 5, 3] per rank give every rank 24 elements."""
    assert rank_totals([[9, 7, 5, 3] * world_size], world_size) == [24] * world_size


@settings(max_examples=200)
@given(case=partition_cases(), world_size=st.integers(1, 8))
def test_partition_owns_every_parameter_once(case, world_size):
    owned = partition(case.all_groups(), world_size)
    for g, sizes in enumerate(case.all_groups()):
        indices = sorted(i for rank in owned for i in rank[g])
        assert indices == list(range(len(sizes)))
    assert sum(rank_totals(case.all_groups(), world_size)) == sum(map(sum, case.all_groups()))


def test_partition_ties_go_to_the_lowest_rank_and_totals_carry_over():
    assert partition([[4, 4], [1]], 3) == [[[0], []], [[1], []], [[], [0]]]


@pytest.mark.parametrize(
    ("sizes", "world_size", "message"),
    [([[1]], 0, "world_size=0"), ([[-1]], 2, "group_sizes\\[0\\]")],
)
def test_partition_rejects_bad_input(sizes, world_size, message):
    with pytest.raises(ValueError, match=message):
        partition(sizes, world_size)


# The first fused/foreach step compiles nothing but loads kernels lazily: no deadline.
@settings(max_examples=200, deadline=None)
@given(config=optim_configs(unsupported=frozenset({("SGD", "fused")})))
def test_optimizer_configs_build_and_step(config):
    options = dict(config.options)
    if config.name == "SGD" and options["nesterov"]:
        assert options["momentum"] > 0 and options["dampening"] == 0
    assert (config.name, config.impl) != ("SGD", "fused")
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    optimizer = build_optimizer(config, param_groups(model, config))
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert len(optimizer.param_groups) == (2 if config.second_group else 1)


@settings(max_examples=20, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_is_drawn_with_options_it_takes(name, data):
    config = data.draw(optim_configs(names=(name,), flags=True))
    assert config.name == name and (config.impl != "fused" or name in FUSED)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    optimizer = build_optimizer(config, param_groups(model, config))
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert type(optimizer).__name__ == name


def test_fused_kernels_torch_has_on_the_cpu_only_are_left_out_on_accelerators():
    on_cpu = optim_configs(names=("Adagrad",), impls=("fused",))
    assert find(on_cpu, lambda config: True).impl == "fused"
    with pytest.raises(InvalidArgument, match=r"unsupported=.*leave some optimizer"):
        optim_configs(names=("Adagrad",), impls=("fused",), accelerator=True)


@settings(max_examples=50)
@given(data=st.data())
def test_ddp_options_are_ones_the_running_torch_takes(data):
    case = data.draw(parity_cases(2, layout="ddp", variants=True))
    taken = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    assert set(dict(case.wrapper_options)) <= set(taken)


def test_optimizer_config_validates_its_names():
    with pytest.raises(ValueError, match="name='Lion' must be one of"):
        OptimConfig("Lion", "default", 0.1)
    with pytest.raises(ValueError, match="impl='triton' must be one of"):
        OptimConfig("SGD", "triton", 0.1)
    with pytest.raises(ValueError, match="name='RMSprop' must be an optimizer with a fused"):
        OptimConfig("RMSprop", "fused", 0.1)
    with pytest.raises(ValueError, match=r"unsupported=\[\('SGD', 'fused'\)\] must be pairs"):
        optim_configs(names=("SGD",), impls=("fused",), unsupported=frozenset({("SGD", "fused")}))


@settings(max_examples=100)
@given(
    world_size=st.integers(1, 8),
    layout=st.sampled_from(LAYOUTS),
    data=st.data(),
)
def test_parity_cases_fit_their_layout(world_size, layout, data):
    assume(not (layout in TP_LAYOUTS and world_size == 1))
    case = data.draw(parity_cases(world_size, layout=layout))
    assert math.prod(case.mesh_shape) == world_size
    if layout in TP_LAYOUTS:
        tp = case.mesh_shape[-1]
        assert len(case.mesh_shape) == (2 if layout == "fsdp_tp" else 3)
        assert tp > 1 and len(case.dims) == 3 and case.dims[1] % tp == 0
        assert case.data_parallel == world_size // tp
    else:
        assert case.data_parallel == world_size


@settings(max_examples=100)
@given(world_size=st.integers(1, 6), layout=st.sampled_from(("fsdp", "ddp")), data=st.data())
def test_accumulated_parity_cases_split_rows_evenly(world_size, layout, data):
    case = data.draw(parity_cases(world_size, layout=layout, variants=True))
    assert case.micro_batches in (1, 2) and case.batch_per_rank % case.micro_batches == 0
    assert case.clipping is None or case.clipping.bound in (1.0, 0.05, 0.1, 0.01)


def test_parity_case_rejects_uneven_micro_batches_and_mixed_precision_accumulation():
    with pytest.raises(
        ValueError, match="micro_batches=2 must be >= 1 and divide batch_per_rank=3"
    ):
        ParityCase(
            "fsdp",
            (2,),
            (3, 2),
            True,
            3,
            "float64",
            OptimConfig("SGD", "default", 0.1),
            1,
            None,
            7,
            micro_batches=2,
        )


@settings(max_examples=100)
@given(world_size=st.integers(1, 6), data=st.data())
def test_step_cases_lay_out_every_parameter(world_size, data):
    unsupported = frozenset({("SGD", "fused")})
    case = data.draw(step_cases(world_size, dtensor_unsupported=unsupported))
    assert math.prod(case.mesh_shape) == world_size and 1 <= len(case.shapes) <= 4
    if case.placements is not None:
        assert (case.optim.name, case.optim.impl) not in unsupported
        assert [len(p) for p in case.placements] == [len(case.mesh_shape)] * len(case.shapes)
    assert [g.shape for g in case.grads(0)] == [p.shape for p in case.params()] == list(case.shapes)


def test_parity_case_validates_layout():
    with pytest.raises(ValueError, match="layout='pp' must be one of"):
        parity_cases(2, layout="pp")


def test_single_group_when_the_model_has_one_layer():
    config = OptimConfig("SGD", "default", 0.1, second_group=(("lr", 0.05),))
    assert len(param_groups(torch.nn.Sequential(torch.nn.Linear(2, 3)), config)) == 1


def test_reference_is_deterministic_and_trains():
    case = ParityCase(
        "fsdp",
        (2,),
        (3, 4, 2),
        True,
        2,
        "float64",
        OptimConfig("Adam", "foreach", 0.1),
        3,
        None,
        7,
    )
    first, second = reference_run(case), reference_run(case)
    assert first.losses == second.losses
    initial = {
        n: p.detach().numpy() for n, p in build_mlp(case, torch.device("cpu")).named_parameters()
    }
    assert any((first.params[n] != initial[n]).any() for n in initial)


@settings(max_examples=50)
@given(world_size=st.integers(1, 6), data=st.data())
def test_params_cases_with_momentum_keep_state(world_size, data):
    case = data.draw(params_cases(world_size, momentum=True))
    assert dict(case.optim.options)["momentum"] > 0
    assert 0 <= case.recipient < world_size


def _unfrozen_late(frozen, refrozen) -> bool:
    return any(
        before and not after
        for group, regroup in zip(frozen, refrozen, strict=True)
        for before, after in zip(group, regroup, strict=True)
    )


@settings(max_examples=100)
@given(world_size=st.integers(1, 4), late=st.booleans(), data=st.data())
def test_fused_sgd_meets_a_late_first_gradient_only_when_asked(world_size, late, data):
    case = data.draw(frozen_groups_cases(world_size, late_fused_sgd=late))
    fused_momentum = (case.optim.name, case.optim.impl) == ("SGD", "fused")
    fused_momentum = fused_momentum and dict(case.optim.options)["momentum"] > 0
    late_grad = case.refrozen is not None and case.switch > 0
    late_grad = late_grad and _unfrozen_late(case.frozen, case.refrozen)
    if late:
        assert fused_momentum and late_grad
        sizes = [math.prod(shape) for shape in case.groups[0]]
        owned = [set(groups[0]) for groups in partition([sizes], world_size)]
        assert any({len(sizes) - 2, len(sizes) - 1} <= rank for rank in owned)
        assert (case.frozen[0][-2:], case.refrozen[0][-2:]) == ((False, True), (False, False))
    else:
        assert not (fused_momentum and late_grad)


def test_frozen_groups_cases_refuse_a_non_bool_option():
    with pytest.raises(InvalidArgument, match="late_fused_sgd=1 must be a bool"):
        frozen_groups_cases(2, late_fused_sgd=1)
