"""Strategies for module graphs and their ``fully_shard`` plans, and the FSDP init cases.

A graph is drawn as a tree in breadth-first order (children always get larger indices than
their parent, so it is acyclic), where a child may instead be an existing node with a larger
index: one module reachable on several paths (``Sequential(mlp, mlp)``, an mlp's ``in_proj``
shared with another mlp). Everything shrinks towards a single linear, no sharing, no ties.

Plans (``plan=``):

- ``managed``: ``fully_shard`` calls on modules that own their subtree (no module below them
  is reachable on another path), possibly several modules per call, optional ``replicate``
  calls, optional root call; ties anywhere. What the managed-module properties need.
- ``rooted``: such ``fully_shard`` calls ending with the root; ties only inside one call's
  modules. A plan torch accepts and trains.
- ``multi_root``: a rooted plan whose root call is replaced by one ``fully_shard`` of
  several of the root's children (torch must refuse it as a lazy-init root).
- ``tied_across``: a rooted plan with a parameter tied across two calls (torch must refuse).
- ``shared_across``: a rooted plan where a module under a wrapped module is also reachable
  from outside it, so two calls manage its parameters (torch must refuse).
"""

from __future__ import annotations

from functools import cache

from hypothesis import assume
from hypothesis import strategies as st

from harness.cases.modules import (
    ContainerCase,
    GraphCase,
    MLPMeshCase,
    ShardDimCase,
    TorchInitCase,
)
from harness.errors import check_int, check_one_of, require
from harness.strategies._common import factorisations, mix, sampled, seeds, takes_world_size
from specs.chunking import num_chunks
from specs.fsdp_layouts import strided_shard_agrees
from specs.modules import Loc, ModuleGraph, Node, Tie, Wrap, simulate

PLANS = ("managed", "rooted", "multi_root", "tied_across", "shared_across")
MESH_KINDS = ("tp", "hsdp")
_CHILD_KINDS = ("linear", "mlp", "seq", "stack")
_REUSE = mix((3, st.just(False)), (1, st.just(True)))
# A valid Shard dim of a 1-D or 2-D parameter (negative ones too), sometimes one past the end.
_SHARD_DIMS = {n: mix((6, st.integers(-n, n - 1)), (1, st.just(n))) for n in (1, 2)}


@cache
def _full_pieces(parts: int, largest: int) -> tuple[int, ...]:
    """Sizes up to ``largest`` (at least ``parts``) that ``torch.chunk`` splits into
    ``parts`` non-empty pieces."""
    sizes = range(parts, max(parts, largest) + 1)
    return tuple(n for n in sizes if num_chunks(n, parts) == parts)


@cache
def _meshes_2d(world_size: int) -> tuple[tuple[int, ...], ...]:
    return tuple(shape for shape in factorisations(world_size, 2) if len(shape) == 2)


def module_graphs(
    *, plan: str = "rooted", max_nodes: int = 8, ties: bool = True
) -> st.SearchStrategy[ModuleGraph]:
    """Module graphs with a ``fully_shard`` plan of kind ``plan`` (see the module doc);
    ``ties=False``: no tied parameters or buffers (beyond the ties ``plan`` needs)."""
    check_one_of("plan", plan, PLANS)
    check_int("max_nodes", max_nodes, 3)
    require(isinstance(ties, bool), "ties", ties, "a bool")
    return _module_graphs(plan, max_nodes, ties)


@cache
@st.composite
def _module_graphs(draw: st.DrawFn, plan: str, max_nodes: int, ties: bool) -> ModuleGraph:
    seq_root = plan in ("multi_root", "tied_across", "shared_across")
    nodes = _draw_nodes(draw, max_nodes, ("seq",) if seq_root else _CHILD_KINDS)
    forced: tuple[int, int] | None = None
    if plan == "shared_across":
        nodes, forced = _share_outside(draw, nodes)
    bare = ModuleGraph(nodes)
    wraps = _draw_wraps(draw, bare, plan, forced)
    if plan == "multi_root":
        wraps = _multi_root(draw, bare, wraps[:-1])
    planned = ModuleGraph(nodes, (), wraps)
    drawn = _draw_ties(draw, planned, plan) if ties or plan == "tied_across" else ()
    return ModuleGraph(nodes, drawn, wraps)


def _multi_root(draw: st.DrawFn, graph: ModuleGraph, wraps: tuple[Wrap, ...]) -> tuple[Wrap, ...]:
    """``wraps`` then one ``fully_shard`` of two or more of the root's children that are
    neither wrapped nor below a wrapped module, nor related to each other."""
    wrapped = {n for w in wraps for n in w.nodes}
    below = set().union(*(graph.below(n) for n in wrapped))
    free = [c for c in dict.fromkeys(graph.nodes[0].children) if c not in wrapped | below]
    unrelated = [c for c in free if not any(c in graph.below(o) for o in free)]
    assume(len(unrelated) >= 2)
    count = draw(st.integers(2, len(unrelated)))
    return (*wraps, Wrap("fully_shard", tuple(unrelated[:count])))


def _draw_nodes(draw: st.DrawFn, max_nodes: int, root_kinds: tuple[str, ...]) -> tuple[Node, ...]:
    kinds: list[str] = [draw(sampled(root_kinds))]
    kids: list[list[int]] = [[]]
    bias: list[bool] = [True]

    def child(parent: int, allowed: tuple[str, ...]) -> int:
        reusable = [j for j in range(parent + 1, len(kinds)) if kinds[j] in allowed]
        if reusable and draw(_REUSE):
            return int(draw(sampled(tuple(reusable))))
        room = len(kinds) < max_nodes
        kind = draw(sampled(allowed)) if room and len(allowed) > 1 else allowed[0]
        kinds.append(kind)
        kids.append([])
        bias.append(kind != "linear" or draw(st.booleans()))
        return len(kinds) - 1

    index = 0
    while index < len(kinds):
        kind = kinds[index]
        if kind == "mlp":
            kids[index] = [child(index, ("linear",)) for _ in range(2)]
        elif kind == "stack":
            kids[index] = [child(index, ("list",))]
        elif kind in ("seq", "list"):
            count = draw(st.integers(1, 3)) if len(kinds) < max_nodes else 1
            kids[index] = [child(index, _CHILD_KINDS) for _ in range(count)]
        index += 1
    return tuple(Node(k, tuple(c), b) for k, c, b in zip(kinds, kids, bias, strict=True))


def _share_outside(
    draw: st.DrawFn, nodes: tuple[Node, ...]
) -> tuple[tuple[Node, ...], tuple[int, int]]:
    """Make a linear below some module also a child of the root (a ``seq``): returns the new
    nodes, that module (the plan wraps it) and the linear (the plan leaves it unwrapped)."""
    graph = ModuleGraph(nodes)
    owners = [
        n
        for n in range(1, len(nodes))
        if nodes[n].kind != "list" and _linears(graph, graph.below(n))
    ]
    assume(owners)
    owner = draw(sampled(tuple(owners)))
    linear = draw(sampled(_linears(graph, graph.below(owner))))
    root = nodes[0]
    at = draw(st.integers(0, len(root.children)))
    children = (*root.children[:at], linear, *root.children[at:])
    return (Node(root.kind, children), *nodes[1:]), (owner, linear)


def _linears(graph: ModuleGraph, among: frozenset[int]) -> tuple[int, ...]:
    return tuple(sorted(n for n in among if graph.nodes[n].kind == "linear"))


def _parents(graph: ModuleGraph) -> dict[int, set[int]]:
    parents: dict[int, set[int]] = {n: set() for n in range(len(graph.nodes))}
    for node, spec in enumerate(graph.nodes):
        for kid in spec.children:
            parents[kid].add(node)
    return parents


def owns_subtree(graph: ModuleGraph, roots: tuple[int, ...]) -> bool:
    """Every module below ``roots`` is reachable only through them (a sound wrap)."""
    parents = _parents(graph)
    inside = set(roots).union(*(graph.below(r) for r in roots))
    return all(parents[n] <= inside for n in inside - set(roots))


def _draw_wraps(
    draw: st.DrawFn, graph: ModuleGraph, plan: str, forced: tuple[int, int] | None
) -> tuple[Wrap, ...]:
    """``forced``: (a module to wrap although it does not own its subtree, a linear below it
    that must stay unwrapped)."""
    callable_nodes = [n for n in range(1, len(graph.nodes)) if graph.nodes[n].kind != "list"]
    avoid = forced or ()
    sound = tuple(n for n in callable_nodes if owns_subtree(graph, (n,)) and n not in avoid)
    least = 1 if plan == "tied_across" else 0
    chosen: set[int] = set()
    if sound:
        chosen = set(draw(st.lists(sampled(sound), min_size=least, max_size=4, unique=True)))
    if forced is not None:
        chosen.add(forced[0])
    replicas: set[int] = set()
    others = tuple(n for n in callable_nodes if n not in chosen)
    if plan == "managed" and others:
        replicas = set(draw(st.lists(sampled(others), unique=True, max_size=2)))
    wraps: list[Wrap] = []
    for node in sorted(chosen | replicas, reverse=True):  # descendants have larger indices
        last = wraps[-1] if wraps else None
        if node in replicas:
            wraps.append(Wrap("replicate", (node,)))
        elif last and last.api == "fully_shard" and _can_join(graph, last.nodes, node, forced):
            if draw(_REUSE):
                wraps[-1] = Wrap("fully_shard", (*last.nodes, node))
            else:
                wraps.append(Wrap("fully_shard", (node,)))
        else:
            wraps.append(Wrap("fully_shard", (node,)))
    if plan != "managed" or draw(st.booleans()):
        wraps.append(Wrap("fully_shard", (0,)))
    return tuple(wraps)


def _can_join(
    graph: ModuleGraph, group: tuple[int, ...], node: int, forced: tuple[int, int] | None
) -> bool:
    related = any(node in graph.below(g) or g in graph.below(node) for g in group)
    alone = forced is not None and forced[0] in (*group, node)
    return not related and not alone and owns_subtree(graph, (*group, node))


def _tie_places(graph: ModuleGraph) -> list[Loc]:
    return [
        (n, name)
        for n, spec in enumerate(graph.nodes)
        for name in spec.param_names() + spec.buffer_names()
    ]


def _group_of(graph: ModuleGraph) -> dict[int, int]:
    return {node: g.wrap for g in simulate(graph) for node in g.modules}


def _draw_ties(draw: st.DrawFn, graph: ModuleGraph, plan: str) -> tuple[Tie, ...]:
    group = _group_of(graph)
    ties: list[Tie] = []
    wanted = draw(st.integers(1 if plan == "tied_across" else 0, 2))
    for index in range(wanted):
        taken = {(t.node, t.name) for t in ties} | {(t.source, t.name) for t in ties}
        free = [p for p in _tie_places(graph) if p not in taken]
        pairs = [
            (dst, src)
            for dst in free
            for src in free
            if dst[1] == src[1]
            and dst[0] != src[0]
            and _tie_allowed(plan, index == 0, dst, src, group)
        ]
        if plan == "tied_across" and index == 0:
            assume(pairs)
        if not pairs:
            break
        (node, name), (source, _) = draw(st.sampled_from(pairs))
        ties.append(Tie(node, name, source))
    return tuple(ties)


def _tie_allowed(plan: str, first: bool, dst: Loc, src: Loc, group: dict[int, int]) -> bool:
    if plan == "tied_across" and first:
        return dst[1] != "buffer" and group.get(dst[0]) != group.get(src[0])
    if plan == "managed" or dst[1] == "buffer":
        return True
    return group.get(dst[0]) == group.get(src[0])


# --- cases ---------------------------------------------------------------------------------


@takes_world_size
@st.composite
def graph_cases(
    draw: st.DrawFn,
    world_size: int,
    *,
    plan: str = "rooted",
    meta: bool = False,
    train: bool = False,
    ties: bool = True,
) -> GraphCase:
    """A graph case whose widths are drawn around ``world_size`` (uneven and empty shards);
    ``train`` draws a few SGD steps with or without momentum."""
    graph = draw(module_graphs(plan=plan, ties=ties))
    width = draw(st.integers(1, 2 * world_size + 1))
    if not train:
        return GraphCase(graph, width, draw(seeds()), meta=meta)
    return GraphCase(
        graph,
        width,
        draw(seeds()),
        meta=meta,
        steps=draw(st.integers(1, 3)),
        batch_per_rank=draw(st.integers(1, 2)),
        lr=draw(sampled((0.1, 0.01))),
        momentum=draw(sampled((0.0, 0.9))),
    )


def mesh_mlp_cases(
    world_size: int, *, kind: str = "tp", meta: bool = False
) -> st.SearchStrategy[MLPMeshCase]:
    """An MLP on a 2-D mesh over ``world_size`` ranks (size-1 axes included): FSDP over TP
    (``kind='tp'``, optionally sharding each weight on the dim TP leaves, then with widths
    the dp axis divides, as FSDP requires off dim 0) or HSDP (``kind='hsdp'``).

    With TP, the hidden size leaves no TP piece empty: FSDP mis-shapes a zero-size local
    tensor, which ``fsdp_init.params.zero_size_dim`` checks on its own. On meta, values
    are written with ``distribute_tensor``, so only where DTensor's ``_StridedShard`` means
    FSDP's layout (``fsdp_init.tp.distribute_tensor_agrees`` checks the others)."""
    check_one_of("kind", kind, MESH_KINDS)
    return _mesh_mlp_cases(world_size, kind=kind, meta=meta)


@takes_world_size
@st.composite
def _mesh_mlp_cases(draw: st.DrawFn, world_size: int, *, kind: str, meta: bool) -> MLPMeshCase:
    dp, tp = draw(sampled(_meshes_2d(world_size)))
    other_dim = kind == "tp" and draw(st.booleans())
    width = draw(st.integers(1, 2 * max(dp, tp) + 1)) * (dp if other_dim else 1)
    hidden = draw(
        sampled(_full_pieces(tp, 2 * max(dp, tp) + 1))
        if kind == "tp"
        else st.integers(1, 2 * max(dp, tp) + 1)
    )
    return MLPMeshCase(
        mesh_shape=(dp, tp),
        width=width,
        hidden=hidden,
        bias=draw(st.booleans()),
        seed=draw(seeds()),
        nested=draw(st.booleans()),
        meta=meta and strided_shard_agrees(hidden, dp, tp) and draw(st.booleans()),
        other_dim=other_dim,
        batch_per_dp_rank=draw(st.integers(1, 2)),
    )


@takes_world_size
@st.composite
def shard_dim_cases(draw: st.DrawFn, world_size: int) -> ShardDimCase:
    """A Linear stack and a ``Shard`` dim per parameter: mostly valid dims (negative ones
    included), sometimes one past the last dim (torch must refuse it)."""
    dims = tuple(draw(st.integers(1, 2 * world_size + 1)) for _ in range(draw(st.integers(2, 3))))
    ndims = [n for _ in dims[1:] for n in (2, 1)]  # weight, bias of each Linear
    shard_dims = tuple(draw(_SHARD_DIMS[n]) for n in ndims)
    return ShardDimCase(dims, shard_dims, draw(seeds()))


@takes_world_size
@st.composite
def zero_size_shapes(draw: st.DrawFn, world_size: int) -> tuple[int, ...]:
    """Parameter shapes of 2 or 3 dims whose dim 0 is drawn around ``world_size`` and one of
    the other dims is 0 (``nn.Linear(0, n).weight`` is ``(n, 0)``)."""
    rest = [draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 2)))]
    rest[draw(st.integers(0, len(rest) - 1))] = 0
    return (draw(st.integers(1, 2 * world_size + 1)), *rest)


@cache
def _disagreements(world_size: int) -> tuple[tuple[int, int, int], ...]:
    """(dp, tp, hidden) where DTensor's ``_StridedShard`` and FSDP's layout differ."""
    return tuple(
        (dp, tp, n)
        for dp, tp in _meshes_2d(world_size)
        if dp > 1 and tp > 1
        for n in _full_pieces(tp, 3 * dp * tp)
        if not strided_shard_agrees(n, dp, tp)
    )


def strided_disagreement_world_sizes(largest: int = 8) -> tuple[int, ...]:
    """The world sizes up to ``largest`` that ``strided_disagreement_cases`` serves."""
    return tuple(ws for ws in range(1, largest + 1) if _disagreements(ws))


def strided_disagreement_cases(world_size: int) -> st.SearchStrategy[MLPMeshCase]:
    """FSDP-over-TP MLPs whose hidden size DTensor's ``_StridedShard`` lays out differently
    from FSDP (no TP piece empty); ``world_size`` must have such a mesh (6, 8, 9, 10, ...:
    both axes >= 2 and dp >= 3, see ``strided_disagreement_world_sizes``)."""
    check_int("world_size", world_size)
    differ = "a size with a (dp, tp, hidden) where _StridedShard and FSDP differ (6, 8, 9, ...)"
    require(bool(_disagreements(world_size)), "world_size", world_size, differ)
    return _strided_disagreement_cases(world_size)


@takes_world_size
@st.composite
def _strided_disagreement_cases(draw: st.DrawFn, world_size: int) -> MLPMeshCase:
    found = _disagreements(world_size)
    dp, tp, hidden = draw(sampled(found))
    return MLPMeshCase(
        mesh_shape=(dp, tp),
        width=draw(st.integers(1, 2 * max(dp, tp) + 1)),
        hidden=hidden,
        bias=draw(st.booleans()),
        seed=draw(seeds()),
        nested=draw(st.booleans()),
    )


def torch_init_cases(
    world_size: int, *, default_mesh: bool = False
) -> st.SearchStrategy[TorchInitCase]:
    """A Linear stack to build on meta and initialise with torch's own ``reset_parameters``
    on a 1-D or (replicate, shard) mesh, widths around ``world_size`` (uneven and empty
    shards); ``default_mesh=True``: 1-D, ``fully_shard`` given no mesh."""
    require(isinstance(default_mesh, bool), "default_mesh", default_mesh, "a bool")
    return _torch_init_cases(world_size, default_mesh=default_mesh)


@takes_world_size
@st.composite
def _torch_init_cases(draw: st.DrawFn, world_size: int, *, default_mesh: bool) -> TorchInitCase:
    meshes = ((world_size,),) if default_mesh else ((world_size,), *_meshes_2d(world_size))
    layers = draw(st.integers(1, 3))
    return TorchInitCase(
        dims=tuple(draw(st.integers(1, 2 * world_size + 1)) for _ in range(layers + 1)),
        bias=draw(st.booleans()),
        dtype=draw(sampled(("float64", "float32"))),
        mesh_shape=draw(sampled(meshes)),
        default_mesh=default_mesh,
        seed=draw(seeds()),
        steps=draw(st.integers(1, 3)),
        lr=draw(sampled((0.01, 0.1))),
        batch_per_rank=draw(st.integers(1, 2)),
    )


@takes_world_size
@st.composite
def container_cases(draw: st.DrawFn, world_size: int) -> ContainerCase:
    """A ModuleList or ModuleDict of 1-3 Linears, width around ``world_size``."""
    return ContainerCase(
        kind=draw(sampled(("list", "dict"))),
        layers=draw(st.integers(1, 3)),
        width=draw(st.integers(1, 2 * world_size + 1)),
        seed=draw(seeds()),
    )
