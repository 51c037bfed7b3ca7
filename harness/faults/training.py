"""Faults in data-parallel training: FSDP2/HSDP gradient reduction, optimizer kernels on
sharded parameters, ZeroRedundancyOptimizer's bookkeeping."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._patch import Fault, Patch, forcing_argument

_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
_ZERO = "torch.distributed.optim.zero_redundancy_optimizer"


def _summed_gradients(original: Callable[..., Any]) -> Callable[..., Any]:
    def divide_factors(*args: Any, **kwargs: Any) -> Any:
        from torch.distributed import ReduceOp

        pre, _post, rs_op, ar_op = original(*args, **kwargs)
        if rs_op == ReduceOp.AVG:
            rs_op = ReduceOp.SUM
        return pre, None, rs_op, ar_op

    return divide_factors


def _replicate_axis_ignored(original: Callable[..., Any]) -> Callable[..., Any]:
    def divide_factors(
        reduce_scatter_group: Any, all_reduce_group: Any, *args: Any, **kwargs: Any
    ) -> Any:
        from torch.distributed import ReduceOp

        pre, post, rs_op, ar_op = original(reduce_scatter_group, None, *args, **kwargs)
        if all_reduce_group is None:
            return pre, post, rs_op, ar_op
        return pre, post, rs_op, ReduceOp.SUM

    return divide_factors


def _is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _foreach_drops_weight_decay(original: Callable[..., Any]) -> Callable[..., Any]:
    def multi_tensor_sgd(params: list[Any], *args: Any, **kwargs: Any) -> Any:
        if params and _is_dtensor(params[0]):
            kwargs["weight_decay"] = 0.0
        return original(params, *args, **kwargs)

    return multi_tensor_sgd


def _step_counted_twice(original: Callable[..., Any]) -> Callable[..., Any]:
    def adam_kernel(params: list[Any], grads: list[Any], *args: Any, **kwargs: Any) -> Any:
        result = original(params, grads, *args, **kwargs)
        if params and _is_dtensor(params[0]):
            for step in args[3]:  # state_steps
                step.add_(1)
        return result

    return adam_kernel


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


def _local_total_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    def total_norm(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        from torch import Tensor
        from torch.distributed.tensor import DTensor

        listed = [tensors] if isinstance(tensors, Tensor) else list(tensors)
        local = [t.to_local() if isinstance(t, DTensor) else t for t in listed]
        return original(local, *args, **kwargs)

    return total_norm


def _unsynced_grads_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    def post_backward(self: Any, *args: Any) -> Any:
        result = original(self, *args)
        if not self.reduce_grads:
            for fsdp_param in self.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                if hasattr(fsdp_param, "_unsharded_param"):
                    fsdp_param.unsharded_param.grad = None
        return result

    return post_backward


def _no_broadcast(original: Callable[..., Any]) -> Callable[..., Any]:
    def sync_module_states(*args: Any, **kwargs: Any) -> None:
        return None

    return sync_module_states


FAULTS = (
    Fault(
        id="fsdp.gradients_summed",
        area="optim",
        bug_class="gradient scaling: data-parallel gradients summed, never divided",
        summary="FSDP2 reduce-scatters gradients with SUM and skips the post-division",
        patches=(Patch(f"{_COLLECTIVES}:_get_gradient_divide_factors", _summed_gradients),),
    ),
    Fault(
        id="hsdp.replicate_axis_not_divided",
        area="optim",
        bug_class="gradient scaling across mesh axes: the divide factor ignores one axis",
        summary="HSDP divides gradients by the shard-axis size only and sums over the "
        "replicate axis",
        patches=(Patch(f"{_COLLECTIVES}:_get_gradient_divide_factors", _replicate_axis_ignored),),
    ),
    Fault(
        id="hsdp.replicate_all_reduce_skipped",
        area="optim",
        bug_class="a collective skipped on one mesh axis",
        summary="HSDP never all-reduces gradients over the replicate axis",
        patches=(
            Patch(f"{_PARAM_GROUP}:foreach_reduce", forcing_argument("all_reduce_group", None)),
        ),
    ),
    Fault(
        id="fsdp.unsynced_grads_dropped",
        area="optim",
        bug_class="gradient accumulation without sync loses the earlier micro-batches",
        summary="FSDP2's post-backward with requires_gradient_sync=False discards the "
        "unsharded gradients instead of keeping them for the next backward",
        patches=(Patch(f"{_PARAM_GROUP}:FSDPParamGroup.post_backward", _unsynced_grads_dropped),),
    ),
    Fault(
        id="optim.clip_norm_of_local_shards",
        area="optim",
        bug_class="a global reduction computed from the local shards only",
        summary="clip_grad_norm_ takes the total norm of each rank's local gradient shards "
        "instead of the whole (DTensor) gradients",
        patches=(Patch("torch.nn.utils.clip_grad:_get_total_norm", _local_total_norm),),
    ),
    Fault(
        id="ddp.init_broadcast_skipped",
        area="optim",
        bug_class="a collective skipped: replicas never synchronised at construction",
        summary="DistributedDataParallel's constructor skips broadcasting rank 0's "
        "parameters and buffers",
        patches=(Patch("torch.nn.parallel.distributed:_sync_module_states", _no_broadcast),),
    ),
    Fault(
        id="optim.foreach_drops_weight_decay",
        area="optim",
        bug_class="foreach and single-tensor kernels disagree (a term lost on one path)",
        summary="SGD's foreach kernel ignores weight_decay for DTensor parameters",
        patches=(Patch("torch.optim.sgd:_multi_tensor_sgd", _foreach_drops_weight_decay),),
    ),
    Fault(
        id="optim.adam_step_counted_twice",
        area="optim",
        bug_class="an optimizer step counter advanced twice (bias correction off)",
        summary="Adam/AdamW's single-tensor and foreach kernels advance 'step' twice for "
        "DTensor parameters",
        patches=(
            Patch("torch.optim.adam:_single_tensor_adam", _step_counted_twice),
            Patch("torch.optim.adam:_multi_tensor_adam", _step_counted_twice),
        ),
    ),
    Fault(
        id="zero.state_on_wrong_param",
        area="zero",
        bug_class="optimizer state attached to the wrong parameter",
        summary="ZeroRedundancyOptimizer.state_dict swaps the states of the first two "
        "parameters with same-shaped state",
        patches=(Patch(f"{_ZERO}:ZeroRedundancyOptimizer.state_dict", _state_swapped),),
    ),
    Fault(
        id="zero.round_robin_partition",
        area="zero",
        bug_class="a partition that ignores sizes (round robin instead of sorted greedy)",
        summary="ZeroRedundancyOptimizer assigns parameter i of each group to rank i % world",
        patches=(
            Patch(f"{_ZERO}:ZeroRedundancyOptimizer._partition_parameters", _round_robin_partition),
        ),
    ),
)
