"""Faults in DTensor's sharding rules: placement transforms (Partial reductions,
distribute_tensor's source, all-gather order), multi-dim redistribute plans, the sharding rules
of ops and views and the sharding-propagation cache, in-place ops."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from harness.faults._origin import WITH_THE_PROPERTY, blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import forcing_argument
from harness.faults.held_out import DTENSOR_DEPTH, FIRST

_MATH = "torch.distributed.tensor._ops._math_ops"
_OPS_UTILS = "torch.distributed.tensor._ops.utils"
_PLACEMENTS = "torch.distributed.tensor.placement_types"
_PROPAGATOR = "torch.distributed.tensor._api:DTensor._op_dispatcher.sharding_propagator"
_REDISTRIBUTE = "torch.distributed.tensor._redistribute"
_VIEW = "torch.distributed.tensor._ops._view_ops"


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


def _left_to_right_plan(original: Callable[..., Any]) -> Callable[..., Any]:
    def generate_greedy_transform_infos(self: Any, src_spec: Any, dst_spec: Any) -> Any:
        if self.device_mesh.ndim == 1:
            return original(self, src_spec, dst_spec)
        from torch.distributed.tensor._redistribute import _TransformInfo
        from torch.distributed.tensor.placement_types import Shard

        mesh = self.device_mesh

        def logical_shape(mesh_dim: int) -> list[Any]:
            # The tensor as this mesh dim sees it: sharded by every *other* mesh dim.
            shape = list(src_spec.shape)
            for i, placement in enumerate(src_spec.placements):
                if i != mesh_dim and isinstance(placement, Shard):
                    shape[placement.dim], _ = placement._local_shard_size_and_offset(
                        shape[placement.dim], mesh.size(mesh_dim=i), mesh._sym_get_coordinate(i)
                    )
            return shape

        # Every mesh dim transformed on its own, outer to inner: a nested Shard on an
        # inner mesh dim is never unsharded first.
        return [
            _TransformInfo(
                mesh_dim=mesh_dim,
                src_dst_placements=(current, target),
                logical_shape=logical_shape(mesh_dim),
            )
            for mesh_dim, (current, target) in enumerate(
                zip(src_spec.placements, dst_spec.placements, strict=True)
            )
            if current != target
        ]

    return generate_greedy_transform_infos


def _every_dim_even(original: Callable[..., Any]) -> Callable[..., Any]:
    def is_tensor_evenly_shardable_on_dim(shape: Any, spec: Any, dim: int) -> bool:
        return True

    return is_tensor_evenly_shardable_on_dim


def _negative_dim_kept(original: Callable[..., Any]) -> Callable[..., Any]:
    def normalize_dim(dim: int, ndim: int) -> int:
        if dim < 0:
            return dim
        normalized: int = original(dim, ndim)
        return normalized

    return normalize_dim


def _reduction_schema_info_dropped(original: dict[Any, Any]) -> dict[Any, Any]:
    import torch
    from torch.distributed.tensor._ops import _math_ops

    aten = torch.ops.aten
    dropped = (
        set(_math_ops.LINEAR_REDUCTION_OP_MAP)
        | set(_math_ops.ARGMAX_ARGMIN_OPS)
        | {aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default}
    )
    return {op: info for op, info in original.items() if op not in dropped}


def _split_of_flatten_not_demoted(original: Callable[..., Any]) -> Callable[..., Any]:
    def _analyze_split(self: Any, cmd: Any) -> Any:
        before = {dim: list(allowed) for dim, allowed in self.shard_allowed.items()}
        fallback = set(self.strict_replicate_fallback)
        result = original(self, cmd)
        # Undo the demotion of a plain Shard on a non-first flattened input dim.
        for dim, mesh_dim in set(self.strict_replicate_fallback) - fallback:
            if dim in before:
                self.shard_allowed[dim][mesh_dim] = before[dim][mesh_dim]
        self.strict_replicate_fallback.intersection_update(fallback)
        return result

    return _analyze_split


def _split_of_flatten_as_plain_shard(original: Callable[..., Any]) -> Callable[..., Any]:
    def _rewrite_plain_shard(
        self: Any,
        p: Any,
        mesh_dim: int,
        placements: Any,
        strided_shard_claimed_dims: Any,
        local_tensor_shapes: list[int],
        input_to_output_tensor_dims: dict[int, list[int]],
    ) -> Any:
        try:
            return original(
                self,
                p,
                mesh_dim,
                placements,
                strided_shard_claimed_dims,
                local_tensor_shapes,
                input_to_output_tensor_dims,
            )
        except AssertionError as exc:
            if "should have been demoted" not in str(exc):
                raise
        from torch.distributed.tensor._ops._view_ops import Split
        from torch.distributed.tensor.placement_types import Shard

        # What the pre-fix rule did: the Split's first output dim takes the Shard as is.
        out_dims = [
            d
            for d in input_to_output_tensor_dims[p.dim]
            if not (isinstance(self.rule[d], Split) and self.rule[d].split_id != 0)
        ]
        new_shapes = list(local_tensor_shapes)
        new_shapes[p.dim] //= self.mesh_sizes[mesh_dim]
        return Shard(out_dims[0]), new_shapes

    return _rewrite_plain_shard


def _scalar_add_keeps_partial(original: dict[Any, Any]) -> dict[Any, Any]:
    import torch
    from torch.distributed.tensor._dtensor_spec import TensorMeta
    from torch.distributed.tensor.placement_types import Partial

    aten = torch.ops.aten
    additive = (aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor)

    def with_unary_partial_rule(func: Callable[..., Any]) -> Callable[..., Any]:
        def strategy(op: Any, args_schema: Any, kwargs_schema: Any) -> Any:
            rules = list(func(op, args_schema, kwargs_schema))
            if sum(isinstance(arg, TensorMeta) for arg in args_schema) == 1:
                # The pre-fix linearity rule: P(sum) op scalar -> P(sum), no reduction.
                rules.append([Partial("sum"), Partial("sum")])
            return rules

        return strategy

    patched = dict(original)
    for op in additive:
        if op in patched:
            info = patched[op]
            patched[op] = dataclasses.replace(info, func=with_unary_partial_rule(info.func))
    return patched


FAULTS: tuple[Fault, ...] = (
    Fault(
        id="dtensor.partial_avg_as_sum",
        area="placements",
        bug_class="a reduce op lowered to another (avg run as sum, the division lost)",
        summary="Partial('avg') -> Replicate all-reduces with SUM",
        patches=(Patch(f"{_PLACEMENTS}:Partial._reduce_value", _avg_as_sum),),
        origin=WITH_THE_PROPERTY,
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
        origin=WITH_THE_PROPERTY,
    ),
    Fault(
        id="dtensor.partial_reduced_twice",
        area="placements",
        bug_class="a Partial reduction applied twice (by a hook and by redistribute)",
        summary="Partial('sum') -> Replicate all-reduces the already reduced value again",
        patches=(Patch(f"{_PLACEMENTS}:Partial._reduce_value", _reduced_twice),),
        origin=WITH_THE_PROPERTY,
    ),
    Fault(
        id="dtensor.partial_to_shard_unreduced",
        area="placements",
        bug_class="a collective skipped: the local partial value taken as the result",
        summary="Partial -> Shard keeps this rank's chunk of its own contribution "
        "(no reduce-scatter)",
        patches=(Patch(f"{_PLACEMENTS}:Partial._reduce_shard_value", _shard_unreduced),),
        origin=WITH_THE_PROPERTY,
    ),
    Fault(
        id="dtensor.all_gather_rotated",
        area="placements",
        bug_class="all-gather output in the wrong rank order (group rank vs mesh coordinate)",
        summary="Shard -> Replicate rotates the gathered tensor by one chunk along the dim",
        patches=(Patch(f"{_PLACEMENTS}:Shard._to_replicate_tensor", _rotated_gather),),
        origin=WITH_THE_PROPERTY,
    ),
    # https://github.com/pytorch/pytorch/pull/131210 (and the user case of issue #132751 added
    # in PR #133023): on a multi-dim mesh a nested or misaligned Shard (e.g. (S(0), S(0)) ->
    # (R, S(0))) must be unsharded inner-first; planning each mesh dim on its own moves data
    # for the wrong chunk.
    Fault(
        id="dtensor.nested_shard_plan_per_mesh_dim",
        area="placements",
        bug_class="multi-dim redistribute planned per mesh dim, ignoring nested sharding",
        summary="the greedy redistribute planner transforms each mesh dim independently "
        "outer to inner, so (S(0), S(0)) -> (R, S(0)) all-gathers the nested chunks on mesh "
        "dim 0 and keeps mesh dim 1 as is",
        patches=(
            Patch(
                f"{_REDISTRIBUTE}:DTensorRedistributePlanner.generate_greedy_transform_infos",
                _left_to_right_plan,
            ),
        ),
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/pull/131210", survived_before=False
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/162692 (fixed by PR #163241): DTensor.mean over
    # an unevenly sharded dim averaged the per-shard means (Partial("avg")) instead of
    # replicating first, so the result ignored the shard sizes (and was NaN for empty shards).
    Fault(
        id="dtensor.mean_uneven_partial_avg",
        area="placements",
        bug_class="a reduction declared linear where it is not (avg of uneven shards)",
        summary="the reduction rule treats every sharded dim as evenly sharded, so mean over "
        "an unevenly sharded dim yields Partial('avg') of the local means",
        patches=(Patch(f"{_MATH}:is_tensor_evenly_shardable_on_dim", _every_dim_even),),
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/issues/162692", survived_before=False
        ),
    ),
    # https://github.com/pytorch/PiPPy/pull/440 (bug class, no single torch issue): the sharded
    # softmax rule compared a negative softmax dim (-1) with the positive shard dim, so a
    # softmax over the sharded last dim ran locally on each shard.
    Fault(
        id="dtensor.negative_dim_kept_sharded",
        area="placements",
        bug_class="negative dim not normalised in a sharding rule",
        summary="the math-op sharding rules (softmax, log_softmax, max.dim, sort ...) keep a "
        "negative dim as is, so softmax(dim=-1) over a dim sharded as Shard(ndim-1) is not "
        "replicated first and normalises each shard on its own",
        patches=(Patch(f"{_MATH}:normalize_dim", _negative_dim_kept),),
        origin=blind(FIRST, "https://github.com/pytorch/PiPPy/pull/440", survived_before=True),
    ),
    # https://github.com/pytorch/pytorch/issues/174301 and PR #174422: ops whose
    # RuntimeSchemaInfo was not found by the C++ dispatch left their static args (dim,
    # keepdim, dtype) out of the sharding-propagation cache key, so calls differing only in
    # those args got the first call's cached output sharding.
    Fault(
        id="dtensor.reduction_cache_key_without_dims",
        area="placements",
        bug_class="a cached sharding decision keyed without the op's non-tensor args",
        summary="reductions (sum/mean/amax/argmax/...) and softmax lose their "
        "RuntimeSchemaInfo, so the sharding cache ignores dim/keepdim: x.sum(1) after "
        "x.sum(0) on the same input spec reuses sum(0)'s output spec and shape",
        patches=(Patch(f"{_PROPAGATOR}.op_to_schema_info", _reduction_schema_info_dropped),),
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/issues/174301", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/179502: a view that splits a flattened range
    # whose sharded dim is not the first (x: [12, 8] S(1); x.view(16, 6)) kept Shard and
    # relabelled it S(0) instead of redistributing, giving wrong full-tensor numerics.
    Fault(
        id="dtensor.view_split_flatten_no_redistribute",
        area="placements",
        bug_class="a view rule that skips a needed redistribution",
        summary="view/reshape that regroups a flattened range keeps a Shard on its non-first "
        "dim and maps it to Shard(first output dim) with no redistribution",
        patches=(
            Patch(f"{_VIEW}:_ViewShardingPropagator._analyze_split", _split_of_flatten_not_demoted),
            Patch(
                f"{_VIEW}:_ViewShardingPropagator._rewrite_plain_shard",
                _split_of_flatten_as_plain_shard,
            ),
        ),
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/issues/179502", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/163193 (also #149768: clip_grad_norm_'s
    # total_norm + 1e-6 on a Partial norm), fixed by PR #170030: adding a Python scalar to a
    # Partial(sum) DTensor kept the output Partial, so every rank added the scalar to its
    # partial value and the reduced result held it world-size times.
    Fault(
        id="placements.partial_plus_scalar_kept_partial",
        area="placements",
        bug_class="a non-linear use of a pending sum: a scalar added once per rank",
        summary="add/sub (and add_/sub_) of a Partial('sum') DTensor and a Python scalar keep "
        "Partial('sum') without reducing first: dt.sum() + c reduces to sum + world_size * c",
        patches=(Patch(f"{_PROPAGATOR}.op_single_dim_strategy_funcs", _scalar_add_keeps_partial),),
        origin=blind(
            DTENSOR_DEPTH, "https://github.com/pytorch/pytorch/issues/163193", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/172477 ("inplace ops were able to generate
    # expanded strategies incompatible with the current input placements, which aren't
    # allowed to be modified by redistribution"; cf. issue #163374, clamp_ on a Partial
    # DTensor giving 144 instead of 2): an in-place op picked a strategy that redistributed
    # self, so the result was written into a temporary copy and self's spec was relabelled.
    Fault(
        id="placements.inplace_op_redistributes_self",
        area="placements",
        bug_class="an in-place op allowed to change its self argument's placement",
        summary="the full-mesh strategy expansion no longer filters in-place strategies that "
        "redistribute self: x_replicated.add_(y_sharded) shards x's spec while its local "
        "tensor stays whole, and Partial.clamp_ runs on a reduced copy",
        patches=(
            Patch(
                f"{_OPS_UTILS}:expand_to_full_mesh_op_strategy",
                forcing_argument("inplace_op", False),
            ),
        ),
        origin=blind(
            DTENSOR_DEPTH, "https://github.com/pytorch/pytorch/pull/172477", survived_before=False
        ),
    ),
)
