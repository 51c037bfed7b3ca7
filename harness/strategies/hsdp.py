"""Strategies for the HSDP suite: (replicate, shard) meshes, hybrid-sharding cases."""

from __future__ import annotations

import dataclasses
from functools import cache

from hypothesis import strategies as st

from harness.cases.hsdp import (
    DEFAULT_GROUPS,
    GROUP_SOURCES,
    HSDP_APIS,
    HYBRID_STRATEGIES,
    SINGLE_GROUPS,
    WRAPPINGS,
    GroupErrorCase,
    HSDPCase,
    SyncCase,
)
from harness.cases.training import ParityCase
from harness.errors import check_int, check_one_of, require
from harness.strategies._common import factorisations, mix, sampled, seeds, takes_world_size
from harness.strategies.training import DTENSOR_UNSUPPORTED, parity_cases

MESH_KINDS = ("any", "replicated_shards", "one_rank_shards")
"""``replicated_shards``: every 2-D factorisation except a one-rank shard group under a
replicate axis of several ranks; ``one_rank_shards``: exactly that, ``(world, 1)``."""


@cache
def hsdp_meshes(world_size: int, kind: str = "any") -> tuple[tuple[int, int], ...]:
    """``(replicate, shard)`` meshes of ``world_size`` ranks, size-1 axes included."""
    check_int("world_size", world_size)
    check_one_of("kind", kind, MESH_KINDS)
    shapes = [(s[0], s[1]) for s in factorisations(world_size, 2) if len(s) == 2]
    if kind == "any":
        return tuple(shapes)
    one_rank = [(r, s) for r, s in shapes if s == 1 and r > 1]
    if kind == "one_rank_shards":
        replicas = ">= 2 for a (world, 1) mesh with replicas"
        require(bool(one_rank), "world_size", world_size, replicas)
        return tuple(one_rank)
    return tuple(s for s in shapes if s not in one_rank)


def _fsdp1(api: str) -> bool:
    check_one_of("api", api, HSDP_APIS)
    return api == "fsdp1"


def hsdp_cases(
    world_size: int, *, api: str, meshes: str = "any", ties: bool = True, node: int | None = None
) -> st.SearchStrategy[HSDPCase]:
    """Hybrid sharding of a drawn training run (optimizer-suite configs) under ``api``,
    on a mesh of ``meshes`` kind; FSDP1 also draws how its groups are given and
    ``use_orig_params`` (without it there is one flat parameter per unit, so one
    parameter group). ``ties``: sometimes the first and last Linear share their weight
    (both then stay in the root's unit). ``node``: FSDP1 given no groups at all, all-hybrid
    wrapping, on the (world / node, node) mesh its default groups make of ``node`` devices
    per host (``node`` must divide ``world_size``)."""
    _fsdp1(api)
    hsdp_meshes(world_size, meshes)  # validates
    require(isinstance(ties, bool), "ties", ties, "a bool")
    if node is not None:
        require(api == "fsdp1", "api", api, "'fsdp1' with default groups (node given)")
        check_int("node", node, 1)
        require(world_size % node == 0, "node", node, f"a divisor of world_size={world_size}")
    return _hsdp_cases(world_size, api=api, meshes=meshes, ties=ties, node=node)


def _tied(training: ParityCase) -> ParityCase:
    """``training`` on (a, b, ..., a, b): the first and last Linear of equal shape."""
    a, b = training.dims[:2]
    return dataclasses.replace(training, dims=(a, b, *training.dims[1:-1], a, b))


@takes_world_size
@st.composite
def _hsdp_cases(
    draw: st.DrawFn, world_size: int, *, api: str, meshes: str, ties: bool, node: int | None
) -> HSDPCase:
    fsdp1 = _fsdp1(api)
    unsupported = frozenset() if fsdp1 else DTENSOR_UNSUPPORTED
    training = draw(parity_cases(world_size, layout="hsdp", unsupported=unsupported))
    if node is None:
        mesh = draw(sampled(hsdp_meshes(world_size, meshes)))
    else:
        mesh = (world_size // node, node)
    use_orig_params = draw(st.booleans()) if fsdp1 else True
    optim = training.optim
    if not use_orig_params:
        optim = dataclasses.replace(optim, second_group=None)
    tied = ties and draw(mix((3, st.just(False)), (1, st.just(True))))
    if tied:
        training = _tied(training)
    return HSDPCase(
        api=api,
        strategy=draw(sampled(HYBRID_STRATEGIES)),
        wrapping="hybrid" if node is not None else draw(sampled(WRAPPINGS)),
        groups=(
            DEFAULT_GROUPS
            if node is not None
            else draw(sampled(GROUP_SOURCES))
            if fsdp1
            else "device_mesh"
        ),
        use_orig_params=use_orig_params,
        training=dataclasses.replace(training, mesh_shape=mesh, optim=optim),
        tied=tied,
    )


def _mlp_dims(draw: st.DrawFn, world_size: int) -> tuple[int, ...]:
    n_layers = draw(st.integers(1, 3))
    return tuple(draw(st.integers(1, 2 * world_size + 1)) for _ in range(n_layers + 1))


@takes_world_size
@st.composite
def sync_cases(draw: st.DrawFn, world_size: int, *, meshes: str = "replicated_shards") -> SyncCase:
    return SyncCase(
        strategy=draw(sampled(HYBRID_STRATEGIES)),
        groups=draw(sampled(GROUP_SOURCES)),
        use_orig_params=draw(st.booleans()),
        mesh_shape=draw(sampled(hsdp_meshes(world_size, meshes))),
        dims=_mlp_dims(draw, world_size),
        bias=draw(st.booleans()),
        dtype=draw(sampled(("float64", "float32"))),
        seed=draw(seeds()),
    )


@takes_world_size
@st.composite
def group_error_cases(draw: st.DrawFn, world_size: int, *, single: bool) -> GroupErrorCase:
    """``single=False``: no group at all (manual wrapping); ``True``: one group, three
    groups or a 1-D mesh where a (shard, replicate) pair is needed."""
    return GroupErrorCase(
        strategy=draw(sampled(HYBRID_STRATEGIES)),
        given=draw(sampled(SINGLE_GROUPS)) if single else None,
        mesh_shape=draw(sampled(hsdp_meshes(world_size))),
        dims=_mlp_dims(draw, world_size),
    )


@takes_world_size
@st.composite
def save_load_cases(
    draw: st.DrawFn, world_size: int, *, api: str, mixed_mesh: bool = False
) -> tuple[HSDPCase, int]:
    """A hybrid training run to save after, and how many steps to train on after loading.
    No LR scheduler: its state is not part of an optimizer state dict. FSDP1 avoids
    one-rank shard groups under replicas (hsdp.fsdp1.shard_size_one), and gives a mesh to
    the hybrid units of a mixed wrapping only when ``mixed_mesh`` (then always:
    hsdp.fsdp1.save_load_mixed_mesh)."""
    fsdp1 = _fsdp1(api)
    case = draw(hsdp_cases(world_size, api=api, meshes="replicated_shards" if fsdp1 else "any"))
    optim = dataclasses.replace(case.training.optim, scheduler=None)
    case = dataclasses.replace(case, training=dataclasses.replace(case.training, optim=optim))
    if mixed_mesh:
        require(fsdp1, "mixed_mesh", mixed_mesh, f"False with api={api!r} (an FSDP1 case)")
        case = dataclasses.replace(case, wrapping="mixed", groups="device_mesh")
    elif fsdp1 and case.wrapping == "mixed" and case.groups == "device_mesh":
        case = dataclasses.replace(case, groups="process_groups")
    return case, draw(st.integers(1, 3))
