"""Faults in uneven sharding: torch.chunk's sizes and offsets, padding, global offsets and shapes
of uneven shards, plans cached across shapes, FSDP2's padded gradient buffers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from harness.faults._origin import WITH_THE_PROPERTY, blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import forcing_argument, rewritten
from harness.faults.held_out import DTENSOR_DEPTH, FIRST

_API = "torch.distributed.tensor._api"
_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
_PLACEMENTS = "torch.distributed.tensor.placement_types"
_REDISTRIBUTE = "torch.distributed.tensor._redistribute"
_UTILS = "torch.distributed.tensor._utils"


def _unpad_skipped(original: Callable[..., Any]) -> Callable[..., Any]:
    def maybe_unpad_tensor(self: Any, local_tensor: Any, logical_dim_size: Any, n: int) -> Any:
        return local_tensor.contiguous()

    return maybe_unpad_tensor


def _balanced_chunks(original: Callable[..., Any]) -> Callable[..., Any]:
    def custom_chunk(tensor: Any, num_chunks: int, dim: int) -> list[Any]:
        size = tensor.size(dim)
        base, extra = divmod(size, num_chunks)
        sizes = [base + (i < extra) for i in range(num_chunks)]
        return list(tensor.split(sizes, dim=dim))

    return custom_chunk


def _floor_offsets(original: Callable[..., Any]) -> Callable[..., Any]:
    def local_shard_size_and_offset(
        self: Any, curr_local_size: int, num_chunks: int, rank: Any
    ) -> tuple[Any, Any]:
        size, offset = original(self, curr_local_size, num_chunks, rank)
        if curr_local_size % num_chunks == 0 or size == 0:
            return size, offset
        return size, (curr_local_size // num_chunks) * rank

    return local_shard_size_and_offset


def _plan_cache_without_shape(original: Callable[..., Any]) -> Callable[..., Any]:
    plans: dict[Any, Any] = {}
    uncached = getattr(original, "__wrapped__", original)

    def gen_transform_infos(src_spec: Any, dst_spec: Any, use_graph: Any = None) -> Any:
        key = (src_spec.mesh, src_spec.placements, dst_spec.placements, use_graph)
        if key not in plans:
            plans[key] = uncached(src_spec, dst_spec, use_graph)
        return plans[key]

    functools.update_wrapper(gen_transform_infos, original)
    gen_transform_infos.cache_clear = plans.clear  # type: ignore[attr-defined]
    return gen_transform_infos


def _shape_stride_ignored(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(
        ctx: Any,
        input: Any,
        device_mesh: Any,
        placements: Any,
        run_check: bool,
        shape: Any = None,
        stride: Any = None,
        grad_placements: Any = None,
    ) -> Any:
        # Global shape and stride always inferred as if every rank held an even shard.
        return original(ctx, input, device_mesh, placements, run_check, None, None, grad_placements)

    return forward


# Offset bookkeeping in foreach_reduce: each parameter's slice of the reduce-scatter output is
# padded_unsharded_numel // world_size long, whatever its real shard size.
_OFFSET_EDIT = (
    "padded_sharded_numel = padded_unsharded_size.numel() // world_size",
    "padded_sharded_numel = fsdp_param.sharded_size.numel()",
)


FAULTS: tuple[Fault, ...] = (
    Fault(
        id="uneven.padding_leaks",
        area="uneven",
        bug_class="collective padding leaking into user-visible tensors on uneven shards",
        summary="Shard -> Replicate keeps the padding rows of uneven shards",
        patches=(Patch(f"{_PLACEMENTS}:Shard._maybe_unpad_tensor", _unpad_skipped),),
        origin=WITH_THE_PROPERTY,
    ),
    Fault(
        id="uneven.balanced_chunks",
        area="uneven",
        bug_class="uneven split by balanced sizes (numpy.array_split) instead of torch.chunk",
        summary="Shard splits n rows into n//k or n//k+1 rows per rank, first ranks larger",
        patches=(Patch(f"{_PLACEMENTS}:Shard._custom_chunk", _balanced_chunks),),
        origin=WITH_THE_PROPERTY,
    ),
    Fault(
        id="uneven.offsets_floor",
        area="uneven",
        bug_class="chunk offset arithmetic on uneven shards (floor where torch.chunk rounds up)",
        summary="Shard's local offset on an uneven dim is rank * (n // k) instead of "
        "rank * ceil(n / k); local sizes stay right",
        patches=(Patch(f"{_PLACEMENTS}:Shard._local_shard_size_and_offset", _floor_offsets),),
        origin=WITH_THE_PROPERTY,
    ),
    Fault(
        id="dtensor.stale_redistribute_plan",
        area="uneven",
        bug_class="a cached sharding decision that goes stale (cache key misses a field)",
        summary="redistribute plans are cached by mesh and placements without the tensor "
        "shape, so a plan with another tensor's uneven logical shapes is reused",
        patches=(Patch(f"{_REDISTRIBUTE}:_gen_transform_infos", _plan_cache_without_shape),),
        origin=WITH_THE_PROPERTY,
    ),
    # https://github.com/pytorch/pytorch/issues/161368 (and PR #107996, which introduced
    # global offsets because local offsets were wrong for a dim sharded on several mesh dims):
    # compute_local_shape_and_global_offset gave wrong offsets for 2-D (nested) sharding.
    Fault(
        id="uneven.global_offset_not_composed",
        area="uneven",
        bug_class="offset relative to the parent shard reported as the global offset",
        summary="compute_local_shape_and_global_offset drops the offsets of earlier mesh "
        "dims on the same tensor dim: with (S(0), S(0)) a shard's offset is its position "
        "inside the outer shard, not in the global tensor; local shapes stay right",
        patches=(
            Patch(
                f"{_UTILS}:_get_shard_size_and_offsets",
                forcing_argument("previous_offsets", None),
            ),
        ),
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/issues/161368", survived_before=False
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/110762 (fixed by PR #110781, from_local's
    # shape/stride arguments): from_local on unevenly sharded local tensors gave each rank a
    # different, wrong global size (local size x mesh size).
    Fault(
        id="uneven.from_local_shape_stride_ignored",
        area="uneven",
        bug_class="a caller-given global shape ignored for uneven shards",
        summary="DTensor.from_local ignores shape= and stride=: the global shape is the "
        "local size times the mesh size on every rank, so uneven shards (and the gradients "
        "to_local's backward rebuilds with the forward shape) get rank-dependent wrong sizes",
        patches=(Patch(f"{_API}:_FromTorchTensor.forward", _shape_stride_ignored),),
        origin=blind(
            DTENSOR_DEPTH, "https://github.com/pytorch/pytorch/issues/110762", survived_before=False
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/174862 (bug class: foreach_reduce's flat_grad_offset
    # bookkeeping; that PR fixes the offset when a rank has no gradient for a parameter). Each
    # parameter's slice of the reduce-scatter output must advance by the *padded* shard numel.
    Fault(
        id="fsdp.reduce_offset_unpadded",
        area="uneven",
        bug_class="offset bookkeeping: a flat buffer walked with unpadded instead of padded sizes",
        summary="FSDP2's foreach_reduce advances the offset into the reduce-scatter output by "
        "the parameter's real (unpadded) shard numel, so on a rank whose shard of an unevenly "
        "sharded parameter is padded, every later parameter's gradient is read from the wrong "
        "place",
        patches=(Patch(f"{_PARAM_GROUP}:foreach_reduce", rewritten(_OFFSET_EDIT)),),
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/pull/174862", survived_before=False
        ),
    ),
)
