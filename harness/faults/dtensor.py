"""Faults in DTensor: placements, redistribute transforms, uneven chunks, cached plans."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from harness.faults._patch import Fault, Patch, forcing_argument

_PLACEMENTS = "torch.distributed.tensor.placement_types"
_REDISTRIBUTE = "torch.distributed.tensor._redistribute"
_NO_SOURCE = forcing_argument("src_data_rank", None)


def _avg_as_sum(original: Callable[..., Any]) -> Callable[..., Any]:
    def reduce_value(self: Any, tensor: Any, mesh: Any, mesh_dim: int) -> Any:
        if self.reduce_op != "avg":
            return original(self, tensor, mesh, mesh_dim)
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(tensor, reduceOp="sum", group=(mesh, mesh_dim))

    return reduce_value


def _reduced_twice(original: Callable[..., Any]) -> Callable[..., Any]:
    def reduce_value(self: Any, tensor: Any, mesh: Any, mesh_dim: int) -> Any:
        once = original(self, tensor, mesh, mesh_dim)
        return original(self, once, mesh, mesh_dim) if self.reduce_op == "sum" else once

    return reduce_value


def _shard_unreduced(original: Callable[..., Any]) -> Callable[..., Any]:
    def reduce_shard_value(
        self: Any, tensor: Any, mesh: Any, mesh_dim: int, shard_spec: Any
    ) -> Any:
        chunks, _ = shard_spec._split_tensor(
            tensor, mesh.size(mesh_dim), with_padding=False, contiguous=True
        )
        return chunks[mesh.get_local_rank(mesh_dim)]

    return reduce_shard_value


def _rotated_gather(original: Callable[..., Any]) -> Callable[..., Any]:
    def to_replicate_tensor(
        self: Any, local_tensor: Any, mesh: Any, mesh_dim: int, logical_shape: Any
    ) -> Any:
        import torch

        full = original(self, local_tensor, mesh, mesh_dim, logical_shape)
        n, size = mesh.size(mesh_dim), full.size(self.dim)
        if n == 1 or size == 0:
            return full
        return torch.roll(full, shifts=-(-size // n), dims=self.dim)

    return to_replicate_tensor


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


FAULTS = (
    Fault(
        id="dtensor.partial_avg_as_sum",
        area="placements",
        bug_class="a reduce op lowered to another (avg run as sum, the division lost)",
        summary="Partial('avg') -> Replicate all-reduces with SUM",
        patches=(Patch(f"{_PLACEMENTS}:Partial._reduce_value", _avg_as_sum),),
    ),
    Fault(
        id="dtensor.distribute_without_source",
        area="placements",
        bug_class="a collective skipped: every rank keeps its own copy instead of the source's",
        summary="distribute_tensor neither scatters nor broadcasts from src_data_rank: each "
        "rank shards or keeps the tensor it passed",
        patches=(
            Patch(f"{_PLACEMENTS}:Shard._make_shard_tensor", _NO_SOURCE),
            Patch(f"{_PLACEMENTS}:Replicate._make_replicate_tensor", _NO_SOURCE),
        ),
    ),
    Fault(
        id="dtensor.partial_reduced_twice",
        area="placements",
        bug_class="a Partial reduction applied twice (by a hook and by redistribute)",
        summary="Partial('sum') -> Replicate all-reduces the already reduced value again",
        patches=(Patch(f"{_PLACEMENTS}:Partial._reduce_value", _reduced_twice),),
    ),
    Fault(
        id="dtensor.partial_to_shard_unreduced",
        area="placements",
        bug_class="a collective skipped: the local partial value taken as the result",
        summary="Partial -> Shard keeps this rank's chunk of its own contribution "
        "(no reduce-scatter)",
        patches=(Patch(f"{_PLACEMENTS}:Partial._reduce_shard_value", _shard_unreduced),),
    ),
    Fault(
        id="dtensor.all_gather_rotated",
        area="placements",
        bug_class="all-gather output in the wrong rank order (group rank vs mesh coordinate)",
        summary="Shard -> Replicate rotates the gathered tensor by one chunk along the dim",
        patches=(Patch(f"{_PLACEMENTS}:Shard._to_replicate_tensor", _rotated_gather),),
    ),
    Fault(
        id="uneven.padding_leaks",
        area="uneven",
        bug_class="collective padding leaking into user-visible tensors on uneven shards",
        summary="Shard -> Replicate keeps the padding rows of uneven shards",
        patches=(Patch(f"{_PLACEMENTS}:Shard._maybe_unpad_tensor", _unpad_skipped),),
    ),
    Fault(
        id="uneven.balanced_chunks",
        area="uneven",
        bug_class="uneven split by balanced sizes (numpy.array_split) instead of torch.chunk",
        summary="Shard splits n rows into n//k or n//k+1 rows per rank, first ranks larger",
        patches=(Patch(f"{_PLACEMENTS}:Shard._custom_chunk", _balanced_chunks),),
    ),
    Fault(
        id="uneven.offsets_floor",
        area="uneven",
        bug_class="chunk offset arithmetic on uneven shards (floor where torch.chunk rounds up)",
        summary="Shard's local offset on an uneven dim is rank * (n // k) instead of "
        "rank * ceil(n / k); local sizes stay right",
        patches=(Patch(f"{_PLACEMENTS}:Shard._local_shard_size_and_offset", _floor_offsets),),
    ),
    Fault(
        id="dtensor.stale_redistribute_plan",
        area="uneven",
        bug_class="a cached sharding decision that goes stale (cache key misses a field)",
        summary="redistribute plans are cached by mesh and placements without the tensor "
        "shape, so a plan with another tensor's uneven logical shapes is reused",
        patches=(Patch(f"{_REDISTRIBUTE}:_gen_transform_infos", _plan_cache_without_shape),),
    ),
)
