"""GPU leasing for ``pytest -n gpu``: one xdist worker per disjoint group of visible GPUs.

GPUs are the devices of the accelerator torch sees (``torch.accelerator``); leasing them to
workers goes through ``CUDA_VISIBLE_DEVICES``, so ``-n gpu`` with several workers serves CUDA
(ROCm included); another accelerator runs ``-n gpu`` in one process, saying so.

The controller plans the groups and starts each worker with ``CUDA_VISIBLE_DEVICES`` set in
its environment (execnet's ``popen//env:`` spec), so the variable is in place before the
worker imports torch. An outer ``CUDA_VISIBLE_DEVICES`` is honoured: workers get disjoint
subsets of it. With no GPU, ``-n gpu`` runs in-process and GPU tests skip, saying why.

``DISTCONF_SIMULATED_GPUS=N`` makes the planning see N GPUs (ids 0..N-1) without any, so
the leasing logic is tested on machines without GPUs.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from harness.config import RunConfig, as_option
from harness.errors import InvalidArgument, check_int, invalid
from harness.plugin import options

SIMULATE = "DISTCONF_SIMULATED_GPUS"
GPU_WORKERS = "gpu"


def _simulated(env: Mapping[str, str]) -> int | None:
    value = env.get(SIMULATE)
    if value is None:
        return None
    if not value.isdigit():
        raise invalid(SIMULATE, value, "a non-negative int")
    return int(value)


def visible_gpus(env: Mapping[str, str] = os.environ) -> list[str]:
    """The GPU ids this process may use, in the order CUDA numbers them."""
    outer = env.get("CUDA_VISIBLE_DEVICES")
    simulated = _simulated(env)
    if simulated is None:
        import torch

        count = torch.accelerator.device_count()
    else:
        count = simulated
    if outer is None:
        return [str(i) for i in range(count)]
    ids = [part.strip() for part in outer.split(",") if part.strip()]
    return ids[:count] if simulated is None else ids


def plan_workers(gpus: list[str], per_worker: int) -> list[list[str]]:
    """Disjoint groups of ``per_worker`` GPUs, one per worker; leftover GPUs stay idle."""
    check_int("per_worker", per_worker)
    whole = len(gpus) - len(gpus) % per_worker
    return [gpus[i : i + per_worker] for i in range(0, whole, per_worker)]


def gpus_held(env: Mapping[str, str] = os.environ) -> int:
    """How many GPUs this process holds (a worker: its group)."""
    return len(visible_gpus(env))


def _accepting_gpu(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap xdist's ``-n`` parser so that ``-n gpu`` parses (the plugin resolves it)."""

    def parse_numprocesses(value: str) -> Any:
        return GPU_WORKERS if value == GPU_WORKERS else parse(value)

    parse_numprocesses.distconf = True  # type: ignore[attr-defined]
    return parse_numprocesses


def patch_numprocesses_option(actions: list[argparse.Action]) -> None:
    """Let xdist's ``-n`` accept ``gpu``; idempotent."""
    for action in actions:
        if action.dest == "numprocesses" and not getattr(action.type, "distconf", False):
            action.type = _accepting_gpu(action.type)  # type: ignore[arg-type]


def worker_specs(groups: list[list[str]]) -> list[str]:
    """execnet gateway specs that start each worker with its GPUs pinned."""
    return [f"popen//env:CUDA_VISIBLE_DEVICES={','.join(group)}" for group in groups]


# --- the pytest side -----------------------------------------------------------------------


def accept_gpu_workers(parser: pytest.Parser) -> None:
    """Let xdist's ``-n`` take ``gpu``: pytest keeps each option's argparse action on its
    Argument, and ``-n gpu`` must parse before xdist's own type conversion runs."""
    actions = [option._action for group in parser._groups for option in group.options]
    patch_numprocesses_option(actions)


def resolve_workers(config: pytest.Config) -> None:
    """Resolve ``-n gpu`` into one worker per disjoint GPU group, before xdist reads ``-n``."""
    if getattr(config.option, "numprocesses", None) != GPU_WORKERS:
        return
    per_worker = config.getoption("distconf_gpus_per_worker")
    if per_worker is None:
        per_worker = _gpus_per_world(options.run_config(config))
    try:
        groups = plan_workers(visible_gpus(), per_worker)
    except InvalidArgument as exc:
        spelled = {"per_worker": "--gpus-per-worker"}
        raise pytest.UsageError(str(as_option(exc, spelled))) from None
    if not groups or not _leasable():
        config.option.numprocesses = 0  # in-process; GPU tests skip and say why
        return
    config.option.numprocesses = None
    config.option.tx = worker_specs(groups)
    if config.option.dist == "no":
        config.option.dist = "load"


def _leasable() -> bool:
    """Whether workers can be given GPUs of their own (CUDA_VISIBLE_DEVICES works), saying
    why not."""
    if _simulated(os.environ) is not None:
        return True
    from harness.torchkit import devices

    kind = devices.accelerator_type()
    if kind != "cuda":
        print(
            f"distconf: -n gpu runs in one process: {kind} devices are not leased by "
            "CUDA_VISIBLE_DEVICES"
        )
    return kind == "cuda"


def _gpus_per_world(run: RunConfig) -> int:
    """GPUs the largest World takes (one unless it runs on an accelerator)."""
    return gpus_for_world(run.runner, max(run.world_sizes)) if run.device != "cpu" else 1


def gpus_for_world(runner: str, world_size: int) -> int:
    """GPUs an accelerator World of ``world_size`` ranks needs in this process: a GPU per rank on
    the process runner, one shared by rank threads."""
    return world_size if runner == "processes" else 1


def require_gpus(config: pytest.Config, needed: int, what: str) -> None:
    """Skip (or with ``--require-gpus`` fail) unless this process holds ``needed`` GPUs."""
    held = gpus_held()
    if held >= needed:
        return
    message = f"{what} needs {needed} GPU(s); this process holds {held}"
    if config.getoption("distconf_require_gpus"):
        pytest.fail(f"{message} (--require-gpus)", pytrace=False)
    pytest.skip(message)
