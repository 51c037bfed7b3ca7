"""Strategies for state-dict cases: a sharded training run and what is done with its state
(fully_shard options, a checkpoint loaded at another world size, resume actions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hypothesis import strategies as st

from harness.cases.state_dict import (
    MID_STEP_VIAS,
    SHARDED_LAYOUTS,
    TIED_VIAS,
    MidStepCase,
    ReshardCase,
    ResumeCase,
    StateDictCase,
    TiedAfterForwardCase,
)
from harness.cases.training import CORE_OPTIMIZERS, OPTIMIZERS, TP_LAYOUTS
from harness.errors import check_int, check_one_of, check_subset, require
from harness.strategies._common import (
    factorisations,
    reshard_factors,
    sampled,
    seeds,
    takes_world_size,
)
from harness.strategies.modules import graph_cases
from harness.strategies.training import DTENSOR_UNSUPPORTED, optim_configs, parity_cases
from specs.resume import (
    MID_STEP_POINTS,
    initialises_optimizer,
    optimizer_is_empty,
    step_after,
)


def state_dict_cases(
    world_size: int,
    *,
    layouts: Sequence[str] = SHARDED_LAYOUTS,
    steps: tuple[int, int] = (1, 2),
    names: Sequence[str] = CORE_OPTIMIZERS,
    reshard: bool = False,
    largest_dim: bool = False,
    offload: bool = False,
    pin_memory: Sequence[bool] = (False,),
    even_strided: bool = False,
) -> st.SearchStrategy[StateDictCase]:
    """A sharded MLP under one of ``layouts`` trained ``steps[0]..steps[1]`` steps by a
    stateful optimizer of ``names`` (SGD always with momentum), dims drawn around the world
    size (uneven and empty shards). ``reshard`` draws ``reshard_after_forward`` (None, True,
    False, or a factor of the shard axis), ``largest_dim`` the largest-dim placement fn
    (fsdp/hsdp), ``offload`` sets a ``CPUOffloadPolicy`` with ``pin_memory`` drawn from
    ``pin_memory`` (True needs an accelerator). ``even_strided`` draws TP layouts' hidden
    size as a multiple of shard axis × TP degree: torch 2.13 cannot set full state dicts
    into uneven ``_StridedShard`` pieces (spec state_dict.full.uneven_strided)."""
    check_subset("layouts", layouts, SHARDED_LAYOUTS, non_empty=True)
    check_subset("names", names, OPTIMIZERS, non_empty=True)
    pair = isinstance(steps, tuple) and len(steps) == 2 and 0 <= steps[0] <= steps[1]
    require(pair, "steps", steps, "a (low, high) pair with 0 <= low <= high")
    bools = bool(pin_memory) and all(isinstance(p, bool) for p in pin_memory)
    require(bools, "pin_memory", tuple(pin_memory), "a non-empty tuple of bools")
    return _state_dict_cases(
        world_size,
        layouts=tuple(layouts),
        steps=steps,
        names=tuple(names),
        reshard=reshard,
        largest_dim=largest_dim,
        offload=offload,
        pin_memory=tuple(pin_memory),
        even_strided=even_strided,
    )


@takes_world_size
@st.composite
def _state_dict_cases(
    draw: st.DrawFn,
    world_size: int,
    *,
    layouts: tuple[str, ...],
    steps: tuple[int, int],
    names: tuple[str, ...],
    reshard: bool,
    largest_dim: bool,
    offload: bool,
    pin_memory: tuple[bool, ...],
    even_strided: bool,
) -> StateDictCase:
    # TP layouts need a TP axis of 2 or more: on a (1, 1) mesh torch 2.13's backward fails
    # ("would remove or reshape sharded dimension 1"), as the optimizer suite also avoids.
    usable = tuple(n for n in layouts if n not in TP_LAYOUTS or world_size > 1) or ("fsdp",)
    layout = draw(sampled(usable))
    train = draw(parity_cases(world_size, layout=layout, unsupported=DTENSOR_UNSUPPORTED))
    if even_strided and layout in TP_LAYOUTS:
        pieces = train.mesh_shape[-1] * _shard_axis(layout, train.mesh_shape)
        dims = (train.dims[0], pieces * draw(st.integers(1, 2)), train.dims[2])
        train = replace(train, dims=dims)
    optim = draw(
        optim_configs(names=names, unsupported=DTENSOR_UNSUPPORTED, stateful=True, flags=True)
    )
    train = replace(train, optim=replace(optim, scheduler=None), steps=draw(st.integers(*steps)))
    case = StateDictCase(train, offload=offload, pin_memory=offload and draw(sampled(pin_memory)))
    if reshard:
        factors = tuple(f for f in range(1, case.shard_size + 1) if case.shard_size % f == 0)
        choice = draw(sampled((None, True, False, *factors)))
        case = replace(case, reshard_after_forward=choice)
    if largest_dim and layout not in TP_LAYOUTS:
        case = replace(case, shard_largest_dim=draw(st.booleans()))
    return case


def layout_meshes(
    world_size: int, layout: str, dims: tuple[int, ...]
) -> tuple[tuple[int, ...], ...]:
    """Meshes ``layout`` can use on ``world_size`` ranks for an MLP of ``dims``: 1-D for
    fsdp; (replicate, shard) for hsdp; (dp, tp) for fsdp_tp and (replicate, shard, tp) for
    hsdp_tp, tp dividing the hidden size of a two-layer MLP (none otherwise)."""
    check_int("world_size", world_size)
    check_one_of("layout", layout, SHARDED_LAYOUTS)
    if layout in ("fsdp", "hsdp"):
        return _meshes(world_size, layout)
    return tuple(s for s in _meshes(world_size, layout) if len(dims) == 3 and dims[1] % s[-1] == 0)


def _meshes(world_size: int, layout: str) -> tuple[tuple[int, ...], ...]:
    ndim = {"fsdp": 1, "hsdp": 2, "fsdp_tp": 2, "hsdp_tp": 3}[layout]
    return tuple(s for s in factorisations(world_size, ndim) if len(s) == ndim)


def _shard_axis(layout: str, mesh: tuple[int, ...]) -> int:
    """The size of the mesh axis fully_shard shards over (StateDictCase.shard_size)."""
    return mesh[1] if layout in ("hsdp", "hsdp_tp") else mesh[0]


def strided_meshes(world_size: int, layout: str) -> tuple[tuple[int, ...], ...]:
    """Meshes of a TP ``layout`` on ``world_size`` ranks whose shard and TP axes both have
    2 or more ranks: there FSDP shards TP pieces again (``_StridedShard``)."""
    check_one_of("layout", layout, TP_LAYOUTS)
    check_int("world_size", world_size)
    meshes = _meshes(world_size, layout)
    return tuple(m for m in meshes if m[-1] > 1 and _shard_axis(layout, m) > 1)


def uneven_strided_cases(world_size: int) -> st.SearchStrategy[StateDictCase]:
    """A TP layout on a mesh of ``strided_meshes`` with a hidden size the TP degree
    divides and shard axis × TP degree does not: FSDP's pieces of the TP pieces are
    uneven (or empty)."""
    usable = tuple(n for n in TP_LAYOUTS if strided_meshes(world_size, n))
    expected = "a size with a TP mesh whose shard and TP axes both have 2+ ranks"
    require(bool(usable), "world_size", world_size, expected)
    return _uneven_strided_cases(world_size, usable)


@st.composite
def _uneven_strided_cases(
    draw: st.DrawFn, world_size: int, layouts: tuple[str, ...]
) -> StateDictCase:
    case = draw(state_dict_cases(world_size, layouts=layouts))
    layout = case.train.layout
    mesh = draw(sampled(strided_meshes(world_size, layout)))
    shard, tp = _shard_axis(layout, mesh), mesh[-1]
    times = draw(st.integers(1, 2 * shard).filter(lambda k: k % shard != 0))
    dims = (case.train.dims[0], tp * times, case.train.dims[2])
    return replace(case, train=replace(case.train, mesh_shape=mesh, dims=dims))


@st.composite
def _moved(
    draw: st.DrawFn, case: StateDictCase, world_size: int, layouts: tuple[str, ...]
) -> StateDictCase:
    """``case`` on ``world_size`` ranks under a layout drawn from ``layouts`` (one it can
    use there), with another seed."""
    dims = case.train.dims
    usable = tuple(name for name in layouts if layout_meshes(world_size, name, dims))
    layout = draw(sampled(usable))
    mesh = draw(sampled(layout_meshes(world_size, layout, dims)))
    train = replace(case.train, layout=layout, mesh_shape=mesh, seed=(case.train.seed + 1) % 2**32)
    largest = case.shard_largest_dim and layout not in TP_LAYOUTS
    return replace(case, train=train, shard_largest_dim=largest, reshard_after_forward=None)


def reshard_cases(
    world_size: int, load_sizes: Sequence[int], *, layouts: Sequence[str] = SHARDED_LAYOUTS
) -> st.SearchStrategy[ReshardCase]:
    """A trained case saved on ``world_size`` ranks and loaded on ``m`` ranks drawn from
    ``load_sizes``, each side under its own layout from ``layouts``."""
    check_int("world_size", world_size)
    for size in load_sizes:
        check_int("load_sizes[...]", size)
    sizes = "a non-empty sequence of world sizes"
    require(len(load_sizes) > 0, "load_sizes", tuple(load_sizes), sizes)
    check_subset("layouts", layouts, SHARDED_LAYOUTS, non_empty=True)
    return _reshard_cases(world_size, tuple(load_sizes), tuple(layouts))


@st.composite
def _reshard_cases(
    draw: st.DrawFn, world_size: int, load_sizes: tuple[int, ...], layouts: tuple[str, ...]
) -> ReshardCase:
    save = draw(state_dict_cases(world_size, layouts=layouts, largest_dim=True))
    load = draw(_moved(save, draw(sampled(load_sizes)), layouts))
    return ReshardCase(save, load)


def resume_cases(
    world_size: int,
    sizes: Sequence[int],
    *,
    layouts: Sequence[str] = ("fsdp", "hsdp"),
    max_actions: int = 6,
) -> st.SearchStrategy[ResumeCase]:
    """Up to ``max_actions`` train / checkpoint / reload / resize actions starting on
    ``world_size`` ranks, resizing to world sizes of ``sizes``, each size under a layout of
    ``layouts``. A checkpoint is drawn only once the run has trained: checkpointing an
    optimizer that never stepped changes it (spec state_dict.optim.get_has_no_side_effect)."""
    check_int("world_size", world_size)
    check_int("max_actions", max_actions)
    require(len(sizes) > 0, "sizes", tuple(sizes), "a non-empty sequence of world sizes")
    for size in sizes:
        check_int("sizes[...]", size)
    check_subset("layouts", layouts, SHARDED_LAYOUTS, non_empty=True)
    return _resume_cases(world_size, tuple(sizes), tuple(layouts), max_actions)


@st.composite
def _resume_cases(
    draw: st.DrawFn,
    world_size: int,
    sizes: tuple[int, ...],
    layouts: tuple[str, ...],
    max_actions: int,
) -> ResumeCase:
    base = draw(state_dict_cases(world_size, layouts=layouts, steps=(0, 0)))
    actions: list[tuple[str, int]] = []
    for _ in range(draw(st.integers(1, max_actions))):
        trained = step_after(world_size, tuple(actions)) > 0
        kind = draw(sampled(_KINDS_AFTER_TRAINING if trained else _KINDS_BEFORE))
        arg = {"train": st.integers(1, 2), "resize": sampled(sizes)}.get(kind, st.just(0))
        actions.append((kind, draw(arg)))
    mine = (world_size, base.train.layout, base.train.mesh_shape)
    others = sorted({n for kind, n in actions if kind == "resize"} - {world_size})
    layouts_of = [mine]
    for size in others:
        moved = draw(_moved(base, size, layouts)).train
        layouts_of.append((size, moved.layout, moved.mesh_shape))
    return ResumeCase(base, world_size, tuple(actions), tuple(layouts_of))


# train first: hypothesis shrinks a sampled_from towards its first element.
_KINDS_BEFORE = ("train", "reload", "resize")
_KINDS_AFTER_TRAINING = ("train", "checkpoint", "reload", "resize")


# --- state dicts taken inside a step -------------------------------------------------------


def mid_step_cases(
    world_size: int, *, first_step_dcp: bool = False
) -> st.SearchStrategy[MidStepCase]:
    """A module graph (shared modules, tied parameters and buffers: ``graph_cases``) under
    ``fully_shard`` on a 1-D or a (replicate, shard) mesh of ``world_size`` ranks
    (``reshard_after_forward`` None, True, False or a factor of the shard axis), trained 2-3
    steps (1-3 for ``first_step_dcp``) by SGD (momentum), Adam or AdamW (weight decay or
    not), ``zero_grad`` setting
    gradients to None or to zeros; its state dict taken at a point of a step
    (``specs.resume.MID_STEP_POINTS``), in memory or through DCP.

    Left out, each the deviation of a spec of its own: a point of step 0 before the
    backward, where taking the state dict steps the empty optimizer once with lr 0
    (``specs.resume.initialises_optimizer``; state_dict.optim.get_has_no_side_effect), and
    DCP while the optimizer is empty (state_dict.resume.mid_step_empty_optimizer_dcp).
    Half the cases also take a state dict, and drop it, at every point of every step that
    may be drawn (``MidStepCase.probe_points``).
    ``first_step_dcp``: only that case, DCP between the first backward and first step()."""
    check_int("world_size", world_size)
    require(isinstance(first_step_dcp, bool), "first_step_dcp", first_step_dcp, "a bool")
    return _mid_step_cases(world_size, first_step_dcp=first_step_dcp)


@takes_world_size
@st.composite
def _mid_step_cases(draw: st.DrawFn, world_size: int, *, first_step_dcp: bool) -> MidStepCase:
    # The graph's momentum is not used: the case's optimizer says its own options.
    graph = replace(draw(graph_cases(world_size, train=True)), momentum=0.0)
    mesh = draw(sampled(factorisations(world_size, 2)))  # 1-D, then (replicate, shard)
    factors = reshard_factors(mesh[-1])
    reshard = draw(sampled((None, True, False, *factors)))
    # SGD without momentum as an optimizer of its own (a quarter of the draws, not an
    # eighth): it is the one a state dict meets empty at every step
    optimizers = (("SGD", 0.0), ("SGD", 0.9), ("Adam", 0.9), ("AdamW", 0.9))
    optimizer, momentum = draw(sampled(optimizers))
    weight_decay = draw(sampled((0.0, 0.01)))
    set_to_none = draw(st.booleans())
    points: tuple[str, ...] = ()  # first_step_dcp: its one state dict, nothing else
    if first_step_dcp:
        momentum = 0.9
        at_step, point, via = 0, "after_backward", "dcp"
    else:
        # two steps or three: every point has a step to take the state dict at and a step
        # after it; a point of step 0 before its backward is drawn at a later step. SGD
        # without momentum never holds state: its empty-optimizer initialisation steps
        # with lr 0 and changes nothing, so every point and both ways are drawn for it.
        graph = replace(graph, steps=draw(st.integers(2, 3)))
        points = MID_STEP_POINTS
        if reshard not in (None, True) and graph.graph.ties:
            # Tied parameters left unsharded (or on a smaller group) after a forward: torch
            # 2.13 and 2.15 put a freed tensor (reshard_after_forward False; reading it is a
            # SIGSEGV) or a DTensor of the post-forward mesh (an int) in the state dict
            # under one of their names: spec state_dict.sharded.tied_after_forward.
            points = tuple(p for p in points if p != "after_forward")
        point = draw(sampled(points))
        stateless = momentum == 0.0
        first = 0 if stateless else int(initialises_optimizer(0, point))
        at_step = draw(st.integers(first, graph.steps - 1))
        empty = optimizer_is_empty(at_step, point) and not stateless
        via = draw(sampled(("memory",) if empty else MID_STEP_VIAS))
    return MidStepCase(
        graph,
        optimizer,
        weight_decay,
        mesh,
        reshard,
        set_to_none,
        at_step,
        point,
        via,
        tensor_lr=draw(st.booleans()),
        momentum=momentum,
        probe_points=points if draw(st.booleans()) else (),
    )


@takes_world_size
@st.composite
def tied_after_forward_cases(draw: st.DrawFn, world_size: int) -> TiedAfterForwardCase:
    """A tied pair of Linears in one ``fully_shard`` group (both orders) on a 1-D or
    (replicate, shard) mesh of ``world_size`` ranks, left unsharded after the forward
    (``reshard_after_forward=False``) or on a smaller group (a factor of the shard axis)."""
    mesh = draw(sampled(factorisations(world_size, 2)))
    factors = reshard_factors(mesh[-1])
    return TiedAfterForwardCase(
        mesh_shape=mesh,
        width=draw(st.integers(1, 2 * world_size + 1)),
        reshard_after_forward=draw(sampled((False, *factors))),
        via=draw(sampled(TIED_VIAS)),
        seed=draw(seeds()),
    )
