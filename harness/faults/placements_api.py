"""Faults in DTensor's API around plain tensors and autograd: from_local / to_local / full_tensor
and the gradients their backward hands on, the shape, stride, dtype and requires_grad of DTensor
results and factories."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._origin import blind
from harness.faults._patch import Fault, Patch
from harness.faults.held_out import DTENSOR_DEPTH

_API = "torch.distributed.tensor._api"


def _from_local_grad_passthrough(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(ctx: Any, grad_output: Any) -> Any:
        if grad_output is None:
            return None, None, None, None, None, None, None
        # Whatever placement the gradient arrived with, its local piece is returned as is.
        return grad_output._local_tensor, None, None, None, None, None, None

    return backward


def _from_local_grad_to_partial(original: Callable[..., Any]) -> Callable[..., Any]:
    def backward(ctx: Any, grad_output: Any) -> Any:
        if grad_output is None:
            return None, None, None, None, None, None, None
        from torch.distributed.tensor._dtensor_spec import DTensorSpec
        from torch.distributed.tensor._redistribute import redistribute_local_tensor

        target = ctx.grad_placements or ctx.forward_input_placements
        if tuple(grad_output.placements) == tuple(target):
            return grad_output._local_tensor, None, None, None, None, None, None
        spec = DTensorSpec(
            ctx.forward_input_device_mesh, tuple(target), tensor_meta=grad_output._spec.tensor_meta
        )
        # Pre-#115967: back to the forward placements as they are, so a replicated
        # gradient becomes Partial by dividing it by the mesh size.
        local = redistribute_local_tensor(grad_output._local_tensor, grad_output._spec, spec)
        return local, None, None, None, None, None, None

    return backward


def _to_local_grad_placements_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(ctx: Any, input: Any, grad_placements: Any) -> Any:
        return original(ctx, input, None)

    return forward


def _to_local_partial_grad_kept(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward(ctx: Any, input: Any, grad_placements: Any) -> Any:
        if grad_placements is None:
            # Pre-#173454: the gradient is assumed to have the forward placements, Partial
            # included, so a gradient that is really replicated is reduced once more.
            grad_placements = tuple(input.placements)
        return original(ctx, input, grad_placements)

    return forward


def _global_stride_of_shard(original: Callable[..., Any]) -> Callable[..., Any]:
    def compute_global_tensor_info(tensor: Any, mesh: Any, placements: Any) -> Any:
        shape, _ = original(tensor, mesh, placements)
        return shape, list(tensor.stride())

    return compute_global_tensor_info


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


def _factory_requires_grad_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    def _dtensor_init_helper(
        init_op: Any, size: Any, device_mesh: Any = None, placements: Any = None, **kwargs: Any
    ) -> Any:
        kwargs["requires_grad"] = False
        return original(init_op, size, device_mesh, placements, **kwargs)

    return _dtensor_init_helper


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
    # https://github.com/pytorch/torchtitan/issues/2416 (MoE numerics, fixed with PR
    # pytorch/pytorch#175867) and torchtitan PR #2532: a gradient that must be all-reduced
    # when it leaves DTensor (from_local's backward redistributing Partial -> Replicate) was
    # handed back as each rank's local partial piece.
    Fault(
        id="placements.from_local_backward_not_redistributed",
        area="placements",
        bug_class="an input gradient not reduced (its pending Partial dropped)",
        summary="from_local's backward returns the incoming gradient's local tensor without "
        "redistributing it to the forward placements (or grad_placements): a Partial "
        "gradient reaches the plain tensor unreduced, a Shard one as a shard of the wrong size",
        patches=(Patch(f"{_API}:_FromTorchTensor.backward", _from_local_grad_passthrough),),
        origin=blind(
            DTENSOR_DEPTH, "https://github.com/pytorch/torchtitan/issues/2416", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/115967 ("The current div logic will lead to
    # wrong numerical value"; also #173153): from_local with a Partial forward placement
    # redistributed its replicated gradient back to Partial, dividing it by the mesh size.
    Fault(
        id="placements.from_local_backward_partial_divides",
        area="placements",
        bug_class="a gradient redistributed to Partial (Replicate -> Partial divides by n)",
        summary="from_local's backward redistributes the gradient to the forward placements "
        "as they are instead of mapping Partial to Replicate: the local gradient of a tensor "
        "made with from_local(..., [Partial()]) is divided by the mesh dim size",
        patches=(Patch(f"{_API}:_FromTorchTensor.backward", _from_local_grad_to_partial),),
        origin=blind(
            DTENSOR_DEPTH, "https://github.com/pytorch/pytorch/pull/115967", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/121474 (to_local's grad_placements must be
    # honoured, not forced back to the forward placements) and torchtitan PR #2532 (a
    # to_local without the right grad_placements skipped the TP all-reduce of a norm weight's
    # gradient).
    Fault(
        id="placements.to_local_grad_placements_ignored",
        area="placements",
        bug_class="a user-given gradient layout hint ignored",
        summary="to_local(grad_placements=...) and full_tensor(grad_placements=...) drop the "
        "hint: the gradient is labelled with the forward placements (Partial -> Replicate), "
        "so a gradient declared Partial is never reduced and one declared Shard is mislabelled",
        patches=(Patch(f"{_API}:_ToTorchTensor.forward", _to_local_grad_placements_dropped),),
        origin=blind(
            DTENSOR_DEPTH, "https://github.com/pytorch/pytorch/pull/121474", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/172932 (fixed by PR #173454): to_local on a
    # Partial DTensor labelled its gradient Partial, so to_local + from_local(Partial) gave a
    # different gradient from the same program on DTensors.
    Fault(
        id="placements.to_local_partial_grad_kept_partial",
        area="placements",
        bug_class="a replicated gradient labelled Partial (summed once more)",
        summary="without grad_placements, to_local's backward labels the gradient with the "
        "forward placements as they are: for a Partial DTensor the (replicated) gradient is "
        "treated as Partial and all-reduced again, multiplying it by the mesh dim size",
        patches=(Patch(f"{_API}:_ToTorchTensor.forward", _to_local_partial_grad_kept),),
        origin=blind(
            DTENSOR_DEPTH, "https://github.com/pytorch/pytorch/issues/172932", survived_before=True
        ),
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
        origin=blind(
            DTENSOR_DEPTH, "https://github.com/pytorch/pytorch/issues/118836", survived_before=True
        ),
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
        origin=blind(
            DTENSOR_DEPTH, "https://github.com/pytorch/pytorch/pull/102630", survived_before=True
        ),
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
        origin=blind(
            DTENSOR_DEPTH, "https://github.com/pytorch/pytorch/pull/46486", survived_before=True
        ),
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
        origin=blind(
            DTENSOR_DEPTH,
            "https://github.com/pytorch/pytorch/issues/27171",
            "https://github.com/google/torchax/pull/18",
            survived_before=True,
        ),
    ),
)
