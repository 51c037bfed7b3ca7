"""Rank functions of the FSDP init suite over generated module graphs, and their references.

A rank builds the case's graph (``harness.torchkit.module_graphs``), applies its ``fully_shard`` /
``replicate`` plan on a 1-D mesh over all ranks and reports what torch did in the graph's own
terms: node indices for modules, canonical places ``(node, name)`` for parameters. The driver
compares those plain values with ``specs.modules``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from harness import RankContext
from harness.cases.modules import GraphCase
from harness.torchkit import internals
from harness.torchkit.dtensor import DTensorView, full_array, tensor_from, to_numpy, view_of
from harness.torchkit.module_graphs import BuiltGraph, build_graph, graph_batch
from specs.modules import Loc, ParamInfo, simulate

CONSTANT = 1337.0
"""What every local shard holds before ``reset_parameters`` in the meta checks."""


@dataclass(frozen=True)
class GroupView:
    """What one ``fully_shard`` call managed, as torch reported it."""

    wrap: int
    modules: tuple[int, ...]
    """``_get_managed_modules(roots)`` just before the call, in torch's order."""
    params: tuple[Loc, ...]
    buffers: tuple[Loc, ...]
    infos: tuple[ParamInfo, ...]
    """Each ``FSDPParam``'s ``ParamModuleInfo`` after the call, in the group's order."""


def roots_of(built: BuiltGraph, nodes: tuple[int, ...]) -> Any:
    """What ``fully_shard`` takes for ``nodes``: the module, or the list of them."""
    modules = [built.modules[n] for n in nodes]
    return modules[0] if len(modules) == 1 else modules


def _info(built: BuiltGraph, fsdp_param: Any) -> ParamInfo:
    module, name, shared, names = internals.fsdp_param_module_info(fsdp_param)
    places = tuple((built.node_of(m), n) for m, n in zip(shared, names, strict=True))
    return ParamInfo(built.node_of(module), name, places)


def _group_view(built: BuiltGraph, index: int, mesh: Any) -> GroupView:
    nodes = built.graph.wraps[index].nodes
    roots = tuple(built.modules[n] for n in nodes)
    modules = internals.fsdp_managed_modules(roots)
    params, buffers = internals.fsdp_managed_states(modules)
    seen = (tuple(built.node_of(m) for m in modules), tuple(map(built.canonical, params)))
    buffer_places = tuple(map(built.canonical, buffers))
    fully_shard(roots_of(built, nodes), mesh=mesh)
    groups = internals.fsdp_param_groups(internals.fsdp_state(roots[0]))
    fsdp_params = [p for g in groups for p in internals.fsdp_params(g)]
    infos = tuple(_info(built, p) for p in fsdp_params)
    return GroupView(index, seen[0], seen[1], buffer_places, infos)


def managed_on_rank(ctx: RankContext, case: GraphCase) -> tuple[GroupView, ...]:
    """Apply the plan; before each ``fully_shard`` call, ask torch what it will manage."""
    built = build_graph(case, ctx.device)
    mesh = ctx.mesh((ctx.world_size,))
    views: list[GroupView] = []
    for index, wrap in enumerate(case.graph.wraps):
        if wrap.api == "replicate":
            replicate(built.modules[wrap.nodes[0]])
        else:
            views.append(_group_view(built, index, mesh))
    return tuple(views)


def apply_plan(built: BuiltGraph, ctx: RankContext, **options: Any) -> None:
    mesh = ctx.mesh((ctx.world_size,))
    for wrap in built.graph.wraps:
        assert wrap.api == "fully_shard", "forward and training plans hold fully_shard only"
        fully_shard(roots_of(built, wrap.nodes), mesh=mesh, **options)


# --- parameters, ties and training ----------------------------------------------------------


@dataclass(frozen=True)
class ParamsView:
    before: tuple[str, ...]
    """``named_parameters()`` FQNs before the plan."""
    after: dict[str, DTensorView]
    """``named_parameters()`` after it, each parameter's view with its full value."""


def params_on_rank(ctx: RankContext, case: GraphCase) -> ParamsView:
    built = build_graph(case, ctx.device)
    before = tuple(name for name, _ in built.root.named_parameters())
    apply_plan(built, ctx)
    after = {name: view_of(p, ctx.rank) for name, p in built.root.named_parameters()}
    return ParamsView(before, after)


@dataclass(frozen=True)
class TrainView:
    objects: dict[Loc, int]
    """Per canonical place: how many distinct tensor objects its places hold."""
    values: dict[Loc, np.ndarray]
    """Per place (parameters and buffers): the full value it holds at the end."""
    losses: tuple[float, ...]
    """This rank's loss at each step."""
    after_reset: dict[Loc, np.ndarray] | None = None
    """Meta cases: each parameter's local shard right after ``reset_parameters``."""


def _objects(built: BuiltGraph, *, buffers: bool = True) -> dict[Loc, int]:
    held: dict[Loc, set[int]] = {}
    graph = built.graph
    for loc, tensor in built.places():
        if buffers or loc in graph.param_locs(loc[0]):
            held.setdefault(graph.source(loc), set()).add(id(tensor))
    return {loc: len(ids) for loc, ids in held.items()}


def _materialize(built: BuiltGraph, ctx: RankContext, assign_root: bool) -> dict[Loc, np.ndarray]:
    """``to_empty`` on the device, a constant everywhere, then ``reset_parameters``.

    ``assign_root``: the modules the root's call manages stay on meta and each of their
    tensors is instead replaced by a new one on the device (lazy init must pick up the new
    Parameter objects)."""
    graph = built.graph
    kept = set(simulate(graph)[-1].modules) if assign_root else set()
    for node, module in enumerate(built.modules):
        if node not in kept:
            module.to_empty(device=ctx.device, recurse=False)
    for node in sorted(kept):
        for loc in graph.param_locs(node) + graph.buffer_locs(node):
            _assign(built, loc, ctx)
    with torch.no_grad():
        for _, tensor in built.places():
            (tensor.to_local() if isinstance(tensor, DTensor) else tensor).fill_(CONSTANT)
    built.reset()
    return {
        graph.source(loc): to_numpy(t.to_local() if isinstance(t, DTensor) else t)
        for loc, t in built.places()
        if loc in graph.param_locs(loc[0])
    }


def _assign(built: BuiltGraph, loc: Loc, ctx: RankContext) -> None:
    """Replace the meta tensor at ``loc``, at every place holding it, by a new empty one."""
    old = getattr(built.modules[loc[0]], loc[1])
    if not old.is_meta:
        return  # already replaced through another place
    empty = torch.empty(tuple(old.shape), dtype=old.dtype, device=ctx.device)
    new: torch.Tensor = empty
    if isinstance(old, DTensor):
        sharded = distribute_tensor(empty, old.device_mesh, old.placements, src_data_rank=None)
        new = nn.Parameter(sharded)
    for place, tensor in list(built.places()):
        if tensor is old:
            setattr(built.modules[place[0]], place[1], new)


def _local_rows(case: GraphCase, ctx: RankContext, step: int) -> tuple[torch.Tensor, ...]:
    inputs, targets = graph_batch(case, ctx.world_size, step)
    rows = slice(ctx.rank * case.batch_per_rank, (ctx.rank + 1) * case.batch_per_rank)
    return tuple(tensor_from(a[rows], "float64", ctx.device) for a in (inputs, targets))


def _sgd_steps(
    built: BuiltGraph, case: GraphCase, batch: Callable[[int], tuple[torch.Tensor, ...]]
) -> tuple[float, ...]:
    """``case.steps`` SGD steps of the MSE loss on ``batch(step)``; the loss of each."""
    optimizer = torch.optim.SGD(built.root.parameters(), lr=case.lr, momentum=case.momentum)
    losses = []
    for step in range(case.steps):
        inputs, targets = batch(step)
        loss = F.mse_loss(built.root(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.item()))
    return tuple(losses)


def _rank_steps(built: BuiltGraph, case: GraphCase, ctx: RankContext) -> tuple[float, ...]:
    """``_sgd_steps`` on this rank's rows of each step's batch."""
    return _sgd_steps(built, case, lambda step: _local_rows(case, ctx, step))


def train_on_rank(ctx: RankContext, case: GraphCase, assign_root: bool = False) -> TrainView:
    """Shard with the plan (materialising a meta graph), then ``case.steps`` SGD steps."""
    built = build_graph(case, ctx.device)
    apply_plan(built, ctx)
    after_reset = _materialize(built, ctx, assign_root) if case.meta else None
    losses = _rank_steps(built, case, ctx)
    values = {loc: full_array(tensor) for loc, tensor in built.places()}
    objects = _objects(built, buffers=not case.meta)  # to_empty copies buffers per module
    return TrainView(objects, values, losses, after_reset)


def reference_training(case: GraphCase, world_size: int) -> TrainView:
    """The same graph and steps on one CPU device over the global batch."""
    built = build_graph(replace(case, meta=False), "cpu")
    losses = _sgd_steps(
        built,
        case,
        lambda step: tuple(torch.from_numpy(a) for a in graph_batch(case, world_size, step)),
    )
    values = {loc: full_array(tensor) for loc, tensor in built.places()}
    return TrainView(_objects(built), values, losses)


def initial_values(case: GraphCase) -> dict[Loc, np.ndarray]:
    """The seeded global value of every canonical parameter place."""
    built = build_graph(replace(case, meta=False), "cpu")
    return {built.graph.source(loc): full_array(t) for loc, t in built.places()}


# --- lazy init and its errors ---------------------------------------------------------------


@dataclass(frozen=True)
class LazyView:
    is_root: dict[int, bool | None]
    """Per wrap: its state's ``_is_root``."""
    states: tuple[int, ...]
    """The root's ``all_states`` as wrap indices."""
    module_fqns: dict[int, str | None]
    param_fqns: dict[int, tuple[tuple[Loc, str | None], ...]]


def _state_index(built: BuiltGraph) -> dict[int, int]:
    wraps = built.graph.wraps
    return {id(internals.fsdp_state(built.modules[w.nodes[0]])): i for i, w in enumerate(wraps)}


def _group_of(built: BuiltGraph, index: int) -> Any:
    state = internals.fsdp_state(built.modules[built.graph.wraps[index].nodes[0]])
    groups = internals.fsdp_param_groups(state)
    return groups[0] if groups else None


def lazy_on_rank(ctx: RankContext, case: GraphCase) -> LazyView:
    """Shard with the plan, lazily initialise the root's state, read what it decided."""
    built = build_graph(case, ctx.device)
    apply_plan(built, ctx)
    root = internals.fsdp_state(built.root)
    internals.fsdp_lazy_init(root)
    index = _state_index(built)
    wraps = range(len(case.graph.wraps))
    states = {i: internals.fsdp_state(built.modules[case.graph.wraps[i].nodes[0]]) for i in wraps}
    groups = {i: _group_of(built, i) for i in wraps}
    return LazyView(
        is_root={i: internals.fsdp_is_root(s) for i, s in states.items()},
        states=tuple(index[id(s)] for s in internals.fsdp_all_states(root)),
        module_fqns={i: g and internals.fsdp_module_fqn(g) for i, g in groups.items()},
        param_fqns={
            i: tuple(
                (_param_place(built, p), internals.fsdp_param_fqn(p))
                for p in (internals.fsdp_params(g) if g else [])
            )
            for i, g in groups.items()
        },
    )


def _param_place(built: BuiltGraph, fsdp_param: Any) -> Loc:
    module, name, _, _ = internals.fsdp_param_module_info(fsdp_param)
    return built.graph.source((built.node_of(module), name))


def double_init_on_rank(ctx: RankContext, case: GraphCase, first: int) -> str | None:
    """Lazily initialise the state of ``wraps[first]`` on its own, then the root's; the
    RuntimeError the root raises, or None."""
    built = build_graph(case, ctx.device)
    apply_plan(built, ctx)
    internals.fsdp_lazy_init(internals.fsdp_state(built.modules[case.graph.wraps[first].nodes[0]]))
    try:
        internals.fsdp_lazy_init(internals.fsdp_state(built.root))
    except RuntimeError as exc:
        return str(exc)
    return None


def multi_root_on_rank(ctx: RankContext, case: GraphCase) -> str | None:
    """Lazily initialise the state of the plan's last call (several modules) as a root."""
    built = build_graph(case, ctx.device)
    apply_plan(built, ctx)
    try:
        internals.fsdp_lazy_init(internals.fsdp_state(built.modules[case.graph.wraps[-1].nodes[0]]))
    except RuntimeError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class Raised:
    stage: str
    """``fully_shard`` or ``forward``."""
    kind: str
    message: str


def _step(built: BuiltGraph, case: GraphCase, ctx: RankContext) -> None:
    inputs, targets = _local_rows(case, ctx, 0)
    F.mse_loss(built.root(inputs), targets).backward()


def errors_on_rank(ctx: RankContext, case: GraphCase) -> Raised | None:
    """Shard with the plan and train one step; the first exception and where it arose."""
    built = build_graph(case, ctx.device)
    stage = "fully_shard"
    try:
        apply_plan(built, ctx)
        stage = "forward"
        _step(built, case, ctx)
    except Exception as exc:
        return Raised(stage, type(exc).__name__, str(exc))
    return None


def meta_error_on_rank(ctx: RankContext, case: GraphCase, keep: tuple[int, ...]) -> str | None:
    """On meta: ``to_empty`` every module but ``keep`` (own tensors only; buffers of ``keep``
    are replaced too), then one step."""
    built = build_graph(case, ctx.device)
    apply_plan(built, ctx)
    for node, module in enumerate(built.modules):
        if node not in keep:
            module.to_empty(device=ctx.device, recurse=False)
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:  # buffers are not the point: only parameters stay on meta
                setattr(module, name, torch.empty_like(buffer, device=ctx.device))
    built.reset()
    try:
        _step(built, case, ctx)
    except RuntimeError as exc:
        return str(exc)
    return None


# --- meta init with state dicts -------------------------------------------------------------


def broadcast_load_on_rank(ctx: RankContext, case: GraphCase) -> TrainView:
    """Rank 0 holds the full state dict; every rank builds the graph on meta, shards it,
    receives each tensor by broadcast from rank 0, shards it like the meta tensor and loads
    the result with ``assign=True``; then trains like ``train_on_rank``."""
    full = None
    if ctx.rank == 0:
        full = build_graph(replace(case, meta=False), ctx.device)
    built = build_graph(replace(case, meta=True), ctx.device)
    apply_plan(built, ctx)
    source = full.root.state_dict() if full is not None else None
    loaded = {}
    for key, meta in built.root.state_dict().items():
        value = source[key].detach().clone() if source is not None else None
        loaded[key] = _received(meta, value, ctx)
    built.root.load_state_dict(loaded, assign=True)
    return _train_loaded(built, case, ctx)


def _received(meta: torch.Tensor, value: torch.Tensor | None, ctx: RankContext) -> Any:
    import torch.distributed as dist

    shape, dtype = tuple(meta.shape), meta.dtype
    tensor = value if value is not None else torch.empty(shape, dtype=dtype, device=ctx.device)
    dist.broadcast(tensor, src=0)
    if isinstance(meta, DTensor):
        return nn.Parameter(distribute_tensor(tensor, meta.device_mesh, meta.placements))
    return tensor


def _train_loaded(built: BuiltGraph, case: GraphCase, ctx: RankContext) -> TrainView:
    after_load = {
        built.graph.source(loc): full_array(t)
        for loc, t in built.places()
        if loc in built.graph.param_locs(loc[0])
    }
    losses = _rank_steps(built, case, ctx)
    values = {loc: full_array(tensor) for loc, tensor in built.places()}
    return TrainView(_objects(built), values, losses, after_load)
