"""DDP communication hooks (``cases.comm_hooks``) registered as torch builds them."""

from __future__ import annotations

from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from harness.cases.comm_hooks import CommHook

FULL_RANK = 1 << 16
"""A matrix approximation rank no gradient here reaches: PowerSGD clamps it to each
gradient's smaller side, which makes its compression exact."""
_ORTHOGONALIZATION_EPSILON = 1e-30
"""Added to a column's norm before PowerSGD divides by it: a gradient that is zero on every
rank (a layer behind dead ReLUs) has a zero column, which torch's default epsilon of 0 turns
into NaN. Far below any norm a nonzero float32 gradient has."""


_HOOKS: dict[str, Any] = {
    "allreduce": default_hooks.allreduce_hook,
    "fp16_compress": default_hooks.fp16_compress_hook,
    "bf16_compress": default_hooks.bf16_compress_hook,
    "fp16_wrapper": default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
    "bf16_wrapper": default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook),
    "powerSGD": powerSGD_hook.powerSGD_hook,
}


def register(model: DistributedDataParallel, hook: CommHook | None) -> None:
    """Register ``hook`` on ``model`` (nothing for None)."""
    if hook is None:
        return
    state = _power_sgd_state(hook) if hook.name == "powerSGD" else None
    model.register_comm_hook(state, _HOOKS[hook.name])


def _power_sgd_state(hook: CommHook) -> powerSGD_hook.PowerSGDState:
    return powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=FULL_RANK,
        start_powerSGD_iter=hook.start_iter,
        min_compression_rate=0,
        use_error_feedback=hook.error_feedback,
        warm_start=hook.warm_start,
        orthogonalization_epsilon=_ORTHOGONALIZATION_EPSILON,
    )
