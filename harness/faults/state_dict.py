"""Faults in checkpointing: where DCP writes a shard, and what the distributed optimizer state
dict carries."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._patch import Fault, Patch

_PLANNER_HELPERS = "torch.distributed.checkpoint.planner_helpers"
_STATE_DICT = "torch.distributed.checkpoint.state_dict"


def _with_offsets(item: Any, offsets: tuple[int, ...]) -> Any:
    import dataclasses

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


def _last_entry_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_optim_state_dict(*args: Any, **kwargs: Any) -> Any:
        optim_state_dict = original(*args, **kwargs)
        state = optim_state_dict.get("state")
        if state:
            state.pop(next(reversed(state)))
        return optim_state_dict

    return get_optim_state_dict


FAULTS = (
    Fault(
        id="state_dict.dcp_shard_offset_shifted",
        area="state_dict",
        bug_class="a shard saved at the wrong offset (overlapping its neighbour)",
        summary="dcp.save records the last shard of every sharded DTensor dim one element early",
        patches=(
            Patch(f"{_PLANNER_HELPERS}:_create_write_items_for_dtensor", _last_shard_shifted),
        ),
    ),
    Fault(
        id="state_dict.dcp_shards_mirrored",
        area="state_dict",
        bug_class="shards saved at each other's offsets (a silent permutation)",
        summary="dcp.save records shard i of a sharded dim at shard n-1-i's place; even "
        "shards tile the tensor, so the save plan stays valid",
        patches=(Patch(f"{_PLANNER_HELPERS}:_create_write_items_for_dtensor", _shards_mirrored),),
    ),
    Fault(
        id="state_dict.optim_state_entry_dropped",
        area="state_dict",
        bug_class="one optimizer-state entry skipped in a state dict",
        summary="get_state_dict / get_optimizer_state_dict leave out the last parameter's "
        "optimizer state",
        patches=(Patch(f"{_STATE_DICT}:_get_optim_state_dict", _last_entry_dropped),),
    ),
)
