"""Reference model of what ``fully_shard`` manages in a module graph (no torch).

A ``ModuleGraph`` describes a small module tree or DAG: node 0 is the root, every node is a
``linear`` (weight, optional bias), an ``mlp`` (children ``in_proj`` and ``out_proj``, both
linear nodes, and a buffer), a ``seq`` (``nn.Sequential``), a ``stack`` (a module whose only
child ``layers`` is a ``list`` node it runs in order) or a ``list`` (``nn.ModuleList``). A node
listed as the child of several parents, or twice by one parent, is one module reachable on
several paths. ``ties`` assign one node's parameter or buffer into another node (after
``b.weight = a.weight`` both names hold one Parameter); ``wraps`` are the ``fully_shard`` /
``replicate`` calls, applied in order, children before parents.

The model answers what torch's FSDP2 does with such a graph, from the graph alone:

- ``simulate``: for every ``fully_shard`` call, the modules it manages (a DFS from its roots
  that neither enters a module with its own ``fully_shard`` state nor a ``replicate``d one,
  visiting a shared module once), the parameters and buffers they hold (each object once),
  and each parameter's ``ParamModuleInfo`` (first ``(module, name)`` in a traversal that keeps
  duplicates, the others as shared). A call replaces a parameter by its sharded version at
  exactly those places, so a place outside its roots keeps the object it held.
- ``lazy_init``: the order of ``all_states`` (the root's ``named_modules`` order), the module
  FQN of each group and the FQN of each managed parameter (the first path under which
  ``named_parameters`` yields the group's object), and the first parameter two groups manage.

Parameters are named by their canonical place ``(node, name)``: the place that created them
(a tie's source). Everything is plain tuples, so reprs stay readable in counterexamples.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeAlias

from harness.errors import check_one_of, fail, require

KINDS = ("linear", "mlp", "seq", "stack", "list")
CALLABLE_KINDS = ("linear", "mlp", "seq", "stack")
APIS = ("fully_shard", "replicate")
Loc: TypeAlias = tuple[int, str]
"""A place in the graph: ``(node, attribute name)``."""
Obj: TypeAlias = tuple[Loc, int]
"""One tensor object: its canonical place and the wrap that sharded it (-1: the original)."""

DUPLICATE_ERROR = (
    "Parameter '{fqn}' is shared with a parameter already managed by another FSDP group. "
    "For shared/tied parameters, use fully_shard([module_a, module_b]) to place them in "
    "the same FSDP group."
)
DOUBLE_INIT_ERROR = (
    "FSDP state has already been lazily initialized for {fqn}\n"
    "FSDP requires running forward through the root module first"
)
META_ERROR = (
    "FSDP parameters should be materialized from meta device before training, "
    "but the following were still on meta device: {fqns}"
)


@dataclass(frozen=True)
class Node:
    kind: str
    children: tuple[int, ...] = ()
    bias: bool = True
    """Linear nodes only: whether the layer has a bias."""

    def __repr__(self) -> str:
        bias = "" if self.bias or self.kind != "linear" else ", bias=False"
        kids = f", {self.children!r}" if self.children else ""
        return f"Node({self.kind!r}{kids}{bias})"

    def child_names(self) -> tuple[str, ...]:
        if self.kind == "mlp":
            return ("in_proj", "out_proj")
        if self.kind == "stack":
            return ("layers",)
        return tuple(str(i) for i in range(len(self.children)))

    def param_names(self) -> tuple[str, ...]:
        if self.kind != "linear":
            return ()
        return ("weight", "bias") if self.bias else ("weight",)

    def buffer_names(self) -> tuple[str, ...]:
        return ("buffer",) if self.kind == "mlp" else ()


@dataclass(frozen=True)
class Tie:
    """``node.name = source.name`` after construction (a parameter or the mlp buffer)."""

    node: int
    name: str
    source: int


@dataclass(frozen=True)
class Wrap:
    """``fully_shard(nodes)`` (a list when several) or ``replicate(node)``."""

    api: str
    nodes: tuple[int, ...]


@dataclass(frozen=True)
class ModuleGraph:
    nodes: tuple[Node, ...]
    ties: tuple[Tie, ...] = ()
    wraps: tuple[Wrap, ...] = ()

    def __post_init__(self) -> None:
        _check_nodes(self.nodes)
        _check_ties(self)
        _check_wraps(self)

    def children(self, node: int) -> tuple[tuple[str, int], ...]:
        n = self.nodes[node]
        return tuple(zip(n.child_names(), n.children, strict=True))

    def below(self, node: int) -> frozenset[int]:
        """Every node reachable from ``node``, itself excluded."""
        return _descendants(self.nodes)[node]

    def source(self, loc: Loc) -> Loc:
        """The canonical place of the tensor at ``loc`` (ties followed)."""
        for tie in self.ties:
            if (tie.node, tie.name) == loc:
                return (tie.source, tie.name)
        return loc

    def param_locs(self, node: int) -> tuple[Loc, ...]:
        return tuple((node, name) for name in self.nodes[node].param_names())

    def buffer_locs(self, node: int) -> tuple[Loc, ...]:
        return tuple((node, name) for name in self.nodes[node].buffer_names())

    def wrapped(self, api: str = "fully_shard") -> dict[int, int]:
        """Each node wrapped with ``api``, mapped to the index of its wrap."""
        return {n: i for i, w in enumerate(self.wraps) if w.api == api for n in w.nodes}

    def describe(self) -> str:
        """One line: the nodes, ties and wraps, e.g. ``0:seq(1,1) 1:linear | fully_shard(0)``."""
        nodes = " ".join(
            f"{i}:{n.kind}{'' if n.bias else '-nobias'}"
            + (f"({','.join(map(str, n.children))})" if n.children else "")
            for i, n in enumerate(self.nodes)
        )
        ties = "".join(f" {t.node}.{t.name}={t.source}.{t.name}" for t in self.ties)
        wraps = " ".join(f"{w.api}{w.nodes}" for w in self.wraps)
        return f"{nodes}{' ties:' + ties if ties else ''} | {wraps or 'no wraps'}"


def _check_nodes(nodes: tuple[Node, ...]) -> None:
    require(bool(nodes), "nodes", nodes, "a non-empty tuple (the root at least)")
    for i, node in enumerate(nodes):
        check_one_of(f"nodes[{i}].kind", node.kind, KINDS)
        field, children = f"nodes[{i}].children", node.children
        indices = all(isinstance(c, int) and i < c < len(nodes) for c in children)
        require(indices, field, children, f"indices in ({i}, {len(nodes)})")
        kinds = tuple(nodes[c].kind for c in children)
        wanted = {"linear": (), "mlp": ("linear", "linear"), "stack": ("list",)}.get(node.kind)
        if wanted is not None and kinds != wanted:
            fail(field, children, f"of kinds {wanted} in a {node.kind}, not {kinds}")
        if wanted is None and not set(kinds) <= set(CALLABLE_KINDS):
            fail(field, children, f"callable in a {node.kind}, not {kinds}")
    parents = {c for node in nodes for c in node.children}
    orphans = [i for i in range(1, len(nodes)) if i not in parents]
    rooted = not orphans and nodes[0].kind != "list"
    require(rooted, "nodes", nodes, "a graph where every node but a callable root has a parent")


@functools.lru_cache(maxsize=1024)
def _descendants(nodes: tuple[Node, ...]) -> tuple[frozenset[int], ...]:
    below: list[frozenset[int]] = [frozenset()] * len(nodes)
    for i in reversed(range(len(nodes))):  # children have larger indices
        below[i] = frozenset(c for kid in nodes[i].children for c in (kid, *below[kid]))
    return tuple(below)


def _check_ties(graph: ModuleGraph) -> None:
    dests = [(t.node, t.name) for t in graph.ties]
    for tie in graph.ties:
        for end in (tie.node, tie.source):
            if not 0 <= end < len(graph.nodes):
                fail("tie", tie, f"between nodes of the graph, not node {end}")
            names = graph.nodes[end].param_names() + graph.nodes[end].buffer_names()
            if tie.name not in names:
                fail("tie", tie, f"of one of node {end}'s {names}")
        untied_source = tie.node != tie.source and (tie.source, tie.name) not in dests
        require(untied_source, "tie", tie, "from a node that is not itself tied")
    require(len(set(dests)) == len(dests), "ties", graph.ties, "ties of distinct places")


def _check_wraps(graph: ModuleGraph) -> None:
    seen: set[int] = set()
    for i, wrap in enumerate(graph.wraps):
        name, nodes = f"wraps[{i}]", wrap.nodes
        check_one_of(f"{name}.api", wrap.api, APIS)
        distinct = bool(nodes) and len(set(nodes)) == len(nodes)
        require(distinct, name, wrap, "a call on distinct nodes, at least one")
        one = wrap.api != "replicate" or len(nodes) == 1
        require(one, name, wrap, "a replicate call on one module")
        n_nodes = len(graph.nodes)
        callable_ = all(0 <= n < n_nodes and graph.nodes[n].kind != "list" for n in nodes)
        require(callable_, name, wrap, "a call on callable nodes of the graph")
        require(not seen & set(nodes), name, wrap, "a call on modules not wrapped before")
        nested = any(a in graph.below(b) for a in nodes for b in nodes)
        require(not nested, name, wrap, "a call on modules none of which is another's ancestor")
        seen |= set(nodes)
    _check_wrap_order(graph)


def _check_wrap_order(graph: ModuleGraph) -> None:
    """Children before parents: no wrap may name a descendant of a module wrapped earlier."""
    for i, wrap in enumerate(graph.wraps):
        for earlier in graph.wraps[:i]:
            if any(n in graph.below(m) for m in earlier.nodes for n in wrap.nodes):
                order = f"children first ({wrap!r} comes after its ancestor {earlier!r})"
                fail("wraps", graph.wraps, order)


# --- traversals in torch's order -----------------------------------------------------------


def named_modules(
    graph: ModuleGraph, root: int = 0, *, remove_duplicate: bool = True
) -> list[tuple[str, int]]:
    """``root.named_modules()``: pre-order, children in registration order; with
    ``remove_duplicate`` a module reachable on several paths is yielded once, at its first."""
    out: list[tuple[str, int]] = []
    seen: set[int] = set()

    def visit(node: int, path: str) -> None:
        if remove_duplicate:
            if node in seen:
                return
            seen.add(node)
        out.append((path, node))
        for name, child in graph.children(node):
            visit(child, f"{path}.{name}" if path else name)

    visit(root, "")
    return out


Holder: TypeAlias = dict[Loc, int]
"""Which version of its tensor each parameter place holds (absent: the original, -1)."""


def obj_at(graph: ModuleGraph, loc: Loc, holder: Holder) -> Obj:
    return (graph.source(loc), holder.get(loc, -1))


def named_parameters(graph: ModuleGraph, holder: Holder, root: int = 0) -> list[tuple[str, Obj]]:
    """``root.named_parameters()``: every object once, under its first path."""
    out: list[tuple[str, Obj]] = []
    seen: set[Obj] = set()
    for path, node in named_modules(graph, root):
        for loc in graph.param_locs(node):
            obj = obj_at(graph, loc, holder)
            if obj not in seen:
                seen.add(obj)
                out.append((f"{path}.{loc[1]}" if path else loc[1], obj))
    return out


# --- what each fully_shard call manages ------------------------------------------------------


@dataclass(frozen=True)
class ParamInfo:
    """``ParamModuleInfo``: the first place holding a parameter, and the other places."""

    module: int
    name: str
    shared: tuple[Loc, ...] = ()


@dataclass(frozen=True)
class Group:
    """What one ``fully_shard`` call (``graph.wraps[wrap]``) manages, in torch's order."""

    wrap: int
    roots: tuple[int, ...]
    modules: tuple[int, ...]
    params: tuple[Loc, ...]
    """Canonical places of the managed parameters, one per object."""
    buffers: tuple[Loc, ...]
    infos: tuple[ParamInfo, ...]
    resharded: tuple[Loc, ...]
    """Managed parameters an earlier call already sharded (reached through a shared module)."""


def managed_modules(
    graph: ModuleGraph, roots: tuple[int, ...], sharded: set[int], replicated: set[int]
) -> tuple[int, ...]:
    """``_get_managed_modules(roots)``: post-order DFS that skips replicated modules and
    modules with their own ``fully_shard`` state (other than the roots), each module once."""
    out: list[int] = []
    visited: set[int] = set()

    def dfs(node: int) -> None:
        if node in replicated or (node not in roots and node in sharded):
            return
        visited.add(node)
        for _, child in graph.children(node):
            if child not in visited:
                dfs(child)
        out.append(node)

    for root in roots:
        dfs(root)
    return tuple(out)


def _states(
    graph: ModuleGraph, modules: tuple[int, ...], holder: Holder
) -> tuple[list[Obj], list[Loc]]:
    params: list[Obj] = []
    buffers: list[Loc] = []
    for node in modules:
        for loc in graph.param_locs(node):
            obj = obj_at(graph, loc, holder)
            if obj not in params:
                params.append(obj)
        for loc in graph.buffer_locs(node):
            if graph.source(loc) not in buffers:
                buffers.append(graph.source(loc))
    return params, buffers


def _infos(
    graph: ModuleGraph, roots: tuple[int, ...], params: list[Obj], holder: Holder
) -> tuple[ParamInfo, ...]:
    found: dict[Obj, list[Loc]] = {obj: [] for obj in params}
    for root in roots:
        for _, node in named_modules(graph, root, remove_duplicate=False):
            for loc in graph.param_locs(node):
                places = found.get(obj_at(graph, loc, holder))
                if places is not None:
                    places.append(loc)
    return tuple(ParamInfo(found[o][0][0], found[o][0][1], tuple(found[o][1:])) for o in params)


def simulate(graph: ModuleGraph) -> tuple[Group, ...]:
    """Every ``fully_shard`` call of ``graph.wraps`` as torch performs it, in order."""
    groups: list[Group] = []
    holder: Holder = {}
    sharded: set[int] = set()
    replicated: set[int] = set()
    for index, wrap in enumerate(graph.wraps):
        if wrap.api == "replicate":
            replicated.update(wrap.nodes)
            continue
        modules = managed_modules(graph, wrap.nodes, sharded, replicated)
        params, buffers = _states(graph, modules, holder)
        infos = _infos(graph, wrap.nodes, params, holder)
        groups.append(
            Group(
                wrap=index,
                roots=wrap.nodes,
                modules=modules,
                params=tuple(loc for loc, _ in params),
                buffers=tuple(buffers),
                infos=infos,
                resharded=tuple(loc for loc, version in params if version >= 0),
            )
        )
        for info in infos:
            for loc in ((info.module, info.name), *info.shared):
                holder[loc] = index
        sharded.update(wrap.nodes)
    return tuple(groups)


def final_holder(graph: ModuleGraph, groups: tuple[Group, ...]) -> Holder:
    holder: Holder = {}
    for group in groups:
        for info in group.infos:
            for loc in ((info.module, info.name), *info.shared):
                holder[loc] = group.wrap
    return holder


def managed_twice(groups: tuple[Group, ...]) -> frozenset[Loc]:
    """Parameters (canonical places) that more than one ``fully_shard`` call manages."""
    counts: dict[Loc, int] = {}
    for group in groups:
        for loc in group.params:
            counts[loc] = counts.get(loc, 0) + 1
    return frozenset(loc for loc, n in counts.items() if n > 1)


# --- lazy initialisation from the root -------------------------------------------------------


@dataclass(frozen=True)
class LazyInit:
    """What the root's lazy init computes (``graph.wraps`` must end with ``fully_shard(0)``)."""

    states: tuple[int, ...]
    """Wrap index of every FSDP state, in ``all_states`` order (the root's first)."""
    module_fqns: dict[int, str | None]
    """Per wrap: its param group's ``_module_fqn`` (None: the call manages no parameter)."""
    param_fqns: dict[int, tuple[str | None, ...]]
    """Per wrap: each managed parameter's ``_param_fqn``, in the group's order."""
    duplicate_error: str | None
    """The ValueError for the first parameter managed by two groups, if any."""


def _state_of(graph: ModuleGraph) -> dict[int, int]:
    return graph.wrapped("fully_shard")


def _check_rooted(graph: ModuleGraph) -> None:
    wraps = graph.wraps
    rooted = bool(wraps) and wraps[-1] == Wrap("fully_shard", (0,))
    require(rooted, "wraps", wraps, "calls ending with fully_shard of the root (0,)")
    only = all(w.api == "fully_shard" for w in wraps)
    require(only, "wraps", wraps, "fully_shard calls only (lazy init is modelled for those)")


def all_states(graph: ModuleGraph, root: int = 0) -> tuple[int, ...]:
    state_of = _state_of(graph)
    order: list[int] = []
    for _, node in named_modules(graph, root):
        state = state_of.get(node)
        if state is not None and state not in order:
            order.append(state)
    return tuple(order)


def lazy_init(graph: ModuleGraph) -> LazyInit:
    _check_rooted(graph)
    groups = {g.wrap: g for g in simulate(graph)}
    states = all_states(graph)
    paths = {node: path for path, node in named_modules(graph)}
    first_path: dict[Obj, str] = {}
    for path, obj in named_parameters(graph, final_holder(graph, tuple(groups.values()))):
        first_path.setdefault(obj, path)
    module_fqns: dict[int, str | None] = {}
    param_fqns: dict[int, tuple[str | None, ...]] = {}
    for wrap, group in groups.items():
        ordered = sorted(group.roots, key=lambda n: list(paths).index(n))
        module_fqns[wrap] = ", ".join(paths[n] for n in ordered) if group.params else None
        param_fqns[wrap] = tuple(first_path.get((loc, wrap)) for loc in group.params)
    return LazyInit(states, module_fqns, param_fqns, _duplicate(states, groups, param_fqns))


def _duplicate(
    states: tuple[int, ...], groups: dict[int, Group], fqns: dict[int, tuple[str | None, ...]]
) -> str | None:
    seen: set[Loc] = set()
    for state in states:
        for loc, fqn in zip(groups[state].params, fqns[state], strict=True):
            if loc in seen:
                return DUPLICATE_ERROR.format(fqn=fqn)
            seen.add(loc)
    return None


def double_init_error(graph: ModuleGraph, first: int) -> str | None:
    """The root's lazy-init error after the state of ``graph.wraps[first]`` (one module,
    not the root) was lazily initialised on its own; None when the root would not notice."""
    _check_rooted(graph)
    (start,) = graph.wraps[first].nodes
    state_of = _state_of(graph)
    done = {first} | {state_of[n] for _, n in named_modules(graph, start) if n in state_of}
    visited: set[int] = set()
    for path, node in named_modules(graph):
        state = state_of.get(node)
        if state is None:
            continue
        if node != 0 and state not in visited and state in done:
            return DOUBLE_INIT_ERROR.format(fqn=path)
        visited.add(state)
    return None


def meta_error(graph: ModuleGraph, materialized: frozenset[Loc]) -> str | None:
    """The forward error when only the parameters at ``materialized`` canonical places left
    the meta device: the first state (``all_states`` order) holding a meta parameter lists
    the FQNs of its meta parameters."""
    init = lazy_init(graph)
    groups = {g.wrap: g for g in simulate(graph)}
    for state in init.states:
        group = groups[state]
        fqns = [
            fqn
            for loc, fqn in zip(group.params, init.param_fqns[state], strict=True)
            if loc not in materialized
        ]
        if fqns:
            return META_ERROR.format(fqns=fqns)
    return None


def unique_params(graph: ModuleGraph) -> list[tuple[str, Loc]]:
    """``model.parameters()`` before any wrap: FQN and canonical place of each object."""
    return [(path, loc) for path, (loc, _) in named_parameters(graph, {})]


def places(graph: ModuleGraph) -> Iterator[tuple[Loc, Loc]]:
    """Every parameter and buffer place reachable from the root with its canonical place."""
    for _, node in named_modules(graph):
        for loc in graph.param_locs(node) + graph.buffer_locs(node):
            yield loc, graph.source(loc)
