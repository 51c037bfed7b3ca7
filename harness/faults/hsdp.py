"""Faults in HSDP (fully_shard on a 2-D mesh): the shard rank within a replica, the replicate
all-reduce with a custom divide factor, micro-batches accumulated before it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._origin import blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import DivideFactors, divide_factors_edited, rewritten
from harness.faults.held_out import FIRST, TRAINING_KNOBS

_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
_COMMON = "torch.distributed.fsdp._fully_shard._fsdp_common"
_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"


def _shard_rank_from_replicate_axis(original: Callable[..., Any]) -> Callable[..., Any]:
    def post_init(self: Any) -> None:
        original(self)
        self.shard_mesh_rank = self.replicate_mesh_rank

    return post_init


def _custom_factor_all_reduce_averaged(
    result: DivideFactors, arguments: dict[str, Any]
) -> DivideFactors:
    pre, post, reduce_scatter_op, _ = result
    if arguments["factor"] is None or arguments["all_reduce_group"] is None:
        return result
    if pre is not None or post is not None:  # the sum-only path scales by hand
        return result
    from torch.distributed import ReduceOp

    # The replicate all-reduce keeps averaging although the custom factor already covers it.
    return pre, post, reduce_scatter_op, ReduceOp.AVG


# HSDP with set_requires_all_reduce(False): the partial reduce-scatter output of earlier
# micro-batches is added after the last micro-batch's all-reduce instead of before it.
_PARTIAL_AFTER_ALL_REDUCE_EDITS = (
    (
        "                reduce_output += partial_reduce_output\n",
        "                pass\n",
    ),
    (
        "                all_reduce_input = reduce_output\n",
        "                if partial_reduce_output is not None:\n"
        "                    reduce_output += partial_reduce_output\n"
        "                all_reduce_input = reduce_output\n",
    ),
)


FAULTS: tuple[Fault, ...] = (
    # Bug class, no single issue (rank index taken from the wrong mesh axis / group; cf.
    # https://github.com/pytorch/pytorch/issues/63213 on group-local vs global ranks).
    Fault(
        id="hsdp.shard_rank_from_replicate_axis",
        area="hsdp",
        bug_class="rank index taken from the wrong mesh axis",
        summary="HSDP's mesh info takes the shard-group rank from the replicate axis, so ranks "
        "of a shard group keep the wrong chunks of every parameter",
        patches=(Patch(f"{_COMMON}:HSDPMeshInfo.__post_init__", _shard_rank_from_replicate_axis),),
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/issues/63213", survived_before=False
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/155903 (set_reduce_scatter_divide_factor is
    # inconsistent between FSDP and HSDP: on HSDP the replicate all-reduce still averaged).
    Fault(
        id="hsdp.custom_divide_factor_all_reduce_averaged",
        area="hsdp",
        bug_class="divide factor applied twice: a custom factor plus the replicate average",
        summary="with set_gradient_divide_factor on HSDP, the replicate all-reduce uses "
        "ReduceOp.AVG instead of SUM, so gradients are divided by the custom factor and again "
        "by the replicate size; FSDP, HSDP without a custom factor and the sum-only path are "
        "unaffected",
        patches=(
            Patch(
                f"{_COLLECTIVES}:_get_gradient_divide_factors",
                divide_factors_edited(_custom_factor_all_reduce_averaged),
            ),
        ),
        origin=blind(
            TRAINING_KNOBS, "https://github.com/pytorch/pytorch/issues/155903", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/125484 ("we need to perform an accumulation step
    # after reduce-scatter and before all-reduce. If not, then the preceding microbatch's
    # gradients will not be contributed across the replica group"); API in #126166.
    Fault(
        id="hsdp.partial_reduce_added_after_all_reduce",
        area="hsdp",
        bug_class="gradient accumulation: earlier micro-batches never synchronised",
        summary="HSDP with set_requires_all_reduce(False) on earlier micro-batches adds their "
        "reduce-scattered partial sums after the last micro-batch's replicate all-reduce, so "
        "each replica keeps its own earlier micro-batches",
        patches=(
            Patch(f"{_PARAM_GROUP}:foreach_reduce", rewritten(*_PARTIAL_AFTER_ALL_REDUCE_EDITS)),
        ),
        origin=blind(
            TRAINING_KNOBS, "https://github.com/pytorch/pytorch/pull/125484", survived_before=True
        ),
    ),
)
