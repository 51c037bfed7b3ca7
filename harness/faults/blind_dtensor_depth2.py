"""Blind faults in DCP checkpoints of arbitrary DTensor layouts (resharding reads, strided
shards, deduplicated replicas) and in the metadata of DTensor results (shape, stride,
contiguity, dtype, requires_grad).

Written blind, as a held-out set, with ``blind_dtensor_depth``: by a contributor who read
upstream's bug reports and torch's source but not distconf's suites, each fault re-creating
the mechanism of a real upstream bug (the comment above it) in torch 2.13.

Each patch was written for torch 2.13: a target that is gone raises FaultError when applied.

In the catalogue since the DTensor depth work. Before it, the placements, uneven and
state_dict suites at the ci profile caught here: the three DCP faults
(``dcp_reshard_one_row_overlap_missed`` and ``dcp_strided_shard_offsets_as_shard`` by
state_dict.dcp.reshard, ``dcp_dedup_drops_every_replica`` by
state_dict.dcp.missing_key_refused) and ``from_local_shape_stride_ignored``
(uneven.redistribute.no_padding); survived: ``from_local_global_stride_of_shard``,
``to_local_grad_forward_stride``, ``factory_requires_grad_dropped``,
``full_dtype_not_inferred``.

After it, all eight are caught: the DCP faults by state_dict.dcp.any_layout,
``from_local_global_stride_of_shard`` by placements.program.matches_one_device, the two
factory faults by placements.factories.match_torch. ``to_local_grad_forward_stride`` is
caught only as placements.api.shard_dim_from_the_back's known deviation no longer
happening (the patched backward normalizes the placements it is given): the program
property checks that a leaf's local gradient steps through its dims in the leaf's order,
and caught it in one draw of its examples, not in the run recorded last.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

from harness.faults._patch import Fault, Patch

_API = "torch.distributed.tensor._api"
_PLANNER_HELPERS = "torch.distributed.checkpoint.planner_helpers"
_DEFAULT_PLANNER = "torch.distributed.checkpoint.default_planner"


# --- DCP resharding: chunks overlapping by one element taken as disjoint -------------------


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


# --- DCP: _StridedShard chunks given the offsets of a plain Shard ----------------------------


def _strided_as_plain_shard(original: Callable[..., Any]) -> Callable[..., Any]:
    def compute_local_shape_and_global_offset(
        global_shape: Any, mesh: Any, placements: Any, skip_offset: bool = False
    ) -> Any:
        from torch.distributed.tensor.placement_types import Shard, _StridedShard

        plain = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements]
        return original(global_shape, mesh, plain, skip_offset)

    return compute_local_shape_and_global_offset


# --- DCP: deduplication drops every copy of a replicated DTensor chunk ----------------------


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


# --- from_local: shape and stride arguments ignored -----------------------------------------


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


# --- from_local: the global stride is the local shard's stride ------------------------------


def _global_stride_of_shard(original: Callable[..., Any]) -> Callable[..., Any]:
    def compute_global_tensor_info(tensor: Any, mesh: Any, placements: Any) -> Any:
        shape, _ = original(tensor, mesh, placements)
        return shape, list(tensor.stride())

    return compute_global_tensor_info


# --- to_local backward: the gradient labelled with the forward stride ------------------------


def _grad_with_forward_stride(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(ctx: Any, grad_output: Any) -> Any:
        if grad_output is None:
            return None, None
        from torch.distributed.tensor._api import DTensor, _normalize_placements_for_grad

        spec = ctx.dtensor_spec
        placements = ctx.grad_placements or _normalize_placements_for_grad(spec.placements)
        # Pre-#102630: shape *and stride* of the forward DTensor, whatever the gradient's
        # actual layout.
        grad = DTensor.from_local(
            grad_output, spec.mesh, placements, shape=spec.shape, stride=spec.stride
        )
        return grad, None

    return backward


# --- DTensor factories: requires_grad dropped ------------------------------------------------


def _factory_requires_grad_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    def _dtensor_init_helper(
        init_op: Any, size: Any, device_mesh: Any = None, placements: Any = None, **kwargs: Any
    ) -> Any:
        kwargs["requires_grad"] = False
        return original(init_op, size, device_mesh, placements, **kwargs)

    return _dtensor_init_helper


# --- DTensor full(): dtype not inferred from the fill value ----------------------------------


def _full_dtype_not_inferred(original: Callable[..., Any]) -> Callable[..., Any]:
    def _dtensor_init_helper(
        init_op: Any, size: Any, device_mesh: Any = None, placements: Any = None, **kwargs: Any
    ) -> Any:
        import torch

        if init_op is torch.full and kwargs.get("dtype") is None:
            # The default dtype, as the docstring's "if None, uses a global default" reads,
            # where torch.full infers int64 / bool from an int / bool fill value.
            kwargs["dtype"] = torch.get_default_dtype()
        return original(init_op, size, device_mesh, placements, **kwargs)

    return _dtensor_init_helper


FAULTS: tuple[Fault, ...] = (
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
    ),
    # https://github.com/pytorch/pytorch/issues/118836 (a shard's stride taken from the
    # wrong tensor) and PR #177174 (stride computed by dividing by the mesh size): the global
    # stride of a DTensor built from local shards taken from the local shard.
    Fault(
        id="placements.from_local_global_stride_of_shard",
        area="placements",
        bug_class="a DTensor's global stride computed from its local shard",
        summary="from_local (and to_local's backward) give the DTensor its local shard's "
        "stride: from_local(x[4, 2], [Shard(1)]) on 4 ranks is [4, 8] with stride (2, 1), "
        "not contiguous, so view/reshape/is_contiguous disagree with one device",
        patches=(Patch(f"{_API}:compute_global_tensor_info", _global_stride_of_shard),),
    ),
    # https://github.com/pytorch/pytorch/pull/102630 ("[TP] Use Stride inferred from local
    # tensor in to_local bwd", with a test where the gradient is transposed): to_local's
    # backward labelled the gradient DTensor with the forward stride.
    Fault(
        id="placements.to_local_grad_forward_stride",
        area="placements",
        bug_class="a gradient's stride metadata copied from the forward tensor",
        summary="to_local's backward builds the gradient DTensor with the forward DTensor's "
        "stride whatever the gradient's layout: a transposed gradient is labelled "
        "contiguous, so AccumulateGrad keeps a non-contiguous .grad local tensor under "
        "contiguous metadata",
        patches=(Patch(f"{_API}:_ToTorchTensor.backward", _grad_with_forward_stride),),
    ),
    # https://github.com/pytorch/pytorch/pull/46486 ("Fix requires_grad arg for new_full,
    # new_empty, new_zeros": factories dropping requires_grad) in the DTensor factories of
    # PR #100933 (ones/zeros/full/rand/randn/empty).
    Fault(
        id="placements.factory_requires_grad_dropped",
        area="placements",
        bug_class="a factory dropping requires_grad",
        summary="torch.distributed.tensor.ones/zeros/empty/full/rand/randn(..., "
        "requires_grad=True) return DTensors with requires_grad False (no .grad after "
        "backward)",
        patches=(Patch(f"{_API}:_dtensor_init_helper", _factory_requires_grad_dropped),),
    ),
    # https://github.com/pytorch/pytorch/issues/27171 (torch.full ignored its fill value's
    # type, fixed by PR #41912) and the same bug in another torch backend,
    # https://github.com/google/torchax/pull/18 ("torch.full(..., 0) should be int tensor").
    Fault(
        id="placements.full_dtype_not_inferred",
        area="placements",
        bug_class="a result dtype differing from one device (dtype inference skipped)",
        summary="torch.distributed.tensor.full(size, fill_value) without dtype= uses the "
        "default float dtype instead of inferring it from the fill value: full(..., 2) is "
        "float32 (torch.full: int64), full(..., True) float32 (torch.full: bool)",
        patches=(Patch(f"{_API}:_dtensor_init_helper", _full_dtype_not_inferred),),
    ),
)
