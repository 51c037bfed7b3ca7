"""Cases of the FSDP2 controls real training turns (``Knobs``) and of mixed-precision
policies per module (``Precision``), which ``harness.strategies.knobs`` draws."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from harness.cases.checkpointing import Checkpointing
from harness.errors import check_one_of, require

PRECISION_DTYPES = ("bfloat16", "float32")
FORWARD_METHODS = ("encode", "generate")
"""Names a model's second forward-like method takes (``Knobs.forward_method``)."""


@dataclass(frozen=True, kw_only=True)
class Precision:
    """``fully_shard``'s ``MixedPrecisionPolicy``: one for the root, one per Linear.

    The root's ``param_dtype`` casts the model's inputs (``cast_forward_inputs``, unless
    ``root_casts_inputs`` is False), each Linear's computes in its own ``param_dtype``
    (casting its inputs to it), gradients are reduced in ``reduce_dtype``, and the root
    casts its output to ``output_dtype``."""

    layer_dtypes: tuple[str, ...]
    """Each Linear's ``param_dtype``, in model order."""
    root_dtype: str | None = None
    """The root's ``param_dtype`` (None: the root casts nothing)."""
    reduce_dtype: str = "float32"
    output_dtype: str | None = None
    root_casts_inputs: bool = True
    """The root policy's ``cast_forward_inputs``: False leaves the model's inputs in their
    own dtype (the first Linear still casts them to its own)."""

    def __post_init__(self) -> None:
        for index, dtype in enumerate(self.layer_dtypes):
            check_one_of(f"layer_dtypes[{index}]", dtype, PRECISION_DTYPES)
        for name in ("root_dtype", "output_dtype"):
            if getattr(self, name) is not None:
                check_one_of(name, getattr(self, name), PRECISION_DTYPES)
        check_one_of("reduce_dtype", self.reduce_dtype, ("float32",))

    def describe(self) -> str:
        output = f", output {self.output_dtype}" if self.output_dtype else ""
        uncast = "" if self.root_casts_inputs else " (cast_forward_inputs=False)"
        return (
            f"mixed precision: root {self.root_dtype}{uncast}, layers "
            f"{list(self.layer_dtypes)}, reduce {self.reduce_dtype}{output}"
        )

    @property
    def input_dtype(self) -> str | None:
        """The dtype the root casts the model's inputs to; None: it leaves them alone."""
        return self.root_dtype if self.root_casts_inputs else None


@dataclass(frozen=True, kw_only=True)
class Knobs:
    """The FSDP2 controls real training turns, each set on every ``fully_shard`` module.

    None of them may change what training computes, except ``divide_factor``: gradients
    are summed over the data-parallel ranks and divided by it instead of averaged."""

    divide_factor: float | None = None
    """``set_gradient_divide_factor`` (or its deprecated spelling, ``set_reduce_scatter_
    divide_factor``, when ``deprecated_spelling``)."""
    deprecated_spelling: bool = False
    force_sum_reduction: bool | None = None
    """``set_force_sum_reduction_for_comms(True)``: sum-only collectives, scaled locally;
    False: the same call with False (torch's default, said explicitly); None: not called."""
    hold_all_reduce: bool = False
    """``set_requires_all_reduce(False)`` before every micro-batch but the last (HSDP)."""
    hold_reshard: bool = False
    """``set_reshard_after_backward(False)`` before every micro-batch but the last."""
    mark_last_backward: bool = False
    """``set_is_last_backward`` True before the last micro-batch only."""
    recurse: bool = True
    """The micro-batch controls (``set_requires_gradient_sync``, ``set_requires_all_reduce``,
    ``set_reshard_after_backward``) set with ``recurse=False``: on the root's own group only
    (which holds no parameter: every Linear is sharded on its own), so the Linears sync,
    all-reduce and reshard after every micro-batch, which sums the same gradients."""
    reshard_to: int | None = None
    """``reshard_after_forward`` as an int: reshard to groups of this many ranks."""
    reset_reshard_after_forward: tuple[bool, bool] | None = None
    """``set_reshard_after_forward(value, recurse)`` on the root after sharding, as
    ``(value, recurse)``; None: not called."""
    first_layer_stays_sharded: bool = False
    """``set_unshard_in_backward(False)`` on the first Linear, whose weight its backward
    does not need (the model's input needs no gradient)."""
    first_layer_unshards: bool = False
    """``set_unshard_in_backward(True)`` on the first Linear: torch's default, said
    explicitly."""
    explicit_unshard: bool = False
    """``unshard(async_op=unshard_async)`` on every module before each forward, ``reshard()``
    after each optimizer step."""
    unshard_async: bool = True
    """``explicit_unshard``'s ``async_op``: True waits on each handle, False returns
    unsharded."""
    forward_prefetch: tuple[tuple[int, ...], ...] = ()
    """``set_modules_to_forward_prefetch``: for each Linear, the Linears (by position) it
    prefetches in forward; () sets nothing."""
    backward_prefetch: tuple[tuple[int, ...], ...] = ()
    """``set_modules_to_backward_prefetch``, likewise."""
    keyword_input: bool = False
    """The model is called with its input as a keyword argument (``model(input=x)``)."""
    forward_method: str | None = None
    """The model is called through this method (one of ``FORWARD_METHODS``: its forward
    under another name), which ``register_fsdp_forward_method`` registers on the root;
    None: through ``forward``."""
    checkpoint: Checkpointing | None = None
    """Activation checkpointing of some Linears (through one of torch's APIs) before
    sharding; None: none."""
    flatten: tuple[int, int] | None = None
    """fsdp: the 1-D mesh is this 2-D mesh flattened (``mesh._flatten()``)."""
    reduce_scatter_unused: tuple[bool, bool] | None = None
    """``set_reduce_scatter_unused_params(value, recurse=recurse)`` on the root, as
    ``(value, recurse)`` (every parameter is used: nothing to add); None: not called."""
    separate_reduce_scatter: tuple[bool, bool] | None = None
    """``set_separate_reduce_scatter_group(enable, recurse=recurse)`` on the root, as
    ``(enable, recurse)``: reduce-scatters on a process group of their own over the same
    ranks; None: not called."""
    custom_all_gather: bool | None = None
    """``set_custom_all_gather`` on every module: a ``Comm`` forwarding to
    ``all_gather_single``, its staging buffers zeroed (True) or left empty (False);
    None: FSDP's own."""
    custom_reduce_scatter: bool | None = None
    """``set_custom_reduce_scatter``, likewise (``reduce_scatter_single``)."""
    group_allocates: bool | None = None
    """``set_allocate_memory_from_process_group_for_comm(value)`` on every module (torch
    refuses it with custom collectives); None: not called."""

    def __post_init__(self) -> None:
        if self.forward_method is not None:
            check_one_of("forward_method", self.forward_method, FORWARD_METHODS)
        custom = self.custom_all_gather is not None or self.custom_reduce_scatter is not None
        require(
            not (custom and self.group_allocates is not None),
            "group_allocates",
            self.group_allocates,
            "None with custom collectives (torch allocates their buffers through them)",
        )
        require(
            not (self.first_layer_stays_sharded and self.first_layer_unshards),
            "first_layer_unshards",
            self.first_layer_unshards,
            "False where first_layer_stays_sharded (one call each)",
        )
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
        """The knobs turned from torch's defaults (``False`` said explicitly counts)."""
        turned = {f.name: getattr(self, f.name) for f in fields(self)}
        shown = {k: v for k, v in turned.items() if v != getattr(NO_KNOBS, k) and v != ()}
        return ", ".join(f"{k}={v}" for k, v in shown.items())


def _recomputes_first_layer(how: Checkpointing | None) -> bool:
    return how is not None and 0 in how.layers


NO_KNOBS = Knobs()
"""Nothing turned: every control at torch's default."""
