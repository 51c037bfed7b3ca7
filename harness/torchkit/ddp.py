"""DistributedDataParallel's keyword arguments from a case's ``wrapper_options``: the
values a case spells by name (a group, a mesh, parameters) made the objects torch takes."""

from __future__ import annotations

from typing import Any

from torch import nn

from harness.cases.training import DDP_GROUPS
from harness.torchkit.context import RankContext


def ddp_kwargs(model: nn.Module, options: dict[str, Any], ctx: RankContext) -> dict[str, Any]:
    """``options`` with the world's 1-D mesh (or its group) for ``DDP_GROUPS``' names, the
    named parameters of ``model`` for the late all-reduce's, a list for
    ``bucket_cap_mb_list``."""
    kwargs = dict(options)
    if "device_mesh" in kwargs:
        kwargs["device_mesh"] = ctx.mesh((ctx.world_size,))
    if "process_group" in kwargs:
        kwargs["process_group"] = ctx.mesh((ctx.world_size,)).get_group(0)
    named = dict(model.named_parameters())
    if "delay_all_reduce_named_params" in kwargs:
        names = kwargs["delay_all_reduce_named_params"]
        kwargs["delay_all_reduce_named_params"] = [(name, named[name]) for name in names]
        kwargs["param_to_hook_all_reduce"] = named[kwargs["param_to_hook_all_reduce"]]
    if "bucket_cap_mb_list" in kwargs:
        kwargs["bucket_cap_mb_list"] = list(kwargs["bucket_cap_mb_list"])
    return kwargs


assert set(DDP_GROUPS) == {"device_mesh", "process_group"}, "each group option made above"
