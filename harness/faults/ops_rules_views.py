"""Faults in the sharding rules of DTensor's views and indexing ops (held-out "ops" set):
squeeze and unsqueeze, stack, cat/split and slice of sharded dims; index_put, scatter and the
embedding backward's cache key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._origin import blind
from harness.faults._patch import Fault, Patch
from harness.faults.held_out import OPS
from harness.faults.ops_rules import Rules, aten, rules_edited, strategy_rewritten

_TENSOR_OPS = "torch.distributed.tensor._ops._tensor_ops"
_VIEW = "torch.distributed.tensor._ops._view_ops"
_PROPAGATOR = "torch.distributed.tensor._api:DTensor._op_dispatcher.sharding_propagator"


def _no_squeeze_rewrite(original: Callable[..., Any]) -> Callable[..., Any]:
    def _adjust_squeeze_to_global_singletons(self: Any, schema: Any) -> None:
        return None

    return _adjust_squeeze_to_global_singletons


def _unsqueeze_negative_off_by_one(original: Callable[..., Any]) -> Callable[..., Any]:
    def dim_unsqueeze(ndim: int, dim: int) -> Any:
        if dim < 0:
            dim += ndim  # the input's rank, not the output's (ndim + 1)
        result = original(ndim, dim)
        return result

    return dim_unsqueeze


def _plain_shard_only(original: Callable[..., Any]) -> Callable[..., Any]:
    def is_tensor_dim_sharded(spec: Any, dim: int) -> bool:
        from torch.distributed.tensor.placement_types import Shard, _StridedShard

        return any(
            isinstance(p, Shard) and not isinstance(p, _StridedShard) and p.dim == dim
            for p in spec.placements
        )

    return is_tensor_dim_sharded


def _indexed_dims_shardable(op: Any, args_schema: tuple[Any, ...], rules: Rules) -> Rules:
    from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
    from torch.distributed.tensor.placement_types import Replicate

    self_meta, indices, values_meta = args_schema[0], args_schema[1], args_schema[2]
    if len(values_meta.shape) != len(self_meta.shape):
        return rules
    # The pre-fix rule: size_offset = self.ndim - values.ndim = 0, so no dim counts as
    # indexed and self, output and values may all be sharded on the indexed dims too.
    indexed = [d for d, index in enumerate(indices) if index is not None]
    extra: Rules = []
    for d in indexed:
        value: Any = Replicate() if values_meta.shape[d] == 1 else _ShardingPlaceholder(d)
        placeholder = _ShardingPlaceholder(d)
        extra.append([placeholder, placeholder, *([Replicate()] * len(indexed)), value])
    return rules + extra


def _without(op_names: Callable[[], list[Any]]) -> Callable[[dict[Any, Any]], dict[Any, Any]]:
    def wrap(original: dict[Any, Any]) -> dict[Any, Any]:
        dropped = set(op_names())
        return {op: info for op, info in original.items() if op not in dropped}

    return wrap


FAULTS: tuple[Fault, ...] = (
    # https://github.com/pytorch/pytorch/issues/166124 (fixed by PR #173563): squeeze() on a
    # DTensor removed dims whose *local* size was 1 although their global size was not
    # (global [4, 8, 1] on Shard(0) over 4 ranks -> local [1, 8, 1] squeezed to [8]).
    Fault(
        id="ops.squeeze_local_singletons",
        area="ops",
        bug_class="a view computed from the local shape instead of the global one",
        summary="squeeze/squeeze_ (every variant) are no longer rewritten to squeeze.dims of "
        "the globally singleton dims: the local squeeze also drops a sharded dim whose local "
        "size is 1",
        patches=(
            Patch(
                "torch.distributed.tensor._sharding_prop:"
                "ShardingPropagator._adjust_squeeze_to_global_singletons",
                _no_squeeze_rewrite,
            ),
        ),
        origin=blind(
            OPS,
            "https://github.com/pytorch/pytorch/issues/166124",
            "https://github.com/pytorch/pytorch/pull/173563",
            survived_before=True,
        ),
    ),
    # https://github.com/llvm/torch-mlir/pull/1780 ("when input dim < 0, the conversion to
    # positive is off by 1": unsqueeze's dim ranges over the output's rank): the same in
    # DTensor's view rule for unsqueeze.
    Fault(
        id="ops.unsqueeze_negative_dim_off_by_one",
        area="ops",
        bug_class="negative dim normalised against the input rank instead of the output rank",
        summary="the unsqueeze dim map adds ndim instead of ndim + 1 to a negative dim: "
        "x.unsqueeze(-1) on a tensor sharded on its last dim labels the new singleton dim as "
        "the sharded one",
        patches=(Patch(f"{_VIEW}:dim_unsqueeze", _unsqueeze_negative_off_by_one),),
        origin=blind(OPS, "https://github.com/llvm/torch-mlir/pull/1780", survived_before=True),
    ),
    # https://github.com/pytorch/pytorch/pull/129018 ("Fixed stack op strategy": the new dim
    # must be inserted after the input specs are made): stack's output placements must shift
    # every shard dim at or past the stacked dim by one.
    Fault(
        id="ops.stack_shard_dims_not_shifted",
        area="ops",
        bug_class="shard dims not renumbered after a dim is inserted",
        summary="stack's output keeps its inputs' placements: torch.stack of Shard(d) "
        "DTensors along dim <= d is labelled Shard(d) instead of Shard(d + 1)",
        patches=(
            strategy_rewritten(
                aten("stack.default"),
                (
                    "follow_placements = shift_shard_dims_after_insert(follow_placements, dim)",
                    "follow_placements = list(follow_placements)",
                ),
            ),
        ),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/pull/129018", survived_before=True),
    ),
    # https://github.com/pytorch/pytorch/pull/178785 ("cat, split, unbind:
    # is_tensor_dim_sharded missed _StridedShard"): a strided shard on the cat/split/slice dim
    # was not unsharded first.
    Fault(
        id="ops.strided_shard_dim_not_detected",
        area="ops",
        bug_class="a sharding kind missed by the check that forces a redistribution",
        summary="the tensor ops' is_tensor_dim_sharded (cat, split, slice, select, unbind, "
        "slice_scatter) sees only plain Shard: a _StridedShard on the op's dim is kept",
        patches=(Patch(f"{_TENSOR_OPS}:is_tensor_dim_sharded", _plain_shard_only),),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/pull/178785", survived_before=True),
    ),
    # https://github.com/pytorch/pytorch/pull/178785 ("slice ...: shard dim not detected,
    # wrong results and gradients"): a slice along a sharded dim must unshard it, since the
    # start and end index the global dim.
    Fault(
        id="ops.slice_sharded_dim_kept",
        area="ops",
        bug_class="a sharded dim not detected, global indices applied to a local shard",
        summary="slice.Tensor keeps every input sharding, the sliced dim's too: x[:, a:b] on "
        "Shard(1) slices each local shard with the global bounds",
        patches=(
            strategy_rewritten(
                aten("slice.Tensor"),
                ("not is_tensor_dim_sharded(arg_spec, dim=slice_dim)", "True"),
            ),
        ),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/pull/178785", survived_before=True),
    ),
    # https://github.com/pytorch/pytorch/issues/170934 (PR #171367; also #172350): index_put
    # counted as indexed only the dims before self.ndim - values.ndim, so with values of
    # self's rank self could stay sharded on the indexed dim and each rank wrote the global
    # indices into its local shard.
    Fault(
        id="ops.index_put_indexed_dim_sharded",
        area="ops",
        bug_class="global indices applied to a local shard",
        summary="index_put/index_put_ (values of self's rank) gain a rule sharding self, the "
        "output and values on an indexed dim, indices replicated",
        patches=(
            rules_edited(
                aten("index_put.default", "index_put_.default", "_index_put_impl_.default"),
                _indexed_dims_shardable,
            ),
        ),
        origin=blind(
            OPS,
            "https://github.com/pytorch/pytorch/issues/170934",
            "https://github.com/pytorch/pytorch/issues/172350",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/186149 (scatter sharding on non-scatter axes:
    # "src may legally be larger than index, so only shard where they match too, else the
    # src/index shards would misalign").
    Fault(
        id="ops.scatter_src_larger_sharded",
        area="ops",
        bug_class="operands sharded on a dim where their sizes differ (misaligned shards)",
        summary="scatter/scatter_ shard a non-scatter axis even where src is larger than "
        "index there: each rank scatters src rows that belong to other ranks' index rows",
        patches=(
            strategy_rewritten(
                aten("scatter.src", "scatter_.src", "scatter.value", "scatter_.value"),
                (
                    "if src_shape is not None and src_shape[d] != index_shape[d]:",
                    "if False:",
                ),
            ),
        ),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/pull/186149", survived_before=True),
    ),
    # https://github.com/pytorch/pytorch/pull/174727: embedding_dense_backward's strategy was
    # cached without num_weights, so a second embedding of another vocabulary size got the
    # first one's gradient shape.
    Fault(
        id="ops.embedding_bwd_cache_key_without_num_weights",
        area="ops",
        bug_class="a cached sharding decision keyed without the op's non-tensor args",
        summary="embedding_dense_backward loses its RuntimeSchemaInfo(static_argnum=2): the "
        "sharding cache ignores num_weights, a later backward of an embedding with another "
        "vocabulary size reuses the first one's output spec",
        patches=(
            Patch(
                f"{_PROPAGATOR}.op_to_schema_info_for_single_dim_strategy",
                _without(aten("embedding_dense_backward.default")),
            ),
        ),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/pull/174727", survived_before=True),
    ),
)
