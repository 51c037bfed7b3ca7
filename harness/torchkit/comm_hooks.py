"""DDP communication hooks (``cases.comm_hooks``) registered as torch builds them."""

from __future__ import annotations

from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from harness.cases.comm_hooks import CommHook

_HOOKS: dict[str, Any] = {
    "allreduce": default_hooks.allreduce_hook,
    "fp16_compress": default_hooks.fp16_compress_hook,
    "bf16_compress": default_hooks.bf16_compress_hook,
    "fp16_wrapper": default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
    "bf16_wrapper": default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook),
}


def register(model: DistributedDataParallel, hook: CommHook | None) -> None:
    """Register ``hook`` on ``model`` (nothing for None), its state the model's process
    group where ``hook.group_state``."""
    if hook is not None:
        state = model.process_group if hook.group_state else None
        model.register_comm_hook(state, _HOOKS[hook.name])
