"""Faults in the sharding rules of DTensor's ops (held-out "ops" set): reductions over Partial
inputs or sharded dims, scans, norms and their backward, losses, pointwise ops on Partial
inputs, ``_foreach_*`` ops, the random-op offsets and the matmul family. Views, indexing and
their tables: ``ops_rules_views``.

Each fault edits one rule of torch 2.13 (an entry of the sharding propagator's strategy
tables, or the module function a rule calls) the way the upstream bug it names did."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from harness.faults._origin import blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import rewritten, table_entries_edited, with_globals
from harness.faults.held_out import OPS

_MATH = "torch.distributed.tensor._ops._math_ops"
_MATRIX = "torch.distributed.tensor._ops._matrix_ops"
_RANDOM = "torch.distributed.tensor._random"
_PROPAGATOR = "torch.distributed.tensor._api:DTensor._op_dispatcher.sharding_propagator"
_STRATEGIES = f"{_PROPAGATOR}.op_strategy_funcs"
_SINGLE_DIM = f"{_PROPAGATOR}.op_single_dim_strategy_funcs"

Rules = list[list[Any]]


def aten(*names: str) -> Callable[[], list[Any]]:
    """The aten overloads ``"mul.Tensor", ...``, resolved when a patch is applied."""

    def resolve() -> list[Any]:
        import torch

        return [
            getattr(getattr(torch.ops.aten, op), overload)
            for op, _, overload in (name.partition(".") for name in names)
        ]

    return resolve


def rules_edited(
    ops: Callable[[], Iterable[Any]], edit: Callable[[Any, tuple[Any, ...], Rules], Rules]
) -> Patch:
    """The single-dim strategies of ``ops`` with their rules passed through
    ``edit(op, args_schema, rules)``."""

    def entry(info: Any) -> Any:
        func = info.func

        def strategy(op: Any, args_schema: Any, kwargs_schema: Any) -> Rules:
            return edit(op, args_schema, list(func(op, args_schema, kwargs_schema)))

        return dataclasses.replace(info, func=strategy)

    return Patch(_SINGLE_DIM, table_entries_edited(ops, entry))


def tensor_count(args_schema: tuple[Any, ...]) -> int:
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    return sum(isinstance(arg, TensorMeta) for arg in args_schema)


def partial_rule(unary: Rules, binary: Rules | None = None) -> Callable[..., Rules]:
    """An edit adding ``unary`` rules (of placement names: ``"sum"`` is ``Partial("sum")``,
    ``"R"`` Replicate) to ops with one tensor argument and ``binary`` ones to ops with two."""

    def edit(op: Any, args_schema: tuple[Any, ...], rules: Rules) -> Rules:
        from torch.distributed.tensor.placement_types import Partial, Replicate

        extra = {1: unary, 2: binary or []}.get(tensor_count(args_schema), [])
        made = [[Replicate() if p == "R" else Partial(p) for p in rule] for rule in extra]
        return rules + made

    return edit


def strategy_rewritten(ops: Callable[[], Iterable[Any]], *edits: tuple[str, str]) -> Patch:
    """The op strategies of ``ops`` recompiled from torch's source with ``edits``."""
    return Patch(_STRATEGIES, table_entries_edited(ops, rewritten(*edits, undecorated=True)))


_MISMATCH_CHECK = "if isinstance(p, Partial) and p.reduce_op != reduction_op:"


def partial_input_kept(ops: Callable[[], Iterable[Any]], exempt: str) -> Patch:
    """The op strategies of ``ops`` with a ``common_reduction_strategy`` that keeps a Partial
    input whose reduce op differs from the reduction's when ``exempt`` holds."""

    def entry(strategy: Callable[..., Any]) -> Callable[..., Any]:
        lenient = rewritten((_MISMATCH_CHECK, f"{_MISMATCH_CHECK[:-1]} and not ({exempt}):"))
        common = strategy.__globals__["common_reduction_strategy"]
        return with_globals(strategy, common_reduction_strategy=lenient(common))

    return Patch(_STRATEGIES, table_entries_edited(ops, entry))


def max_dim_indices_partial(op: Any, args_schema: tuple[Any, ...], rules: Rules) -> Rules:
    import torch
    from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
    from torch.distributed.tensor.placement_types import Partial

    dim = args_schema[1] % len(args_schema[0].shape)
    reduce_op = "max" if op is torch.ops.aten.max.dim else "min"
    # [values, indices, input]: the pre-fix S(dim) -> P(max), P(max) for indices too
    return [*rules, [Partial(reduce_op), Partial(reduce_op), _ShardingPlaceholder(dim)]]


def grads_replicated(*positions: int) -> Callable[..., Rules]:
    """An edit declaring the weight/bias gradients (``positions``) Replicate where they are
    Partial (the per-rank sums of a sharded batch)."""

    def edit(op: Any, args_schema: tuple[Any, ...], rules: Rules) -> Rules:
        from torch.distributed.tensor.placement_types import Partial, Replicate

        return [
            [
                Replicate() if i in positions and isinstance(p, Partial) else p
                for i, p in enumerate(rule)
            ]
            for rule in rules
        ]

    return edit


def first_mesh_dim_only(original: Callable[..., Any]) -> Callable[..., Any]:
    def _calc_shard_info(mesh_coordinate: Any, spec: Any) -> Any:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec
        from torch.distributed.tensor.placement_types import Replicate, Shard

        seen: set[int] = set()
        placements = []
        for p in spec.placements:
            nested = isinstance(p, Shard) and p.dim in seen
            placements.append(Replicate() if nested else p)
            if isinstance(p, Shard):
                seen.add(p.dim)
        flat = DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)
        return original(mesh_coordinate, flat)

    return _calc_shard_info


_ALL_PARTIAL_ANCHOR = "    if (\n        not edims.contracting_dims"
_ALL_PARTIAL_WIDENED = _ALL_PARTIAL_ANCHOR.replace("if (", "if True or (")
_BIAS_ANCHOR = "# Clone Partial, Replicate, or other placements"

FAULTS: tuple[Fault, ...] = (
    # https://github.com/pytorch/pytorch/issues/168940 (fixed by PR #175776): max.dim/min.dim
    # allowed S(reduction dim) -> P(max), P(max): the values reduce right, but each rank's
    # indices are local to its shard and the max of them is no index of the maximum.
    Fault(
        id="ops.max_dim_indices_of_local_shards",
        area="ops",
        bug_class="indices of a reduction combined across shards as if they were values",
        summary="max.dim/min.dim gain the rule S(dim) -> (P(max), P(max)) (min: P(min)): "
        "x.max(dim) over the sharded dim returns local indices reduced by max",
        patches=(rules_edited(aten("max.dim", "min.dim"), max_dim_indices_partial),),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/issues/168940", survived_before=True),
    ),
    # https://github.com/pytorch/pytorch/pull/173936: argmax/argmin were treated as linear
    # reductions like max/min (S(dim) -> P(max)), so the max of per-shard local indices was
    # returned ([10, 5 | 3, 8] -> 1 instead of 0).
    Fault(
        id="ops.argmax_reduced_as_linear",
        area="ops",
        bug_class="a reduction returning indices declared reduction-linear",
        summary="argmax/argmin run common_reduction_strategy with reduction_linear=True: a "
        "sharded reduction dim stays sharded and the output is P(max)/P(min) of local indices",
        patches=(
            strategy_rewritten(
                aten("argmax.default", "argmin.default"),
                ("reduction_linear=False,  # Force", "reduction_linear=True,  # Force"),
            ),
        ),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/pull/173936", survived_before=True),
    ),
    # https://github.com/pytorch/pytorch/pull/159856: linalg_vector_norm assumed the norm
    # reduction-linear for any input, so the norm of a Partial(sum) DTensor was computed on
    # each rank's partial values and summed (sum of norms, not the norm of the sum).
    Fault(
        id="ops.vector_norm_of_partial_local",
        area="ops",
        bug_class="a non-linear reduction applied to a pending sum",
        summary="linalg_vector_norm/norm.Scalar keep a Partial(sum) input as is: the output "
        "is Partial(sum) of the per-rank norms of the partial values",
        patches=(
            partial_input_kept(
                aten("linalg_vector_norm.default", "norm.Scalar"),
                "isinstance(reduction_op, NormReduction)",
            ),
        ),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/pull/159856", survived_before=True),
    ),
    # https://github.com/pytorch/pytorch/pull/165962: reductions of a Partial input delayed
    # the redistribution when the reduction was linear, so max/min of a Partial(sum) DTensor
    # ran on the partial values (wrong max/min and gradient norm clipping).
    Fault(
        id="ops.max_of_partial_sum_local",
        area="ops",
        bug_class="a non-linear reduction applied to a pending sum",
        summary="max/min/amax/amin keep a Partial(sum) (or avg) input: the output stays "
        "Partial(sum) of the per-rank maxima of the partial values",
        patches=(
            partial_input_kept(
                aten("max.default", "min.default", "amax.default", "amin.default"),
                "reduction_op in ('max', 'min')",
            ),
        ),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/pull/165962", survived_before=True),
    ),
    # https://github.com/pytorch/pytorch/pull/151071 (cumsum support): a scan over a sharded
    # dim must replicate that dim first; propagating the sharding through scans each shard
    # on its own, without the prefix of the shards before it.
    Fault(
        id="ops.scan_dim_kept_sharded",
        area="ops",
        bug_class="a scan along a sharded dim computed per shard",
        summary="cumsum/cumprod/logcumsumexp keep a Shard on the scan dim (only Partial is "
        "replicated): each rank scans its own shard",
        patches=(
            strategy_rewritten(
                aten("cumsum.default", "cumprod.default", "logcumsumexp.default"),
                ("input_strategy, [dim], keep_dim=True", "input_strategy, [], keep_dim=True"),
            ),
        ),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/pull/151071", survived_before=True),
    ),
    # https://github.com/NVIDIA/Megatron-LM/issues/1446 (norm weight gradients differ across
    # TP ranks under sequence parallelism; cf. pytorch/pytorch#102280): with the input sharded
    # on a batch/sequence dim, the weight and bias gradients of layer_norm are per-rank
    # partial sums that must be reduced.
    Fault(
        id="ops.layer_norm_bwd_grads_not_reduced",
        area="ops",
        bug_class="a gradient summed over a sharded batch declared replicated",
        summary="native_layer_norm_backward declares grad_weight and grad_bias Replicate "
        "instead of Partial(sum): with the input sharded on a leading dim each rank keeps the "
        "gradient of its own rows",
        patches=(rules_edited(aten("native_layer_norm_backward.default"), grads_replicated(1, 2)),),
        origin=blind(
            OPS,
            "https://github.com/NVIDIA/Megatron-LM/issues/1446",
            "https://github.com/pytorch/pytorch/issues/102280",
            survived_before=True,
        ),
    ),
    # https://github.com/NVIDIA/Megatron-LM/issues/7452 (item 11: an RMSNorm weight whose
    # gradient is a per-rank partial sum was not all-reduced): the same for DTensor's fused
    # rms_norm backward.
    Fault(
        id="ops.rms_norm_bwd_grad_not_reduced",
        area="ops",
        bug_class="a gradient summed over a sharded batch declared replicated",
        summary="_fused_rms_norm_backward declares grad_weight Replicate instead of "
        "Partial(sum) when the input is sharded on a leading dim",
        patches=(rules_edited(aten("_fused_rms_norm_backward.default"), grads_replicated(1)),),
        origin=blind(
            OPS, "https://github.com/NVIDIA/Megatron-LM/issues/7452", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/185167: nll_loss(reduction="mean") over a
    # batch-sharded input divided by each rank's own total weight, not the global one; here
    # in the backward, where total_weight (Partial(sum) over a sharded batch) must be
    # reduced before the kernel divides by it.
    Fault(
        id="ops.nll_loss_bwd_local_total_weight",
        area="ops",
        bug_class="a mean's denominator taken per rank instead of over the whole batch",
        summary="nll_loss_backward with reduction='mean' no longer replicates total_weight: "
        "with a batch-sharded input each rank divides by its local total weight, the "
        "gradient is world-size times too large",
        patches=(
            strategy_rewritten(
                aten("nll_loss_backward.default", "nll_loss2d_backward.default"),
                ("if reduction == Reduction.MEAN.value:", "if False:"),
            ),
        ),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/issues/185167", survived_before=True),
    ),
    # https://github.com/pytorch/pytorch/pull/157340 (reworked partial propagation of mul;
    # cf. PR #172601: "bugs where we [were] propagating partials when we shouldn't have"):
    # a product of two pending sums is no sum of per-rank products.
    Fault(
        id="ops.mul_partial_by_partial",
        area="ops",
        bug_class="a product of two pending sums kept pending",
        summary="mul.Tensor/mul_.Tensor gain the rule (P(sum), P(sum)) -> P(sum): "
        "a.sum(0) * b.sum(0) on sharded a, b multiplies the partial values",
        patches=(
            rules_edited(
                aten("mul.Tensor", "mul_.Tensor"), partial_rule([], [["sum", "sum", "sum"]])
            ),
        ),
        origin=blind(
            OPS,
            "https://github.com/pytorch/pytorch/pull/157340",
            "https://github.com/pytorch/pytorch/pull/172601",
            survived_before=False,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/174536: abs validated as P(sum) -> P(sum)
    # because the partial values tried kept the signs of the total; abs(a) + abs(b) differs
    # from abs(a + b) once the partial values have mixed signs.
    Fault(
        id="ops.abs_keeps_partial_sum",
        area="ops",
        bug_class="a non-linear pointwise op applied to a pending sum",
        summary="abs/abs_ gain the rule P(sum) -> P(sum): abs of a Partial DTensor is the sum "
        "of the absolute partial values",
        patches=(
            rules_edited(aten("abs.default", "abs_.default"), partial_rule([["sum", "sum"]])),
        ),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/pull/174536", survived_before=True),
    ),
    # https://github.com/pytorch/pytorch/pull/167813 (review: mul by a scalar keeps a max-like
    # partial only for non-negative scalars): a negative factor flips max into min.
    Fault(
        id="ops.mul_scalar_keeps_partial_max",
        area="ops",
        bug_class="a pending max scaled by a possibly negative factor kept pending",
        summary="mul (by a scalar or 0-dim replicated tensor) gains P(max) -> P(max) and "
        "P(min) -> P(min): x.amax(0) * -2 reduces the scaled maxima with max",
        patches=(
            rules_edited(
                aten("mul.Tensor", "mul_.Tensor", "mul.Scalar", "mul_.Scalar"),
                partial_rule(
                    [["max", "max"], ["min", "min"]], [["max", "max", "R"], ["min", "min", "R"]]
                ),
            ),
        ),
        origin=blind(
            OPS,
            "https://github.com/pytorch/pytorch/pull/167813",
            "https://github.com/pytorch/pytorch/pull/170025",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/163374: clamp of a Partial(sum) DTensor
    # clamped each rank's partial value (144 instead of 2).
    Fault(
        id="ops.clamp_keeps_partial_sum",
        area="ops",
        bug_class="a non-linear pointwise op applied to a pending sum",
        summary="clamp/clamp_min/clamp_max (and in-place) gain P(sum) -> P(sum): each rank "
        "clamps its partial value and the clamped values are summed",
        patches=(
            rules_edited(
                aten(
                    "clamp.default",
                    "clamp_.default",
                    "clamp_min.default",
                    "clamp_min_.default",
                    "clamp_max.default",
                    "clamp_max_.default",
                ),
                partial_rule([["sum", "sum"]]),
            ),
        ),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/issues/163374", survived_before=True),
    ),
    # https://github.com/pytorch/pytorch/issues/149768 (clip_grad_norm_'s total_norm + 1e-6
    # added once per rank; also #163193): the foreach form, as the foreach optimizer and
    # clipping paths use it.
    Fault(
        id="ops.foreach_add_scalar_keeps_partial",
        area="ops",
        bug_class="a non-linear use of a pending sum: a scalar added once per rank",
        summary="_foreach_add/_foreach_sub(_).Scalar gain P(sum) -> P(sum): every rank adds "
        "the scalar to its partial value, the reduced result holds it world-size times",
        patches=(
            rules_edited(
                aten(
                    "_foreach_add.Scalar",
                    "_foreach_add_.Scalar",
                    "_foreach_sub.Scalar",
                    "_foreach_sub_.Scalar",
                ),
                partial_rule([["sum", "sum"]]),
            ),
        ),
        origin=blind(
            OPS,
            "https://github.com/pytorch/pytorch/issues/149768",
            "https://github.com/pytorch/pytorch/issues/163193",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/159856: the same bug in "the optimized
    # aten._foreach_norm.Scalar" (the fused path of clip_grad_norm_).
    Fault(
        id="ops.foreach_norm_of_partial_local",
        area="ops",
        bug_class="a non-linear reduction applied to a pending sum",
        summary="_foreach_norm keeps a Partial(sum) input: each norm is Partial(sum) of the "
        "per-rank norms of the partial values",
        patches=(
            partial_input_kept(
                aten("_foreach_norm.Scalar"), "isinstance(reduction_op, NormReduction)"
            ),
        ),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/pull/159856", survived_before=True),
    ),
    # https://github.com/pytorch/pytorch/pull/141220 (the flattened shard index of a tensor
    # dim sharded over several mesh dims, for FSDP2 + TP): counting only the first mesh dim
    # gives two shards the same RNG offset, so they draw the same random numbers.
    Fault(
        id="ops.rng_offset_ignores_nested_shard",
        area="ops",
        bug_class="a random-op offset computed from part of the shard coordinate",
        summary="the RNG shard index of a tensor dim sharded over several mesh dims counts "
        "only its first mesh dim: on (Shard(0), Shard(0)) ranks (i, 0) and (i, 1) draw the "
        "same numbers",
        patches=(Patch(f"{_RANDOM}:_calc_shard_info", first_mesh_dim_only),),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/pull/141220", survived_before=True),
    ),
    # https://github.com/pytorch/pytorch/pull/174926 (review: the original all-Partial
    # "linearity" rule of PR #98227 is right only when the einsum reduces nothing): mm of two
    # Partial(sum) operands is no sum of per-rank products.
    Fault(
        id="ops.matmul_all_partial_linearity",
        area="ops",
        bug_class="a product of two pending sums kept pending",
        summary="the single-dim einsum strategies (mm, bmm, addmm, baddbmm) offer "
        "all-Partial inputs -> Partial output for every equation, not only element-wise ones",
        patches=(
            Patch(
                f"{_MATRIX}:gen_single_dim_einsum_strategies",
                rewritten((_ALL_PARTIAL_ANCHOR, _ALL_PARTIAL_WIDENED)),
            ),
        ),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/pull/174926", survived_before=False),
    ),
    # https://github.com/pytorch/pytorch/pull/172387 (review: the bias placement derived as
    # Partial() for any Partial output "isn't good ... we should also inherit its reduce op"):
    # with a Partial(avg) output the bias is split as a sum, then averaged.
    Fault(
        id="ops.addmm_bias_partial_avg_as_sum",
        area="ops",
        bug_class="a reduce op lost when deriving one operand's placement from another's",
        summary="addmm/baddbmm derive the bias placement of a Partial output as "
        "Partial('sum'): with a Partial('avg') input the bias is divided by the mesh size",
        patches=(
            Patch(
                f"{_MATRIX}:gen_single_dim_einsum_strategies",
                rewritten(
                    (
                        _BIAS_ANCHOR,
                        "if isinstance(output_placement, Partial):\n"
                        "                return Partial()",
                    )
                ),
            ),
        ),
        origin=blind(OPS, "https://github.com/pytorch/pytorch/pull/172387", survived_before=True),
    ),
)
