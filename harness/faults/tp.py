"""Faults in tensor parallelism: what a parallel style does with a layer's partial output,
Replicate -> Partial, vocab-parallel embeddings and loss_parallel."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._origin import WITH_THE_PROPERTY, blind
from harness.faults._patch import Fault, Patch
from harness.faults.held_out import FIRST

_LOSS = "torch.distributed.tensor.parallel.loss"
_MASK = "torch.distributed.tensor._ops._mask_buffer"
_PLACEMENTS = "torch.distributed.tensor.placement_types"
_STYLE = "torch.distributed.tensor.parallel.style"


def _partial_output_kept_local(original: Callable[..., Any]) -> Callable[..., Any]:
    def prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: Any, outputs: Any, device_mesh: Any
    ) -> Any:
        from torch.distributed.tensor import DTensor

        if any(placement.is_partial() for placement in outputs.placements):
            outputs = DTensor.from_local(
                outputs.to_local(), device_mesh, output_layouts, run_check=False
            )
        return original(output_layouts, use_local_output, mod, outputs, device_mesh)

    return prepare_output_fn


def _partition_unscaled(original: Callable[..., Any]) -> Callable[..., Any]:
    def _partition_value(self: Any, tensor: Any, mesh: Any, mesh_dim: int) -> Any:
        if self.reduce_op == "sum":
            return tensor
        return original(self, tensor, mesh, mesh_dim)

    return _partition_value


def _mask_not_applied(original: Callable[..., Any]) -> Callable[..., Any]:
    def apply_mask(self: Any, tensor: Any) -> None:
        if self.refcount == 0 or self.data is None:
            raise RuntimeError("MaskBuffer has not been materialized")

    return apply_mask


def _local_log_softmax(original: Callable[..., Any]) -> Callable[..., Any]:
    def _log_softmax(x: Any, dim: int, half_to_float: bool, mesh: Any, mesh_dim: int) -> Any:
        import torch

        return torch.ops.aten._log_softmax.default(x, dim, half_to_float)

    return _log_softmax


FAULTS: tuple[Fault, ...] = (
    Fault(
        id="tp.rowwise_output_not_reduced",
        area="tp",
        bug_class="a partial result relabelled instead of reduced",
        summary="RowwiseParallel declares each rank's partial output to be the replicated "
        "(or sharded) result without the all-reduce / reduce-scatter",
        patches=(
            Patch(f"{_STYLE}:RowwiseParallel._prepare_output_fn", _partial_output_kept_local),
        ),
        origin=WITH_THE_PROPERTY,
    ),
    # Bug class: row-parallel linear bias multi-added by the TP degree
    # (https://github.com/huggingface/text-generation-inference/issues/1036,
    # https://github.com/awslabs/slapo/issues/10); DTensor avoids it by dividing a replicated
    # value when it becomes Partial("sum") (https://github.com/pytorch/pytorch/pull/110898).
    Fault(
        id="tp.replicate_to_partial_unscaled",
        area="tp",
        bug_class="a replicated addend counted once per rank in a partial sum",
        summary="Replicate -> Partial('sum') keeps the full value on every rank (no division "
        "by the mesh dim size), so RowwiseParallel's bias (addmm with a Partial mm) is added "
        "world-size times",
        patches=(Patch(f"{_PLACEMENTS}:Partial._partition_value", _partition_unscaled),),
        origin=blind(
            FIRST,
            "https://github.com/huggingface/text-generation-inference/issues/1036",
            "https://github.com/awslabs/slapo/issues/10",
            "https://github.com/pytorch/pytorch/pull/110898",
            survived_before=False,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/131264 (mask state mixed up between embeddings)
    # and PR #185356 (mask state lost under compile): rowwise (vocab) sharded embedding relies
    # on _MaskPartial zeroing the rows of out-of-shard ids before the all-reduce.
    Fault(
        id="tp.mask_partial_mask_not_applied",
        area="tp",
        bug_class="a masked partial reduced without its mask",
        summary="MaskBuffer.apply_mask does nothing, so vocab-sharded embedding (and "
        "loss_parallel's target gather) sums every rank's row 0 into the result for ids "
        "outside that rank's shard",
        patches=(Patch(f"{_MASK}:MaskBuffer.apply_mask", _mask_not_applied),),
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/pull/131264", survived_before=False
        ),
    ),
    # Bug class: vocab-parallel cross entropy normalised over the local vocab partition only
    # (https://github.com/bigscience-workshop/Megatron-DeepSpeed/issues/394); torch's
    # loss_parallel all-reduces max and sum-exp across the class shards
    # (https://github.com/pytorch/pytorch/pull/119877).
    Fault(
        id="tp.loss_parallel_local_logsumexp",
        area="tp",
        bug_class="a softmax normaliser computed over the local shard only (missing all-reduce)",
        summary="loss_parallel's log_softmax on class-sharded logits uses each rank's local "
        "logsumexp, so cross_entropy's loss and its fused gradient are wrong",
        patches=(Patch(f"{_LOSS}:_log_softmax", _local_log_softmax),),
        origin=blind(
            FIRST,
            "https://github.com/bigscience-workshop/Megatron-DeepSpeed/issues/394",
            "https://github.com/pytorch/pytorch/pull/119877",
            survived_before=True,
        ),
    ),
)
