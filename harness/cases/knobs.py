"""Cases of the FSDP2 controls real training turns (``Knobs``) and of mixed-precision
policies per module (``Precision``), which ``harness.strategies.knobs`` draws."""

from __future__ import annotations

from dataclasses import dataclass, replace

from harness.cases.checkpointing import Checkpointing
from harness.errors import check_one_of, require

PRECISION_DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True, kw_only=True)
class Precision:
    """``fully_shard``'s ``MixedPrecisionPolicy``: one for the root, one per Linear.

    The root's ``param_dtype`` casts the model's inputs (``cast_forward_inputs``), each
    Linear's computes in its own ``param_dtype`` (casting its inputs to it), gradients are
    reduced in ``reduce_dtype``, and the root casts its output to ``output_dtype``."""

    layer_dtypes: tuple[str, ...]
    """Each Linear's ``param_dtype``, in model order."""
    root_dtype: str | None = None
    """The root's ``param_dtype`` (None: the root casts nothing)."""
    reduce_dtype: str = "float32"
    output_dtype: str | None = None

    def __post_init__(self) -> None:
        for index, dtype in enumerate(self.layer_dtypes):
            check_one_of(f"layer_dtypes[{index}]", dtype, PRECISION_DTYPES)
        for name in ("root_dtype", "output_dtype"):
            if getattr(self, name) is not None:
                check_one_of(name, getattr(self, name), PRECISION_DTYPES)
        check_one_of("reduce_dtype", self.reduce_dtype, ("float32",))

    def describe(self) -> str:
        output = f", output {self.output_dtype}" if self.output_dtype else ""
        return (
            f"mixed precision: root {self.root_dtype}, layers {list(self.layer_dtypes)}, "
            f"reduce {self.reduce_dtype}{output}"
        )


@dataclass(frozen=True, kw_only=True)
class Knobs:
    """The FSDP2 controls real training turns, each set on every ``fully_shard`` module.

    None of them may change what training computes, except ``divide_factor``: gradients
    are summed over the data-parallel ranks and divided by it instead of averaged."""

    divide_factor: float | None = None
    """``set_gradient_divide_factor`` (or its deprecated spelling, ``set_reduce_scatter_
    divide_factor``, when ``deprecated_spelling``)."""
    deprecated_spelling: bool = False
    force_sum_reduction: bool = False
    """``set_force_sum_reduction_for_comms(True)``: sum-only collectives, scaled locally."""
    hold_all_reduce: bool = False
    """``set_requires_all_reduce(False)`` before every micro-batch but the last (HSDP)."""
    hold_reshard: bool = False
    """``set_reshard_after_backward(False)`` before every micro-batch but the last."""
    mark_last_backward: bool = False
    """``set_is_last_backward`` True before the last micro-batch only."""
    reshard_to: int | None = None
    """``reshard_after_forward`` as an int: reshard to groups of this many ranks."""
    reset_reshard_after_forward: tuple[bool, bool] | None = None
    """``set_reshard_after_forward(value, recurse)`` on the root after sharding, as
    ``(value, recurse)``; None: not called."""
    first_layer_stays_sharded: bool = False
    """``set_unshard_in_backward(False)`` on the first Linear, whose weight its backward
    does not need (the model's input needs no gradient)."""
    explicit_unshard: bool = False
    """``unshard(async_op=True)`` on every module before each forward, ``reshard()``
    after each optimizer step."""
    forward_prefetch: tuple[tuple[int, ...], ...] = ()
    """``set_modules_to_forward_prefetch``: for each Linear, the Linears (by position) it
    prefetches in forward; () sets nothing."""
    backward_prefetch: tuple[tuple[int, ...], ...] = ()
    """``set_modules_to_backward_prefetch``, likewise."""
    keyword_input: bool = False
    """The model is called with its input as a keyword argument (``model(input=x)``)."""
    checkpoint: Checkpointing | None = None
    """Activation checkpointing of some Linears (through one of torch's APIs) before
    sharding; None: none."""
    flatten: tuple[int, int] | None = None
    """fsdp: the 1-D mesh is this 2-D mesh flattened (``mesh._flatten()``)."""

    def __post_init__(self) -> None:
        require(
            not (self.first_layer_stays_sharded and _recomputes_first_layer(self.checkpoint)),
            "first_layer_stays_sharded",
            self.first_layer_stays_sharded,
            "False where the first Linear is checkpointed (its recomputation in backward "
            "needs the weight unsharded, which set_unshard_in_backward(False) forgoes)",
        )

    def with_checkpoint(self, how: Checkpointing | None) -> Knobs:
        """These knobs with ``how``'s checkpointing; the first Linear unsharded in backward
        again where ``how`` recomputes it (the recomputation needs its weight)."""
        stays_sharded = self.first_layer_stays_sharded and not _recomputes_first_layer(how)
        return replace(self, checkpoint=how, first_layer_stays_sharded=stays_sharded)

    def describe(self) -> str:
        turned = {k: v for k, v in self.__dict__.items() if v not in (None, False, 0, ())}
        return ", ".join(f"{k}={v}" for k, v in turned.items())


def _recomputes_first_layer(how: Checkpointing | None) -> bool:
    return how is not None and 0 in how.layers


NO_KNOBS = Knobs()
"""Nothing turned: every control at torch's default."""
