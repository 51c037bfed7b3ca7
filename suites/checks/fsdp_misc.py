"""Rank functions of the FSDP init suite for fixed small models: ``shard_placement_fn``,
containers, parameters ``fully_shard`` refuses, frozen mixed dtypes, the FSDP classes with
mixed precision, and device moves (CUDA)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from harness import RankContext
from harness.cases.modules import ContainerCase, GraphCase, MLPMeshCase, ShardDimCase
from harness.parity import assert_array_equal, assert_close, assert_equal_values, failure
from harness.torchkit import devices
from harness.torchkit.dtensor import DTensorView, tensor_from, to_numpy, view_of
from harness.torchkit.module_graphs import (
    DictWithForward,
    FrozenMixedDtypes,
    ListWithForward,
    build_graph,
    build_linears,
    build_mesh_mlp,
    graph_batch,
)
from specs.fsdp_layouts import chunk
from specs.modules import Loc
from specs.placements import Shard as SpecShard
from suites.checks.fsdp_graphs import Raised, roots_of
from suites.checks.fsdp_meshes import PLAN, TP_DIMS


def _rows(batch: np.ndarray, ctx: RankContext, per_rank: int, dtype: str) -> torch.Tensor:
    rows = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    return tensor_from(batch[rows], dtype, ctx.device)


def shard_dim_on_rank(ctx: RankContext, case: ShardDimCase) -> Raised | dict[str, DTensorView]:
    """``fully_shard(Sequential(linears), shard_placement_fn=...)`` asking ``Shard(d)`` for
    each parameter: the parameters' views, or what ``fully_shard`` raised."""
    model = nn.Sequential(*build_linears(case.dims, case.seed, ctx.device))
    wanted = {id(p): d for p, d in zip(model.parameters(), case.shard_dims, strict=True)}
    try:
        fully_shard(
            model,
            mesh=ctx.mesh((ctx.world_size,)),
            shard_placement_fn=lambda p: Shard(wanted[id(p)]),
        )
    except (AssertionError, NotImplementedError) as exc:
        return Raised("fully_shard", type(exc).__name__, str(exc))
    return {name: view_of(p, ctx.rank) for name, p in model.named_parameters()}


def linear_values(case: ShardDimCase) -> dict[str, np.ndarray]:
    model = nn.Sequential(*build_linears(case.dims, case.seed, "cpu"))
    return {name: to_numpy(p) for name, p in model.named_parameters()}


# --- containers ------------------------------------------------------------------------------


def _container(case: ContainerCase, with_forward: bool, device: torch.device | str) -> nn.Module:
    layers = build_linears((case.width,) * (case.layers + 1), case.seed, device)
    if case.kind == "list":
        return ListWithForward(layers) if with_forward else nn.ModuleList(layers)
    named = {f"layer{i}": layer for i, layer in enumerate(layers)}
    return DictWithForward(named) if with_forward else nn.ModuleDict(named)


def container_batch(case: ContainerCase, world_size: int) -> np.ndarray:
    rng = np.random.default_rng([case.seed, 3])
    return rng.uniform(-1, 1, (world_size * case.batch_per_rank, case.width))


def container_on_rank(ctx: RankContext, case: ContainerCase) -> tuple[str, str, np.ndarray]:
    """The plain container: the ValueError and the container's ``str``; the subclass with
    ``forward``: its output on this rank's rows after ``fully_shard``."""
    plain = _container(case, False, ctx.device)
    text, mesh = str(plain), ctx.mesh((ctx.world_size,))
    try:
        fully_shard(plain, mesh=mesh)
        message = ""
    except ValueError as exc:
        message = str(exc)
    model = _container(case, True, ctx.device)
    fully_shard(model, mesh=mesh)
    inputs = _rows(container_batch(case, ctx.world_size), ctx, case.batch_per_rank, "float64")
    return message, text, to_numpy(model(inputs))


def container_reference(case: ContainerCase, world_size: int) -> np.ndarray:
    model = _container(case, True, "cpu")
    return to_numpy(model(torch.from_numpy(container_batch(case, world_size))))


# --- parameters fully_shard refuses -----------------------------------------------------------


def unsupported_on_rank(ctx: RankContext, case: GraphCase, kind: str, node: int) -> Raised | None:
    """Give ``node`` a scalar parameter ``scalar_p`` (``kind='scalar'``) or a non-contiguous
    weight (``'noncontiguous'``), then apply the plan: what it raised, at which call."""
    built = build_graph(case, ctx.device)
    module = built.modules[node]
    if kind == "scalar":
        scalar = torch.tensor(1.0, dtype=torch.float64, device=ctx.device)
        module.register_parameter("scalar_p", nn.Parameter(scalar))
    else:
        weight = module.get_parameter("weight").detach()
        module.register_parameter("weight", nn.Parameter(weight.t().contiguous().t()))
    mesh = ctx.mesh((ctx.world_size,))
    for index, wrap in enumerate(case.graph.wraps):
        try:
            fully_shard(roots_of(built, wrap.nodes), mesh=mesh)
        except (ValueError, NotImplementedError) as exc:
            return Raised(f"wraps[{index}]", type(exc).__name__, str(exc))
    return None


# --- frozen parameters of mixed dtypes ---------------------------------------------------------


@dataclass(frozen=True)
class MixedView:
    dtypes: dict[str, tuple[str, str]]
    """Per parameter: (dtype, local dtype)."""
    values: dict[str, np.ndarray]
    """Each parameter as float32: the rank's local shard (no collective: gloo cannot gather
    float8), or the reference's full value."""
    output: np.ndarray
    grads: dict[str, np.ndarray | None]


def mixed_on_rank(ctx: RankContext, case: GraphCase) -> MixedView:
    model = FrozenMixedDtypes(case.width, case.seed, ctx.device)
    fully_shard(model, mesh=ctx.mesh((ctx.world_size,)))
    inputs = _rows(graph_batch(case, ctx.world_size, 0)[0], ctx, case.batch_per_rank, "float32")
    output = model(inputs)
    output.square().mean().backward()
    params = {n: _dtensor(p) for n, p in model.named_parameters()}
    grads = {n: p.grad for n, p in model.named_parameters()}
    return MixedView(
        dtypes={n: (str(p.dtype), str(p.to_local().dtype)) for n, p in params.items()},
        values={n: to_numpy(p.to_local().to(torch.float32)) for n, p in params.items()},
        output=to_numpy(output),
        grads={
            n: None if g is None else to_numpy(_dtensor(g).full_tensor()) for n, g in grads.items()
        },
    )


def _dtensor(tensor: torch.Tensor) -> DTensor:
    assert isinstance(tensor, DTensor), "fully_shard makes parameters and gradients DTensors"
    return tensor


def mixed_reference(case: GraphCase, world_size: int) -> MixedView:
    model = FrozenMixedDtypes(case.width, case.seed, "cpu")
    inputs = torch.from_numpy(graph_batch(case, world_size, 0)[0]).to(torch.float32)
    output = model(inputs)
    output.square().mean().backward()
    params = dict(model.named_parameters())
    return MixedView(
        dtypes={n: (str(p.dtype), str(p.dtype)) for n, p in params.items()},
        values={n: to_numpy(p.to(torch.float32)) for n, p in params.items()},
        output=to_numpy(output),
        grads={n: None if p.grad is None else to_numpy(p.grad) for n, p in params.items()},
    )


# --- FSDP classes, the old import path, mixed precision ------------------------------------------


@dataclass(frozen=True)
class ClassesView:
    fsdp_module: tuple[bool, ...]
    """Per node: ``isinstance(module, FSDPModule)``."""
    kept_class: tuple[bool, ...]
    """Per node: still an instance of the class it was built with."""
    same_api: bool
    """The old import path serves the same ``fully_shard`` and policy classes."""
    output_dtype: str
    grads: dict[str, np.ndarray]
    grad_dtypes: dict[str, str]


def classes_on_rank(ctx: RankContext, case: GraphCase) -> ClassesView:
    """The plan through ``torch.distributed._composable.fsdp`` with bf16 parameters in
    forward and backward; one step."""
    import importlib

    from torch.distributed import fsdp as new

    old: Any = importlib.import_module("torch.distributed._composable.fsdp")

    built = build_graph(case, ctx.device)
    classes = [type(m) for m in built.modules]
    mesh = ctx.mesh((ctx.world_size,))
    policy = old.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for wrap in case.graph.wraps:
        old.fully_shard(roots_of(built, wrap.nodes), mesh=mesh, mp_policy=policy)
    inputs, targets = (
        _rows(a, ctx, case.batch_per_rank, "float64") for a in graph_batch(case, ctx.world_size, 0)
    )
    output = built.root(inputs)
    F.mse_loss(output, targets.to(output.dtype)).backward()
    params = built.root.named_parameters()
    grads = {n: _dtensor(p.grad).full_tensor() for n, p in params if p.grad is not None}
    return ClassesView(
        fsdp_module=tuple(isinstance(m, old.FSDPModule) for m in built.modules),
        kept_class=tuple(isinstance(m, c) for m, c in zip(built.modules, classes, strict=True)),
        same_api=old.fully_shard is new.fully_shard
        and old.MixedPrecisionPolicy is new.MixedPrecisionPolicy
        and old.FSDPModule is new.FSDPModule,
        output_dtype=str(output.dtype),
        grads={n: to_numpy(g) for n, g in grads.items()},
        grad_dtypes={n: str(g.dtype) for n, g in grads.items()},
    )


def bf16_reference(case: GraphCase, world_size: int) -> dict[str, tuple[np.ndarray, float]]:
    """Per parameter: the mean over ranks of each rank's bfloat16 gradient (its own rows, on
    one device, summed in float64), and how far FSDP may be from it: its reduce-scatter sums
    the ``world_size`` bf16 gradients in bf16 and divides in bf16, each step rounding by at
    most half a bf16 ulp (2**-8 relative) of the largest partial sum."""
    inputs, targets = graph_batch(case, world_size, 0)
    per_rank: list[dict[str, np.ndarray]] = []
    for rank in range(world_size):
        model = build_graph(case, "cpu").root.to(torch.bfloat16)
        rows = slice(rank * case.batch_per_rank, (rank + 1) * case.batch_per_rank)
        x, y = (torch.from_numpy(a[rows]).to(torch.bfloat16) for a in (inputs, targets))
        F.mse_loss(model(x), y).backward()
        per_rank.append(
            {n: to_numpy(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        )
    found = {}
    for name in per_rank[0]:
        grads = np.stack([g[name].astype(np.float64) for g in per_rank])
        bound = (world_size + 3) * 2.0**-8 * float(np.abs(grads).sum(axis=0).max(initial=0.0))
        found[name] = (grads.mean(axis=0), bound / world_size)
    return found


# --- device moves (CUDA) -------------------------------------------------------------------------


def device_on_rank(ctx: RankContext, case: GraphCase, ignored: tuple[Loc, ...]) -> dict[str, Any]:
    """Build on CPU, shard with a CUDA mesh, the root's call ignoring the parameters at the
    canonical places ``ignored``: each place's device after ``fully_shard`` and after
    ``model.to(device)``, and this rank's current CUDA device."""
    built = build_graph(case, "cpu")
    skip = {
        t
        for loc, t in built.places()
        if isinstance(t, nn.Parameter) and built.graph.source(loc) in ignored
    }
    mesh = ctx.mesh((ctx.world_size,))
    for wrap in case.graph.wraps:
        chosen = skip if wrap.nodes == (0,) else None
        fully_shard(roots_of(built, wrap.nodes), mesh=mesh, ignored_params=chosen)
    after = {f"{loc[0]}.{loc[1]}": str(t.device) for loc, t in built.places()}
    built.root.to(ctx.device)
    moved = {f"{loc[0]}.{loc[1]}": str(t.device) for loc, t in built.places()}
    here = str(devices.current_device(ctx.device))
    return {"after": after, "moved": moved, "device": here}


def tp_device_on_rank(ctx: RankContext, case: MLPMeshCase) -> dict[str, Any]:
    """CPU MLP parallelised over an accelerator's ``tp`` mesh, then sharded over ``dp``: devices of
    every parameter (and local tensor) and buffer before and after ``fully_shard``."""
    mesh = ctx.mesh(case.mesh_shape, ("dp", "tp"))
    model = build_mesh_mlp(case, "cpu")
    parallelize_module(model, mesh["tp"], PLAN)
    before = _devices(model)
    fully_shard(model, mesh=mesh["dp"])
    here = str(devices.current_device(ctx.device))
    return {"before": before, "after": _devices(model), "device": here}


def expected_tp_devices(
    case: MLPMeshCase, here: str
) -> dict[str, dict[str, tuple[str, str | None]]]:
    """(device, local tensor's device) of each tensor ``tp_device_on_rank`` reports: before
    ``fully_shard`` the TP parameters are DTensors already on the mesh's device (the DTensor
    constructor moves them) and the buffer a plain CPU tensor; after it, everything on the
    rank's current device ``here``."""
    names = [n for n in TP_DIMS if case.bias or n.endswith("weight")]
    params: dict[str, tuple[str, str | None]] = {n: (here, here) for n in names}
    return {
        "before": {**params, "buffer": ("cpu", None)},
        "after": {**params, "buffer": (here, None)},
    }


def _devices(model: nn.Module) -> dict[str, tuple[str, str | None]]:
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {
        n: (str(t.device), str(t.to_local().device) if isinstance(t, DTensor) else None)
        for n, t in tensors
    }


def mismatch_on_rank(ctx: RankContext, case: MLPMeshCase) -> str | None:
    """TP over a CPU mesh, FSDP over an accelerator's: the ValueError ``fully_shard`` raises."""
    cpu = init_device_mesh("cpu", case.mesh_shape, mesh_dim_names=("dp", "tp"))
    accelerated = ctx.mesh(case.mesh_shape, ("dp", "tp"))
    model = build_mesh_mlp(case, "cpu")
    parallelize_module(model, cpu["tp"], PLAN)
    try:
        fully_shard(model, mesh=accelerated["dp"])
    except ValueError as exc:
        return str(exc)
    return None


# --- driver-side checks -----------------------------------------------------------------------


def unsupported_outcome(kind: str, wrap: int, width: int) -> tuple[str, str, str]:
    """(the call that raises, exception type, message start); an empty message start: no
    error (a width-1 weight is contiguous whatever its strides say)."""
    if kind == "scalar":
        return (
            f"wraps[{wrap}]",
            "ValueError",
            "fully_shard doesn't support scalar parameters. "
            "Change scalar_p to a 1D tensor with numel equal to 1.",
        )
    message = "FSDP does not support non-contiguous parameters yet" if width > 1 else ""
    return f"wraps[{wrap}]", "NotImplementedError", message


def assert_shard_dim_result(
    result: Raised | dict[str, DTensorView],
    outcome: tuple[str, str] | tuple[int, ...],
    values: dict[str, np.ndarray],
    rank: int,
    world_size: int,
) -> None:
    """The error the model predicts, or each parameter ``(Shard(d),)`` holding this rank's
    piece of dim ``d``, its full value the original."""
    __tracebackhide__ = True
    if outcome and isinstance(outcome[0], str):
        got = result if not isinstance(result, Raised) else (result.kind, result.message)
        ok = isinstance(got, tuple) and got[0] == outcome[0] and got[1].startswith(str(outcome[1]))
        if not ok:
            raise failure(f"rank {rank}: got {got!r}, should be {outcome!r}...")
        return
    if not isinstance(result, dict):
        raise failure(f"rank {rank}: got {result!r}, should succeed")
    for (name, view), dim in zip(result.items(), outcome, strict=True):
        full, who = values[name], f"{name} on rank {rank}"
        assert isinstance(dim, int)
        assert_equal_values(view.placements, (SpecShard(dim),), what=f"placements of {who}")
        local = chunk(full, world_size, dim, rank)
        assert_array_equal(view.local, local, what=f"local shard of {who}")
        assert view.full is not None, "views carry full_tensor()"
        assert_array_equal(view.full, full, what=f"full_tensor() of {who}")


def mixed_call(case: GraphCase) -> str:
    """The reproduction of ``mixed_on_rank``'s run."""
    return f"FrozenMixedDtypes(width={case.width}), batch {case.batch_per_rank}/rank"


# float32 matmuls of a few rows against the whole batch, and the mean of per-rank mean losses
# against one mean: the same products summed in another order.
F32_RTOL, F32_ATOL = 1e-5, 1e-6
F32_WHY = "float32 sums of the same terms in another order (row blocks, per-rank means)"


def _assert_float32_close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    __tracebackhide__ = True
    assert_close(
        actual, expected, rtol=F32_RTOL, atol=F32_ATOL, dtype="float32", what=what, why=F32_WHY
    )


def assert_mixed(
    view: MixedView, reference: MixedView, rank: int, world_size: int, case: GraphCase
) -> None:
    """dtypes kept, values unchanged, the frozen weight gets no gradient, output and the
    trainable weight's gradient match one device."""
    __tracebackhide__ = True
    what = f"(dtype, local dtype) on rank {rank}"
    assert_equal_values(view.dtypes, reference.dtypes, what=what)
    for name, full in reference.values.items():
        local = chunk(full, world_size, 0, rank)
        assert_array_equal(view.values[name], local, what=f"{name} on rank {rank}")
    rows = slice(rank * case.batch_per_rank, (rank + 1) * case.batch_per_rank)
    _assert_float32_close(view.output, reference.output[rows], f"output on rank {rank}")
    assert_equal_values(view.grads["w_fp8"], None, what=f"grad of the frozen weight on rank {rank}")
    grad, expected = view.grads["w_fp32"], reference.grads["w_fp32"]
    if grad is None:
        raise failure(f"rank {rank}: no gradient of w_fp32")
    assert expected is not None, "the reference trains w_fp32"
    _assert_float32_close(grad, expected, f"grad of w_fp32 on rank {rank}")


def classes_call(case: GraphCase) -> str:
    """The reproduction of ``classes_on_rank``'s run."""
    return f"{case.call()}, through torch.distributed._composable.fsdp, bf16 params"


def assert_classes(
    view: ClassesView,
    expected: tuple[bool, ...],
    reference: dict[str, tuple[np.ndarray, float]],
    rank: int,
) -> None:
    __tracebackhide__ = True
    assert_equal_values(view.same_api, True, what="old import path serves the same API")
    assert_equal_values(view.fsdp_module, expected, what=f"FSDPModule per node on rank {rank}")
    what = f"original classes kept on rank {rank}"
    assert_equal_values(all(view.kept_class), True, what=what)
    assert_equal_values(view.output_dtype, "torch.bfloat16", what="output dtype")
    assert_equal_values(sorted(view.grads), sorted(reference), what=f"gradients on rank {rank}")
    for name, (grad, bound) in reference.items():
        what = f"dtype of grad of {name}"
        assert_equal_values(view.grad_dtypes[name], "torch.float64", what=what)
        assert_close(
            view.grads[name],
            grad,
            rtol=0.0,
            atol=bound,
            dtype="bfloat16",
            what=f"grad of {name} on rank {rank}",
            why="bf16 per-rank gradients summed and divided in bf16 by the reduce-scatter",
            record_as="grad/bf16",
        )


def zero_size_on_rank(ctx: RankContext, shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """``fully_shard`` of a module whose only parameter has ``shape`` (a zero-size dim past
    dim 0): (global shape, local shape). No collective: the local shape is what is checked."""
    module = nn.Module()
    module.register_parameter("weight", nn.Parameter(torch.zeros(shape, device=ctx.device)))
    fully_shard(module, mesh=ctx.mesh((ctx.world_size,)))
    weight = module.weight
    assert isinstance(weight, DTensor), "fully_shard made the parameter a DTensor"
    return tuple(weight.shape), tuple(weight.to_local().shape)


def raised_prefix(raised: Raised | None, length: int) -> tuple[str, str, str] | None:
    """(stage, exception type, the message's first ``length`` characters), or None."""
    return None if raised is None else (raised.stage, raised.kind, raised.message[:length])
