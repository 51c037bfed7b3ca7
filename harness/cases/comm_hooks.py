"""DDP communication hooks (``DistributedDataParallel.register_comm_hook``) a training run
registers: the default all-reduce as a hook, which must leave training as it is, and the
hooks that round the gradients to 16 bits."""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import check_one_of

LOSSLESS = ("allreduce",)
"""Hooks under which DDP must train as one device does."""
ROUNDING = ("fp16_compress", "bf16_compress", "fp16_wrapper", "bf16_wrapper")
"""Hooks that all-reduce the gradients in a 16-bit dtype: ``fp16_compress_hook`` and
``bf16_compress_hook``, and ``allreduce_hook`` wrapped by ``fp16_compress_wrapper`` or
``bf16_compress_wrapper``."""
HOOKS = (*LOSSLESS, *ROUNDING)


@dataclass(frozen=True, kw_only=True)
class CommHook:
    """A hook of ``HOOKS``, registered with no state (the default process group) or, where
    ``group_state``, the DDP model's process group as its state."""

    name: str
    group_state: bool = False

    def __post_init__(self) -> None:
        check_one_of("name", self.name, HOOKS)

    @property
    def dtype(self) -> str | None:
        """The dtype a rounding hook all-reduces in; None for a lossless one."""
        if self.name in LOSSLESS:
            return None
        return "float16" if self.name.startswith("fp16") else "bfloat16"

    def describe(self) -> str:
        state = "the DDP's process group" if self.group_state else "None"
        return f"comm hook {self.name} (state {state})"
