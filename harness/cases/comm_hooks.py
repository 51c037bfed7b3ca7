"""DDP communication hooks (``DistributedDataParallel.register_comm_hook``) a training run
registers: those that must leave training as it is, and those that round the gradients."""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import check_one_of, require

LOSSLESS = ("allreduce", "powerSGD")
"""Hooks under which DDP must train as one device does: the default all-reduce as a hook,
and PowerSGD at full rank (every 2-D gradient compressed, at a rank no smaller than its
sides, reconstructs exactly up to rounding)."""
ROUNDING = ("fp16_compress", "bf16_compress", "fp16_wrapper", "bf16_wrapper")
"""Hooks that all-reduce the gradients in a 16-bit dtype: ``fp16_compress_hook`` and
``bf16_compress_hook``, and ``allreduce_hook`` wrapped by ``fp16_compress_wrapper`` or
``bf16_compress_wrapper``."""
HOOKS = (*LOSSLESS, *ROUNDING)


@dataclass(frozen=True, kw_only=True)
class CommHook:
    """A hook of ``HOOKS``; for PowerSGD, how many iterations all-reduce plainly first
    (``start_powerSGD_iter``, at least 2 with error feedback or warm start, which torch
    requires), and its error feedback and warm start."""

    name: str
    start_iter: int = 2
    error_feedback: bool = True
    warm_start: bool = True

    def __post_init__(self) -> None:
        check_one_of("name", self.name, HOOKS)
        late = self.start_iter >= 2 or not (self.error_feedback or self.warm_start)
        require(late, "start_iter", self.start_iter, ">= 2 with error feedback or warm start")

    @property
    def dtype(self) -> str | None:
        """The dtype a rounding hook all-reduces in; None for a lossless one."""
        if self.name in LOSSLESS:
            return None
        return "float16" if self.name.startswith("fp16") else "bfloat16"

    def describe(self) -> str:
        if self.name != "powerSGD":
            return f"comm hook {self.name}"
        return (
            f"comm hook powerSGD(full rank, start_powerSGD_iter={self.start_iter}, "
            f"use_error_feedback={self.error_feedback}, warm_start={self.warm_start})"
        )
