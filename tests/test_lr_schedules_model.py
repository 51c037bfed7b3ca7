"""specs.lr_schedules by hand: each scheduler's documented arithmetic on small numbers worked
out here, per parameter group, and the descriptions it refuses."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest

from harness.errors import InvalidArgument
from specs.lr_schedules import trajectory


@dataclass(frozen=True)
class Sched:
    """A scheduler description of the shape ``specs.lr_schedules.Described`` asks for."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    parts: tuple[Sched, ...] = ()


def lrs(schedule: Sched, initial: tuple[float, ...], steps: int, **kwargs: Any) -> list[Any]:
    return trajectory(schedule, initial, steps, **kwargs).lrs


def close(got: list[tuple[float, ...]], want: list[tuple[float, ...]]) -> bool:
    return all(g == pytest.approx(w, rel=1e-12, abs=1e-15) for g, w in zip(got, want, strict=True))


def test_step_lr_decays_every_step_size_steps_per_group():
    schedule = Sched("StepLR", (("step_size", 2), ("gamma", 0.5)))
    assert close(
        lrs(schedule, (0.8, 0.2), 5),
        [(0.8, 0.2), (0.8, 0.2), (0.4, 0.1), (0.4, 0.1), (0.2, 0.05), (0.2, 0.05)],
    )


def test_multi_step_lr_counts_a_milestone_listed_twice_twice():
    schedule = Sched("MultiStepLR", (("milestones", (1, 3, 3)), ("gamma", 0.5)))
    assert close(lrs(schedule, (1.0,), 4), [(1.0,), (0.5,), (0.5,), (0.125,), (0.125,)])


def test_constant_and_linear_lr_scale_until_total_iters():
    constant = Sched("ConstantLR", (("factor", 0.5), ("total_iters", 2)))
    assert close(lrs(constant, (0.4,), 3), [(0.2,), (0.2,), (0.4,), (0.4,)])
    linear = Sched("LinearLR", (("start_factor", 0.25), ("end_factor", 1.0), ("total_iters", 3)))
    assert close(lrs(linear, (0.8,), 4), [(0.2,), (0.4,), (0.6,), (0.8,), (0.8,)])


def test_exponential_and_defaults():
    assert close(lrs(Sched("ExponentialLR", (("gamma", 0.5),)), (1.0,), 2), [(1,), (0.5,), (0.25,)])
    # StepLR's documented default gamma is 0.1; ConstantLR's factor 1/3 for 5 iterations
    assert close(lrs(Sched("StepLR", (("step_size", 1),)), (1.0,), 1), [(1.0,), (0.1,)])
    assert lrs(Sched("ConstantLR"), (0.3,), 5)[4][0] == pytest.approx(0.1)
    assert lrs(Sched("ConstantLR"), (0.3,), 5)[5][0] == pytest.approx(0.3)


def test_cosine_annealing_goes_down_to_eta_min_and_back_without_restart():
    schedule = Sched("CosineAnnealingLR", (("T_max", 2), ("eta_min", 0.1)))
    # eta_min + (base - eta_min) * (1 + cos(pi t / 2)) / 2 with base 0.5: 0.5, 0.3, 0.1, 0.3, 0.5
    assert close(lrs(schedule, (0.5,), 4), [(0.5,), (0.3,), (0.1,), (0.3,), (0.5,)])


def test_lambda_lr_takes_each_groups_own_initial_lr():
    functions = {"half": lambda epoch: 0.5, "inverse": lambda epoch: 1.0 / (epoch + 1)}
    one = Sched("LambdaLR", (("lr_lambda", "inverse"),))
    got = lrs(one, (0.6, 0.3), 2, lr_lambdas=functions)
    assert close(got, [(0.6, 0.3), (0.3, 0.15), (0.2, 0.1)])
    per_group = Sched("LambdaLR", (("lr_lambda", ("inverse", "half")),))
    got = lrs(per_group, (0.6, 0.3), 2, lr_lambdas=functions)
    assert close(got, [(0.6, 0.15), (0.3, 0.15), (0.2, 0.15)])


def test_sequential_lr_restarts_each_scheduler_at_its_milestone():
    constant = Sched("ConstantLR", (("factor", 0.5), ("total_iters", 5)))
    halving = Sched("ExponentialLR", (("gamma", 0.5),))
    schedule = Sched("SequentialLR", (("milestones", (2,)),), (constant, halving))
    # constant for steps 0-1, then the exponential from its own step 0: the initial lr
    assert close(lrs(schedule, (1.0,), 4), [(0.5,), (0.5,), (1.0,), (0.5,), (0.25,)])


def test_sequential_lr_never_runs_a_scheduler_whose_interval_is_empty():
    constant = Sched("ConstantLR", (("factor", 0.5), ("total_iters", 5)))
    halving = Sched("ExponentialLR", (("gamma", 0.5),))
    linear = Sched("LinearLR", (("start_factor", 0.25), ("total_iters", 2)))
    from_zero = Sched("SequentialLR", (("milestones", (0,)),), (constant, halving))
    assert close(lrs(from_zero, (1.0,), 2), [(1.0,), (0.5,), (0.25,)])
    twice = Sched("SequentialLR", (("milestones", (1, 1)),), (constant, halving, linear))
    assert close(lrs(twice, (1.0,), 3), [(0.5,), (0.25,), (0.625,), (1.0,)])


def test_one_cycle_two_phases_linear_with_momentum_per_group():
    options = (
        ("max_lr", (1.0, 2.0)),
        ("total_steps", 5),
        ("pct_start", 0.4),
        ("anneal_strategy", "linear"),
        ("div_factor", 4.0),
        ("final_div_factor", 10.0),
        ("base_momentum", 0.8),
        ("max_momentum", 0.9),
    )
    got = trajectory(Sched("OneCycleLR", options), (0.001, 0.001), 4)
    # initial max_lr/4, up to max_lr at step 0.4*5-1 = 1, down to initial/10 at step 4
    first = [0.25, 1.0, 1.0 - 0.975 / 3, 1.0 - 0.975 * 2 / 3, 0.025]
    assert close(got.lrs, [(lr, 2 * lr) for lr in first])
    assert got.momenta is not None
    momenta = [0.9, 0.8, 0.8 + 0.1 / 3, 0.8 + 0.2 / 3, 0.9]
    assert close(got.momenta, [(m, m) for m in momenta])


def test_one_cycle_three_phases_cosine_and_momentum_not_cycled():
    options = (
        ("max_lr", 1.0),
        ("epochs", 2),
        ("steps_per_epoch", 5),
        ("pct_start", 0.3),
        ("div_factor", 4.0),
        ("final_div_factor", 10.0),
        ("three_phase", True),
        ("cycle_momentum", False),
    )
    got = trajectory(Sched("OneCycleLR", options), (0.5,), 9)
    # phases end at steps 2, 4 and 9; halfway through a cosine phase is the midpoint
    want = [0.25, 0.625, 1.0, 0.625, 0.25]
    want += [0.025 + 0.225 * (1 + math.cos(math.pi * k / 5)) / 2 for k in range(1, 6)]
    assert close(got.lrs, [(lr,) for lr in want])
    assert got.momenta is None


def test_plateau_cuts_after_patience_waits_out_cooldown_and_keeps_min_lr():
    options = (
        ("factor", 0.5),
        ("patience", 1),
        ("cooldown", 1),
        ("min_lr", (0.0, 0.3)),
    )
    metrics = (1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5)
    got = lrs(Sched("ReduceLROnPlateau", options), (1.0, 0.4), 7, metrics=metrics)
    # step 1 sets the best; steps 2-3 are bad: cut (group 1 no lower than 0.3); step 4 is bad
    # in the cooldown, not counted; step 5 improves; steps 6-7 are bad: cut
    assert got == [
        (1.0, 0.4),
        (1.0, 0.4),
        (1.0, 0.4),
        (0.5, 0.3),
        (0.5, 0.3),
        (0.5, 0.3),
        (0.5, 0.3),
        (0.25, 0.3),
    ]


def test_plateau_thresholds_and_eps():
    rel = Sched("ReduceLROnPlateau", (("patience", 0), ("factor", 0.5)))
    # 0.99995 is not better than 1.0 by the default relative threshold 1e-4: a cut
    assert lrs(rel, (1.0,), 2, metrics=(1.0, 0.99995))[-1] == (0.5,)
    assert lrs(rel, (1.0,), 2, metrics=(1.0, 0.9998))[-1] == (1.0,)
    higher = Sched(
        "ReduceLROnPlateau",
        (("patience", 0), ("mode", "max"), ("threshold_mode", "abs"), ("threshold", 0.1)),
    )
    assert lrs(higher, (1.0,), 2, metrics=(1.0, 1.05))[-1] == (0.1,)
    assert lrs(higher, (1.0,), 2, metrics=(1.0, 1.2))[-1] == (1.0,)
    # a cut by eps or less is not made
    small = Sched("ReduceLROnPlateau", (("patience", 0), ("eps", 0.1), ("factor", 0.5)))
    assert lrs(small, (0.4, 0.1), 2, metrics=(1.0, 1.0))[-1] == (0.2, 0.1)


@pytest.mark.parametrize(
    ("schedule", "kwargs", "message"),
    [
        (Sched("StepLR", (("step_size", 1), ("decay", 0.1))), {}, "not \\['decay'\\]"),
        (Sched("StepLR"), {}, "StepLR's \\['step_size'\\] given"),
        (Sched("CyclicLR"), {}, "name='CyclicLR' must be one of"),
        (
            Sched("LambdaLR", (("lr_lambda", ("a",)),)),
            {},
            "lr_lambda=\\('a',\\) must be one value per group, 2",
        ),
        (
            Sched("LambdaLR", (("lr_lambda", "a"),)),
            {},
            "lr_lambda='a' must be one of the lr_lambdas given",
        ),
        (
            Sched("ReduceLROnPlateau"),
            {"metrics": (1.0,)},
            "metrics=\\(1.0,\\) must be one per step, 2",
        ),
        (
            Sched("StepLR", (("step_size", 1),)),
            {"metrics": (1.0, 1.0)},
            "but for ReduceLROnPlateau",
        ),
        (
            Sched("OneCycleLR", (("max_lr", 0.1), ("total_steps", 2))),
            {},
            "steps=2 must be < total_steps=2",
        ),
        (Sched("OneCycleLR", (("max_lr", 0.1),)), {}, "total_steps, or epochs and steps_per_epoch"),
        (
            Sched("SequentialLR", (("milestones", (1,)),), (Sched("ReduceLROnPlateau"),) * 2),
            {},
            "part='ReduceLROnPlateau' must be one of",
        ),
        (
            Sched(
                "SequentialLR",
                (("milestones", (2, 1)),),
                (Sched("ExponentialLR", (("gamma", 0.5),)),) * 3,
            ),
            {},
            "in order",
        ),
    ],
)
def test_the_model_refuses_what_it_does_not_describe(schedule, kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        trajectory(schedule, (0.1, 0.2), 2, **kwargs)
