"""DistributedDataParallel's constructor on a CPU module: what it makes of the device
options its docs say must be None there."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from harness import RankContext
from harness.cases.ddp import CPU_DEVICE, CpuDeviceCase
from harness.torchkit.models import build_mlp

ACCEPTED = "accepted"


def _device(device: int | str | None) -> int | torch.device | None:
    if isinstance(device, str):
        assert device == CPU_DEVICE, "a case spells the CPU device only"
        return torch.device(device)
    return device


def cpu_device_options_on_rank(ctx: RankContext, case: CpuDeviceCase) -> str:
    """The name of the error ``DistributedDataParallel`` raises with the case's
    ``device_ids`` and ``output_device`` on a CPU module, or ``ACCEPTED``."""
    model = build_mlp(case, torch.device("cpu"))
    ids = None if case.device_ids is None else [_device(d) for d in case.device_ids]
    try:
        DistributedDataParallel(model, device_ids=ids, output_device=_device(case.output_device))
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ACCEPTED
