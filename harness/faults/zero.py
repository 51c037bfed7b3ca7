"""Faults in ZeroRedundancyOptimizer: its partition, its consolidated state dict, its param groups
and their sync, its bucket views and DDP-overlap bucket sharding."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._origin import WITH_THE_PROPERTY, blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import forcing_argument
from harness.faults.held_out import FIRST, TRAINING_KNOBS

_ZERO = "torch.distributed.optim.zero_redundancy_optimizer"


def _state_swapped(original: Callable[..., Any]) -> Callable[..., Any]:
    def state_dict(self: Any) -> dict[str, Any]:
        consolidated: dict[str, Any] = original(self)
        state = consolidated["state"]
        same_shape = _first_pair_of_same_shape(state)
        if same_shape is not None:
            i, j = same_shape
            state[i], state[j] = state[j], state[i]
        return consolidated

    return state_dict


def _first_pair_of_same_shape(state: dict[int, Any]) -> tuple[int, int] | None:
    """Two parameter indices whose states have equal shapes (so a swap loads cleanly)."""
    seen: dict[Any, int] = {}
    for index, entry in state.items():
        shapes = tuple(tuple(getattr(v, "shape", ())) for v in entry.values())
        if shapes in seen:
            return seen[shapes], index
        seen[shapes] = index
    return None


def _round_robin_partition(original: Callable[..., Any]) -> Callable[..., Any]:
    def partition_parameters(self: Any, params_per_rank: Any = None) -> Any:
        if params_per_rank is not None or self._partition_parameters_cache:
            return original(self, params_per_rank)
        ranks = self.world_size
        self._partition_parameters_cache = [[] for _ in range(ranks)]
        for group in self.param_groups:
            params = group["params"]
            self._partition_param_group(group, [params[r::ranks] for r in range(ranks)])
        return self._partition_parameters_cache

    return partition_parameters


def _new_group_inserted_first(original: Callable[..., Any]) -> Callable[..., Any]:
    def add_param_group(self: Any, param_group: dict[str, Any]) -> None:
        before = len(self.optim.param_groups) if getattr(self, "initialized", False) else None
        original(self, param_group)
        groups = self.optim.param_groups if before is not None else []
        if before is not None and len(groups) == before + 1:
            # The local shard of the new group goes to the front, while every later
            # _sync_param_groups still pairs exposed and local groups by position.
            groups.insert(0, groups.pop())

    return add_param_group


def _param_group_options_not_overwritten(original: Callable[..., Any]) -> Callable[..., Any]:
    def sync_param_groups(src_param_groups: Any, dst_param_groups: Any) -> None:
        if len(src_param_groups) != len(dst_param_groups):
            raise AssertionError(
                "Mismatch between number of source and destination parameter groups"
            )
        for src, dst in zip(src_param_groups, dst_param_groups, strict=True):
            for attr in src:
                if attr != "params" and attr not in dst:
                    dst[attr] = src[attr]

    return sync_param_groups


def _trainability_frozen_at_construction(original: Callable[..., Any]) -> Callable[..., Any]:
    def _get_is_trainable_mask(self: Any) -> list[bool]:
        cached = getattr(self, "_is_trainable_mask", None)
        if cached is not None:
            # Trainability changes are never detected, so the bucket views are never rebuilt.
            return list(cached)
        mask: list[bool] = original(self)
        return mask

    return _get_is_trainable_mask


FAULTS: tuple[Fault, ...] = (
    Fault(
        id="zero.state_on_wrong_param",
        area="zero",
        bug_class="optimizer state attached to the wrong parameter",
        summary="ZeroRedundancyOptimizer.state_dict swaps the states of the first two "
        "parameters with same-shaped state",
        patches=(Patch(f"{_ZERO}:ZeroRedundancyOptimizer.state_dict", _state_swapped),),
        origin=WITH_THE_PROPERTY,
    ),
    Fault(
        id="zero.round_robin_partition",
        area="zero",
        bug_class="a partition that ignores sizes (round robin instead of sorted greedy)",
        summary="ZeroRedundancyOptimizer assigns parameter i of each group to rank i % world",
        patches=(
            Patch(f"{_ZERO}:ZeroRedundancyOptimizer._partition_parameters", _round_robin_partition),
        ),
        origin=WITH_THE_PROPERTY,
    ),
    # https://github.com/pytorch/pytorch/issues/71347 (ZeRO's param-group support; the torch
    # source notes add_param_group "assumes that the call to the parent's add_param_group()
    # appends the new parameter group and preserves the previous parameter-group ordering").
    # Bug class: groups paired by position after their order diverged.
    Fault(
        id="zero.add_param_group_order_mismatch",
        area="zero",
        bug_class="parallel lists paired by position after their orders diverged",
        summary="ZeroRedundancyOptimizer.add_param_group puts the new group's local shard "
        "first in the local optimizer, so each step's _sync_param_groups gives the new "
        "parameters the first group's lr / weight_decay and the old ones the new group's",
        patches=(
            Patch(f"{_ZERO}:ZeroRedundancyOptimizer.add_param_group", _new_group_inserted_first),
        ),
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/issues/71347", survived_before=False
        ),
    ),
    # https://github.com/pytorch/ignite/issues/545 (bug class: a wrapping optimizer whose exposed
    # param_groups are decoupled from the inner optimizer, so LR schedules are not applied).
    Fault(
        id="zero.param_group_options_not_synced",
        area="zero",
        bug_class="wrapper state not propagated: hyper-parameter changes never reach the "
        "inner optimizer",
        summary="ZeroRedundancyOptimizer._sync_param_groups only copies options missing from "
        "the destination, so lr / weight_decay changes made on zero.param_groups (e.g. by an "
        "LR scheduler) never reach the local optimizer",
        patches=(
            Patch(
                f"{_ZERO}:ZeroRedundancyOptimizer._sync_param_groups",
                _param_group_options_not_overwritten,
            ),
        ),
        origin=blind(FIRST, "https://github.com/pytorch/ignite/issues/545", survived_before=False),
    ),
    # https://github.com/pytorch/pytorch/pull/52764 ("[ZeroRedundancyOptimizer] Pack parameters
    # in tensor views, handle training change").
    Fault(
        id="zero.trainability_change_not_rebucketed",
        area="zero",
        bug_class="stale cache: a layout not rebuilt when its inputs change",
        summary="ZeroRedundancyOptimizer(parameters_as_bucket_view=True) never notices "
        "requires_grad changes, so a parameter frozen at construction and unfrozen later is "
        "updated by its owner rank but, being outside every bucket, never broadcast",
        patches=(
            Patch(
                f"{_ZERO}:ZeroRedundancyOptimizer._get_is_trainable_mask",
                _trainability_frozen_at_construction,
            ),
        ),
        origin=blind(
            TRAINING_KNOBS, "https://github.com/pytorch/pytorch/pull/52764", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/62750 ("Add support for multiple ZeRO buckets per
    # DDP bucket": each assignment records its offset into the DDP bucket's gradients).
    Fault(
        id="zero.overlap_shard_bucket_offset_zero",
        area="zero",
        bug_class="offset bookkeeping: every slice read from the start of the buffer",
        summary="DDP + ZeroRedundancyOptimizer(overlap_with_ddp=True) with hook_with_zero_step"
        "(shard_buckets=True) records offset 0 for every assignment, so a rank owning the tail "
        "of a split DDP bucket steps its parameters with the head's gradients",
        patches=(
            Patch(
                f"{_ZERO}:ZeroRedundancyOptimizer._assign_bucket_subset_to_rank",
                forcing_argument("bucket_offset", 0),
            ),
        ),
        origin=blind(
            TRAINING_KNOBS, "https://github.com/pytorch/pytorch/pull/62750", survived_before=False
        ),
    ),
)
