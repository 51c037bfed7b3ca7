"""Module-graph strategies draw valid plans by construction; the graph model and builders
behave as documented; the reference model reproduces upstream's hand-written examples."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from harness import open_world
from harness import strategies as hs
from harness.cases.modules import GraphCase
from harness.strategies.modules import owns_subtree, strided_disagreement_world_sizes
from harness.torchkit.module_graphs import build_graph
from specs import fsdp_layouts
from specs.modules import (
    ModuleGraph,
    Node,
    ParamInfo,
    Tie,
    Wrap,
    lazy_init,
    managed_twice,
    simulate,
)


def _mlps(count: int, *, root: str = "seq") -> list[Node]:
    """Sequential of ``count`` MLPs: node 0 the root, each MLP followed by its linears."""
    nodes = [Node(root, tuple(1 + 3 * i for i in range(count)))]
    for i in range(count):
        first = 1 + 3 * i
        nodes += [Node("mlp", (first + 1, first + 2)), Node("linear"), Node("linear")]
    return nodes


@settings(max_examples=150)
@given(st.sampled_from(hs.modules.PLANS), st.data())
def test_plans_are_valid_by_construction(plan, data):
    graph = data.draw(hs.module_graphs(plan=plan))
    ModuleGraph(graph.nodes, graph.ties, graph.wraps)  # validates again
    groups = simulate(graph)
    fully = [w for w in graph.wraps if w.api == "fully_shard"]
    if plan in ("rooted", "tied_across", "shared_across"):
        assert graph.wraps[-1] == Wrap("fully_shard", (0,))
        assert all(w.api == "fully_shard" for w in graph.wraps)
    if plan in ("managed", "rooted"):
        assert not any(g.resharded for g in groups)
        assert all(owns_subtree(graph, w.nodes) for w in fully if w.nodes != (0,))
    if plan == "rooted":
        assert not managed_twice(groups) and lazy_init(graph).duplicate_error is None
    if plan == "tied_across":
        assert lazy_init(graph).duplicate_error is not None
    if plan == "shared_across":
        assert any(g.resharded for g in groups)
    if plan == "multi_root":
        assert len(graph.wraps[-1].nodes) >= 2 and all(0 not in w.nodes for w in graph.wraps)


@settings(max_examples=50)
@given(st.integers(1, 8), st.data())
def test_case_strategies_stay_near_the_world_size(world_size, data):
    case = data.draw(hs.graph_cases(world_size, train=True))
    assert 1 <= case.width <= 2 * world_size + 1 and 1 <= case.steps <= 3
    mlp = data.draw(hs.mesh_mlp_cases(world_size, kind="tp", meta=True))
    dp, tp = mlp.mesh_shape
    assert dp * tp == world_size and mlp.hidden >= tp
    assert not mlp.other_dim or mlp.width % dp == 0
    assert not mlp.meta or fsdp_layouts.strided_shard_agrees(mlp.hidden, dp, tp)
    shape = data.draw(hs.zero_size_shapes(world_size))
    assert 0 in shape[1:] and shape[0] >= 1
    dims = data.draw(hs.shard_dim_cases(world_size))
    assert len(dims.shard_dims) == 2 * (len(dims.dims) - 1)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: hs.module_graphs(plan="flat"), "plan='flat' must be one of"),
        (lambda: hs.module_graphs(max_nodes=2), "max_nodes=2 must be an int >= 3"),
        (lambda: hs.module_graphs(ties="yes"), "ties='yes' must be a bool"),
        (lambda: hs.graph_cases(0), "world_size=0 must be a positive int"),
        (lambda: hs.mesh_mlp_cases(4, kind="pp"), "kind='pp' must be one of"),
        (
            lambda: hs.modules.strided_disagreement_cases(4).example(),
            r"world_size=4 must be a size with a \(dp, tp, hidden\) where _StridedShard",
        ),
    ],
)
def test_bad_arguments_name_the_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ModuleGraph(()), "nodes=()"),
        (lambda: ModuleGraph((Node("conv"),)), "nodes\\[0\\].kind='conv'"),
        (lambda: ModuleGraph((Node("seq", (0,)),)), "must be indices in \\(0, 1\\)"),
        (
            lambda: ModuleGraph((Node("mlp", (1,)), Node("linear"))),
            r"children=\(1,\) must be of kinds \('linear', 'linear'\) in a mlp",
        ),
        (
            lambda: ModuleGraph((Node("seq", (1,)), Node("linear"), Node("linear"))),
            "must be a graph where every node but a callable root has a parent",
        ),
        (
            lambda: ModuleGraph((Node("seq", (1,)), Node("linear")), (Tie(1, "weight", 1),)),
            "must be from a node that is not itself tied",
        ),
        (
            lambda: ModuleGraph(
                (Node("seq", (1,)), Node("linear")),
                wraps=(Wrap("fully_shard", (0,)), Wrap("fully_shard", (1,))),
            ),
            "comes after its ancestor",
        ),
        (
            lambda: ModuleGraph(
                (Node("stack", (1,)), Node("list", (2,)), Node("linear")),
                wraps=(Wrap("fully_shard", (1,)),),
            ),
            r"wraps\[0\]=.* must be a call on callable nodes of the graph",
        ),
    ],
)
def test_invalid_graphs_are_refused(build, message):
    with pytest.raises(ValueError, match=message):
        build()


# --- the reference model on upstream's hand-written examples ---------------------------------


def test_nested_fully_shard_and_replicate_are_excluded():
    # upstream test_managed_modules_nested_fully_shard_and_replicate: replicate(model[0]),
    # fully_shard(model[2]), then the root manages model[1]'s modules and the root.
    wraps = (Wrap("replicate", (1,)), Wrap("fully_shard", (7,)), Wrap("fully_shard", (0,)))
    graph = ModuleGraph(tuple(_mlps(3)), wraps=wraps)
    root = simulate(graph)[-1]
    assert sorted(root.modules) == [0, 4, 5, 6]
    assert root.params == ((5, "weight"), (5, "bias"), (6, "weight"), (6, "bias"))
    assert root.buffers == ((4, "buffer"),)


def test_shared_mlp_is_managed_once_and_its_infos_list_every_place():
    # upstream test_managed_modules_duplicate and test_get_param_module_infos_duplicates
    nodes = (Node("seq", (1, 1)), Node("mlp", (2, 3)), Node("linear"), Node("linear"))
    (group,) = simulate(ModuleGraph(nodes, wraps=(Wrap("fully_shard", (0,)),)))
    assert sorted(group.modules) == [0, 1, 2, 3]
    assert group.infos[0] == ParamInfo(2, "weight", ((2, "weight"),))


def test_tied_weight_is_managed_once_with_a_shared_place():
    # upstream test_get_param_module_infos_shared_params: model[0].in_proj.weight = model[1]'s
    graph = ModuleGraph(tuple(_mlps(2)), (Tie(2, "weight", 5),), (Wrap("fully_shard", (0,)),))
    (group,) = simulate(graph)
    assert len(group.params) == 7
    assert group.infos[0] == ParamInfo(2, "weight", ((5, "weight"),))


def test_lazy_init_order_and_fqns_of_the_upstream_example():
    # upstream test_fully_shard_module_and_param_fqns: FSDP(Seq(MLP(FSDP, FSDP), MLP))
    wraps = (Wrap("fully_shard", (3,)), Wrap("fully_shard", (2,)), Wrap("fully_shard", (0,)))
    init = lazy_init(ModuleGraph(tuple(_mlps(2)), wraps=wraps))
    assert init.states == (2, 1, 0)
    assert init.module_fqns == {0: "0.out_proj", 1: "0.in_proj", 2: ""}
    assert init.param_fqns[2] == (
        "1.in_proj.weight",
        "1.in_proj.bias",
        "1.out_proj.weight",
        "1.out_proj.bias",
    )


# --- builders and layouts ----------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(hs.graph_cases(2))
def test_meta_build_reset_equals_direct_build(case):
    direct = build_graph(case, "cpu")
    meta = build_graph(GraphCase(case.graph, case.width, case.seed, meta=True), "cpu")
    meta.root.to_empty(device="cpu")
    meta.reset()
    for (place, a), (_, b) in zip(direct.places(), meta.places(), strict=True):
        assert torch.equal(a, b), place
    for tie in case.graph.ties:
        held = getattr(direct.modules[tie.node], tie.name)
        assert held is getattr(direct.modules[tie.source], tie.name)


def _strided_locals(ctx, size, mesh_shape):
    mesh = ctx.mesh(mesh_shape, ("dp", "tp"))
    full = torch.arange(size, dtype=torch.float64)
    placements = (_StridedShard(0, split_factor=mesh_shape[1]), Shard(0))
    return distribute_tensor(full, mesh, placements, src_data_rank=None).to_local().numpy()


@pytest.mark.parametrize(("size", "mesh_shape"), [(7, (3, 2)), (13, (3, 2)), (8, (3, 2))])
def test_strided_shard_model_matches_distribute_tensor(size, mesh_shape):
    assert 6 in strided_disagreement_world_sizes()
    with open_world("threads", world_size=6) as world:
        locals_ = world.run(_strided_locals, size, mesh_shape)
    for rank, local in enumerate(locals_):
        coord = divmod(rank, mesh_shape[1])
        expected = fsdp_layouts.strided_shard_local(np.arange(size), mesh_shape, coord, 0)
        np.testing.assert_array_equal(local, expected, err_msg=f"rank {rank}")
