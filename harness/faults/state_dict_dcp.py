"""Faults in distributed checkpoints (DCP): where a save writes each shard and which copies its
deduplication keeps, how a load plans its reads across layouts and writes back what it read,
strict loading."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

from harness.faults._origin import WITH_THE_PROPERTY, blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import forcing_argument
from harness.faults.held_out import DTENSOR_DEPTH, FIRST

_DEFAULT_PLANNER = "torch.distributed.checkpoint.default_planner"
_PLANNER_HELPERS = "torch.distributed.checkpoint.planner_helpers"


def _with_offsets(item: Any, offsets: tuple[int, ...]) -> Any:
    import torch

    moved = torch.Size(offsets)
    chunk = dataclasses.replace(item.tensor_data.chunk, offsets=moved)
    tensor_data = dataclasses.replace(item.tensor_data, chunk=chunk)
    index = dataclasses.replace(item.index, offset=moved)
    return dataclasses.replace(item, index=index, tensor_data=tensor_data)


def _last_shard_shifted(original: Callable[..., Any]) -> Callable[..., Any]:
    def create_write_items_for_dtensor(fqn: str, tensor: Any) -> Any:
        item = original(fqn, tensor)
        chunk, size = item.tensor_data.chunk, item.tensor_data.size
        for dim, (offset, length) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
            if offset > 0 and length > 0 and offset + length == size[dim]:
                offsets = list(chunk.offsets)
                offsets[dim] -= 1
                return _with_offsets(item, tuple(offsets))
        return item

    return create_write_items_for_dtensor


def _shards_mirrored(original: Callable[..., Any]) -> Callable[..., Any]:
    def create_write_items_for_dtensor(fqn: str, tensor: Any) -> Any:
        item = original(fqn, tensor)
        chunk, size = item.tensor_data.chunk, item.tensor_data.size
        for dim, (offset, length) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
            if length < size[dim]:
                offsets = list(chunk.offsets)
                offsets[dim] = size[dim] - offset - length
                return _with_offsets(item, tuple(offsets))
        return item

    return create_write_items_for_dtensor


def _one_element_overlap_missed(original: Callable[..., Any]) -> Callable[..., Any]:
    def _check_shard_metadata_pair_overlap(shard1: Any, shard2: Any) -> bool:
        for off1, size1, off2, size2 in zip(
            shard1.offsets, shard1.sizes, shard2.offsets, shard2.sizes, strict=True
        ):
            if off1 >= off2 + size2 or off2 >= off1 + size1:
                return False
            # Partly overlapping intervals compared one element short: [a, b) and [c, d)
            # taken to overlap only if a < d - 1 and c < b - 1.
            if (off1, size1) != (off2, size2) and (
                off1 >= off2 + size2 - 1 or off2 >= off1 + size1 - 1
            ):
                return False
        return True

    return _check_shard_metadata_pair_overlap


def _strided_as_plain_shard(original: Callable[..., Any]) -> Callable[..., Any]:
    def compute_local_shape_and_global_offset(
        global_shape: Any, mesh: Any, placements: Any, skip_offset: bool = False
    ) -> Any:
        from torch.distributed.tensor.placement_types import Shard, _StridedShard

        plain = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements]
        return original(global_shape, mesh, plain, skip_offset)

    return compute_local_shape_and_global_offset


def _replicas_all_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    def dedup_save_plans(all_plans: list[Any], save_to_lowest_rank: bool = False) -> list[Any]:
        from torch.distributed.checkpoint.planner import WriteItemType

        copies = Counter(item.index for plan in all_plans for item in plan.items)
        deduped = original(all_plans, save_to_lowest_rank)
        return [
            dataclasses.replace(
                plan,
                items=[
                    item
                    for item in plan.items
                    if item.type != WriteItemType.SHARD or copies[item.index] == 1
                ],
            )
            for plan in deduped
        ]

    return dedup_save_plans


def _bytes_into_flat_copy(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_bytes(self: Any, read_item: Any, value: Any) -> None:
        if not self.flatten_state_dict:
            original(self, read_item, value)
            return None
        import torch

        # The flattened dict is a planner-private copy: the caller's (nested) state dict,
        # where lr / param_groups / python scalars live, never sees the loaded value.
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=False)
        return None

    return load_bytes


def _dest_offset_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    def _shards_get_overlap_region_wrt_saved_tensor(saved_shard: Any, current_shard: Any) -> Any:
        return [
            (dim, saved_offset, 0, length)
            for dim, saved_offset, _current_offset, length in original(saved_shard, current_shard)
        ]

    return _shards_get_overlap_region_wrt_saved_tensor


FAULTS: tuple[Fault, ...] = (
    Fault(
        id="state_dict.dcp_shard_offset_shifted",
        area="state_dict",
        bug_class="a shard saved at the wrong offset (overlapping its neighbour)",
        summary="dcp.save records the last shard of every sharded DTensor dim one element early",
        patches=(
            Patch(f"{_PLANNER_HELPERS}:_create_write_items_for_dtensor", _last_shard_shifted),
        ),
        origin=WITH_THE_PROPERTY,
    ),
    Fault(
        id="state_dict.dcp_shards_mirrored",
        area="state_dict",
        bug_class="shards saved at each other's offsets (a silent permutation)",
        summary="dcp.save records shard i of a sharded dim at shard n-1-i's place; even "
        "shards tile the tensor, so the save plan stays valid",
        patches=(Patch(f"{_PLANNER_HELPERS}:_create_write_items_for_dtensor", _shards_mirrored),),
        origin=WITH_THE_PROPERTY,
    ),
    # https://github.com/pytorch/pytorch/issues/129079 (fixed by PR #129398): after a 2.3
    # regression, dcp.load restored tensors in place but non-tensor values such as the
    # optimizer's learning rate were no longer written back into the caller's state dict.
    Fault(
        id="state_dict.dcp_non_tensor_values_not_loaded",
        area="state_dict",
        bug_class="loaded values written into a private copy instead of the caller's object",
        summary="dcp.load (DefaultLoadPlanner with flatten_state_dict) puts every non-tensor "
        "value it reads (param_groups lr/betas, python ints/floats, strings) into the "
        "planner's flattened copy only; the caller's state dict keeps its old values",
        patches=(
            Patch(f"{_DEFAULT_PLANNER}:DefaultLoadPlanner.load_bytes", _bytes_into_flat_copy),
        ),
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/issues/129079", survived_before=False
        ),
    ),
    # https://github.com/pytorch/xla/pull/7155 (same DCP read-item contract; cf. the
    # resharding failures in https://github.com/pytorch/torchtitan/issues/811): ReadItem
    # destination offsets were computed wrongly, so checkpoints loaded at another topology
    # landed at the wrong place in the local shard.
    Fault(
        id="state_dict.dcp_reshard_dest_offset_dropped",
        area="state_dict",
        bug_class="resharding overlap computed with a wrong destination offset",
        summary="dcp.load's overlap computation reports destination offset 0 even when the "
        "saved chunk starts inside the local chunk: loading into bigger local chunks than were "
        "saved (fewer ranks, or a full tensor) stacks every saved chunk at the start of the "
        "local tensor and leaves the rest unloaded",
        patches=(
            Patch(
                f"{_PLANNER_HELPERS}:_shards_get_overlap_region_wrt_saved_tensor",
                _dest_offset_dropped,
            ),
        ),
        origin=blind(
            FIRST,
            "https://github.com/pytorch/xla/pull/7155",
            "https://github.com/pytorch/torchtitan/issues/811",
            survived_before=False,
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/148252 (strict behaviour of DCP loading;
    # PR #123869 added allow_partial_load): a key of the state dict that the checkpoint does
    # not hold must raise unless partial loading was asked for.
    Fault(
        id="state_dict.dcp_load_missing_keys_silently_skipped",
        area="state_dict",
        bug_class="strict loading silently downgraded (keys silently dropped)",
        summary="dcp.load with the default planner (allow_partial_load=False) silently skips "
        "state-dict keys missing from the checkpoint instead of raising; those entries keep "
        "their pre-load values",
        patches=(
            Patch(
                f"{_DEFAULT_PLANNER}:create_default_local_load_plan",
                forcing_argument("strict", False),
            ),
        ),
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/issues/148252", survived_before=True
        ),
    ),
    # https://github.com/pytorch/torchtitan/issues/811 (FSDP checkpoints failing to load into
    # a larger world) and PR https://github.com/pytorch/pytorch/pull/169115 (the rewrite of
    # create_read_items_for_chunk_list, which decides for each saved chunk whether it
    # overlaps the local one); bug class: an off-by-one in that interval overlap test.
    Fault(
        id="state_dict.dcp_reshard_one_row_overlap_missed",
        area="state_dict",
        bug_class="a resharding read skipped: interval overlap off by one",
        summary="DCP's load planner takes a saved chunk that overlaps the local chunk by "
        "exactly one element along some dim as disjoint, so when the save and load layouts "
        "differ (other world size, mesh or uneven split) that row is never read and keeps "
        "the destination's old value",
        patches=(
            Patch(
                f"{_PLANNER_HELPERS}:_check_shard_metadata_pair_overlap",
                _one_element_overlap_missed,
            ),
        ),
        origin=blind(
            DTENSOR_DEPTH,
            "https://github.com/pytorch/torchtitan/issues/811",
            "https://github.com/pytorch/pytorch/pull/169115",
            survived_before=False,
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/129229 (FSDP+TP full tensors wrong until
    # _StridedShard, PR #130760) and PR #150393 ("DCP relies on the local-shape / global-offset
    # for each rank being correct"): chunk offsets of a _StridedShard DTensor computed as if
    # it were a plain nested Shard.
    Fault(
        id="state_dict.dcp_strided_shard_offsets_as_shard",
        area="state_dict",
        bug_class="checkpoint chunk offsets computed for the wrong sharding order",
        summary="DCP's write items and load chunks treat _StridedShard(d, sf) as Shard(d): a "
        "(_StridedShard(0, 2), Shard(0)) parameter (FSDP over TP) is saved with the chunks "
        "of (Shard(0), Shard(0)), permuting rows; reloading into the same layout hides it, "
        "any other layout reads permuted rows",
        patches=(
            Patch(
                f"{_PLANNER_HELPERS}:compute_local_shape_and_global_offset",
                _strided_as_plain_shard,
            ),
        ),
        origin=blind(
            DTENSOR_DEPTH, "https://github.com/pytorch/pytorch/issues/129229", survived_before=False
        ),
    ),
    # https://github.com/pytorch/xla/pull/7929 (the dedup helper "will erase all WriteItems
    # for shards" it considers duplicated, pytorch/xla#7919) and
    # https://github.com/pytorch/pytorch/issues/120356 (dedup dropping items that must be
    # kept): deduplication must keep exactly one copy of each replicated chunk.
    Fault(
        id="state_dict.dcp_dedup_drops_every_replica",
        area="state_dict",
        bug_class="deduplication removing every copy instead of all but one",
        summary="DCP's save-plan dedup removes a DTensor chunk from every plan that holds it "
        "when more than one rank does: a DTensor with a Replicate mesh dim (Replicate, or "
        "(Replicate, Shard) HSDP) is missing from the checkpoint; sharded-only ones survive",
        patches=(Patch(f"{_DEFAULT_PLANNER}:dedup_save_plans", _replicas_all_dropped),),
        origin=blind(
            DTENSOR_DEPTH,
            "https://github.com/pytorch/xla/pull/7929",
            "https://github.com/pytorch/pytorch/issues/120356",
            survived_before=False,
        ),
    ),
)
