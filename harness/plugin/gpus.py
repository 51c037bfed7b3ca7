"""GPU leasing for ``pytest -n gpu``: one xdist worker per disjoint group of visible GPUs.

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

SIMULATE = "DISTCONF_SIMULATED_GPUS"
GPU_WORKERS = "gpu"


def _simulated(env: Mapping[str, str]) -> int | None:
    value = env.get(SIMULATE)
    if value is None:
        return None
    if not value.isdigit():
        raise ValueError(f"{SIMULATE}={value!r} must be a non-negative int")
    return int(value)


def visible_gpus(env: Mapping[str, str] = os.environ) -> list[str]:
    """The GPU ids this process may use, in the order CUDA numbers them."""
    outer = env.get("CUDA_VISIBLE_DEVICES")
    simulated = _simulated(env)
    if simulated is None:
        import torch

        count = torch.cuda.device_count()
    else:
        count = simulated
    if outer is None:
        return [str(i) for i in range(count)]
    ids = [part.strip() for part in outer.split(",") if part.strip()]
    return ids[:count] if simulated is None else ids


def plan_workers(gpus: list[str], per_worker: int) -> list[list[str]]:
    """Disjoint groups of ``per_worker`` GPUs, one per worker; leftover GPUs stay idle."""
    if not isinstance(per_worker, int) or per_worker < 1:
        raise ValueError(f"per_worker={per_worker!r} must be a positive int")
    whole = len(gpus) - len(gpus) % per_worker
    return [gpus[i : i + per_worker] for i in range(0, whole, per_worker)]


def gpus_held(env: Mapping[str, str] = os.environ) -> int:
    """How many GPUs this process holds (a worker: its group)."""
    return len(visible_gpus(env))


def accept_gpu_workers(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap xdist's ``-n`` parser so that ``-n gpu`` parses (the plugin resolves it)."""

    def parse_numprocesses(value: str) -> Any:
        return GPU_WORKERS if value == GPU_WORKERS else parse(value)

    parse_numprocesses.distconf = True  # type: ignore[attr-defined]
    return parse_numprocesses


def patch_numprocesses_option(actions: list[argparse.Action]) -> None:
    """Let xdist's ``-n`` accept ``gpu``; idempotent."""
    for action in actions:
        if action.dest == "numprocesses" and not getattr(action.type, "distconf", False):
            action.type = accept_gpu_workers(action.type)  # type: ignore[arg-type]


def worker_specs(groups: list[list[str]]) -> list[str]:
    """execnet gateway specs that start each worker with its GPUs pinned."""
    return [f"popen//env:CUDA_VISIBLE_DEVICES={','.join(group)}" for group in groups]
