"""FSDP2 initialisation: what ``fully_shard`` manages in generated module graphs (shared
modules, tied parameters, shared buffers, nested ``fully_shard`` and ``replicate``), lazy
init, meta-device init, the mesh argument, FSDP over TP, HSDP, and device moves.

Port of upstream's ``test/distributed/_composable/fsdp/test_fully_shard_init.py`` (every test
there skips without CUDA); the catalogue's provenance maps each upstream test to a spec here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from harness import World, parity
from harness.cases.modules import TorchInitCase
from harness.parity import assert_array_equal, assert_close, assert_equal_values, failure
from harness.profiles import costly, property_settings
from harness.strategies import (
    container_cases,
    factorisations,
    graph_cases,
    mesh_mlp_cases,
    shard_dim_cases,
    strided_disagreement_cases,
    strided_disagreement_world_sizes,
    torch_init_cases,
    zero_size_shapes,
)
from harness.torchkit import devices
from specs import fsdp_layouts as layouts
from specs import modules as model
from specs.chunking import shard_sizes
from specs.placements import Replicate, Shard
from suites.checks import fsdp_expect as expect
from suites.checks import fsdp_graphs as graphs
from suites.checks import fsdp_meshes as meshes
from suites.checks import fsdp_misc as misc
from suites.checks import fsdp_torch_init as torch_init

PROPERTY = property_settings()
DUPLICATE = "is shared with a parameter already managed by another FSDP group"


def _skip_unless_accelerator(world: World, what: str) -> None:
    if world.device == "cpu":
        pytest.skip(f"{what}: needs an accelerator (--device cuda, xpu, ...; this World is on cpu)")


# --- what each fully_shard call manages -------------------------------------------------------


@pytest.mark.spec("fsdp_init.managed.modules")
@PROPERTY
@given(data=st.data())
def test_managed_modules_match_model(world: World, data: st.DataObject) -> None:
    for view, group, who in _managed_groups(world, data):
        got, expected = sorted(view.modules), sorted(group.modules)
        assert_equal_values(got, expected, what=f"modules managed by {who}")


@pytest.mark.spec("fsdp_init.managed.states")
@PROPERTY
@given(data=st.data())
def test_managed_states_match_model(world: World, data: st.DataObject) -> None:
    for view, group, who in _managed_groups(world, data):
        for kind in ("params", "buffers"):
            got, expected = sorted(getattr(view, kind)), sorted(getattr(group, kind))
            assert_equal_values(got, expected, what=f"{kind} of {who}")


@pytest.mark.spec("fsdp_init.managed.param_module_infos")
@PROPERTY
@given(data=st.data())
def test_param_module_infos_match_model(world: World, data: st.DataObject) -> None:
    for view, group, who in _managed_groups(world, data):
        expect.assert_infos(view, group, who)


def _managed_groups(
    world: World, data: st.DataObject
) -> Iterator[tuple[graphs.GroupView, model.Group, str]]:
    """Every rank's view of each ``fully_shard`` call of a drawn ``managed`` plan, with the
    model's group and a label."""
    case = data.draw(graph_cases(world.world_size, plan="managed"), label="case")
    parity.attach(case.call())
    groups = model.simulate(case.graph)
    for rank, views in enumerate(world.run(graphs.managed_on_rank, case)):
        yield from expect.matching_groups(views, groups, rank)


# --- parameters, ties, training --------------------------------------------------------------


@pytest.mark.spec("fsdp_init.params.sharded_like_chunks")
@costly(2)  # 31 ms an example at world size 4
@given(data=st.data())
def test_unique_parameters_become_chunked_dtensors(world: World, data: st.DataObject) -> None:
    case = data.draw(graph_cases(world.world_size), label="case")
    parity.attach(case.call())
    initial = graphs.initial_values(case)
    expected = {fqn: initial[loc] for fqn, loc in model.unique_params(case.graph)}
    for rank, view in enumerate(world.run(graphs.params_on_rank, case)):
        assert_equal_values(view.before, tuple(expected), what="FQNs before")
        expect.assert_sharded_values(view.after, expected, rank, world.world_size)


@pytest.mark.spec("fsdp_init.ties.survive_training")
@costly(2)  # 18 ms an example at world size 4
@given(data=st.data())
def test_ties_survive_fully_shard_and_steps(world: World, data: st.DataObject) -> None:
    case = data.draw(graph_cases(world.world_size, train=True), label="case")
    parity.attach(case.call())
    reference = graphs.reference_training(case, world.world_size)
    assert all(count == 1 for count in reference.objects.values()), "the reference is tied"
    for rank, view in enumerate(world.run(graphs.train_on_rank, case)):
        expect.assert_ties_held(case.graph, view, rank)


@pytest.mark.spec("fsdp_init.training.parity")
@costly(3)  # 75 ms an example at world size 4
@given(data=st.data())
def test_training_matches_one_device(world: World, data: st.DataObject) -> None:
    case = data.draw(graph_cases(world.world_size, train=True), label="case")
    parity.attach(case.call())
    reference = graphs.reference_training(case, world.world_size)
    views = world.run(graphs.train_on_rank, case)
    losses = np.mean([v.losses for v in views], axis=0)
    for rank, view in enumerate(views):
        expect.assert_trained_like(view, reference, rank, losses=losses)


# --- lazy init ---------------------------------------------------------------------------------


@pytest.mark.spec("fsdp_init.lazy.root_and_states")
@PROPERTY
@given(data=st.data())
def test_lazy_init_root_and_state_order(world: World, data: st.DataObject) -> None:
    case = data.draw(graph_cases(world.world_size), label="case")
    parity.attach(case.call())
    expected = model.lazy_init(case.graph)
    root = len(case.graph.wraps) - 1
    is_root = {i: i == root for i in range(len(case.graph.wraps))}
    for rank, view in enumerate(world.run(graphs.lazy_on_rank, case)):
        assert_equal_values(view.is_root, is_root, what=f"_is_root on rank {rank}")
        what = f"all_states (as wrap indices) on rank {rank}"
        assert_equal_values(view.states, expected.states, what=what)


@pytest.mark.spec("fsdp_init.lazy.fqns")
@PROPERTY
@given(data=st.data())
def test_lazy_init_module_and_parameter_fqns(world: World, data: st.DataObject) -> None:
    case = data.draw(graph_cases(world.world_size), label="case")
    parity.attach(case.call())
    expected = model.lazy_init(case.graph)
    groups = {g.wrap: g for g in model.simulate(case.graph)}
    params = {
        w: tuple(zip(g.params, expected.param_fqns[w], strict=True)) for w, g in groups.items()
    }
    for rank, view in enumerate(world.run(graphs.lazy_on_rank, case)):
        what = f"_module_fqn per wrap on rank {rank}"
        assert_equal_values(view.module_fqns, expected.module_fqns, what=what)
        what = f"(parameter, _param_fqn) per wrap on rank {rank}"
        assert_equal_values(view.param_fqns, params, what=what)


@pytest.mark.spec("fsdp_init.lazy.double_init_error")
@costly(2)  # 10 ms an example at world size 4
@given(data=st.data())
def test_double_lazy_init_error(world: World, data: st.DataObject) -> None:
    case = data.draw(graph_cases(world.world_size), label="case")
    parity.attach(case.call())
    nested = [i for i, w in enumerate(case.graph.wraps[:-1]) if len(w.nodes) == 1]
    assume(nested)
    first = data.draw(st.sampled_from(nested), label="initialised first")
    expected = model.double_init_error(case.graph, first)
    for rank, message in enumerate(world.run(graphs.double_init_on_rank, case, first)):
        what = f"RuntimeError of the root's lazy init on rank {rank}"
        assert_equal_values(message, expected, what=what)


@pytest.mark.spec("fsdp_init.lazy.multi_module_root_error")
@costly(2)  # 14 ms an example at world size 4
@given(data=st.data())
def test_multi_module_root_error(world: World, data: st.DataObject) -> None:
    case = data.draw(graph_cases(world.world_size, plan="multi_root"), label="case")
    parity.attach(case.call())
    start = "FSDP requires a single root module but got ("
    for rank, message in enumerate(world.run(graphs.multi_root_on_rank, case)):
        if message is None or not message.startswith(start):
            raise failure(f"rank {rank}: got {message!r}, should start {start!r}")


# --- parameters managed by two calls ---------------------------------------------------------


@pytest.mark.spec("fsdp_init.ties.cross_group_error")
@costly(2)  # 21 ms an example at world size 4
@given(data=st.data())
def test_parameter_tied_across_groups_is_refused(world: World, data: st.DataObject) -> None:
    case = data.draw(graph_cases(world.world_size, plan="tied_across"), label="case")
    parity.attach(case.call())
    message = model.lazy_init(case.graph).duplicate_error
    assert message is not None, "tied_across plans tie a parameter across two groups"
    expected = graphs.Raised("forward", "ValueError", message)
    for rank, raised in enumerate(world.run(graphs.errors_on_rank, case)):
        assert_equal_values(raised, expected, what=f"error on rank {rank}")


@pytest.mark.spec("fsdp_init.shared_module.cross_group_error")
@PROPERTY
@given(data=st.data())
def test_module_shared_across_groups_is_refused(world: World, data: st.DataObject) -> None:
    case = data.draw(graph_cases(world.world_size, plan="shared_across"), label="case")
    parity.attach(case.call())
    assert model.managed_twice(model.simulate(case.graph)), "two groups manage a parameter"
    for rank, raised in enumerate(world.run(graphs.errors_on_rank, case)):
        if raised is None or raised.kind != "ValueError" or DUPLICATE not in raised.message:
            raise failure(
                f"rank {rank}: got {raised!r}, should be a ValueError saying the parameter "
                f"{DUPLICATE!r}"
            )


# --- meta-device init ------------------------------------------------------------------------


@pytest.mark.spec("fsdp_init.meta.materialize")
@costly(2)  # 20 ms an example at world size 4
@given(data=st.data())
def test_meta_init_to_empty_reset_and_train(world: World, data: st.DataObject) -> None:
    case = data.draw(graph_cases(world.world_size, meta=True, train=True), label="case")
    parity.attach(case.call())
    assign_root = data.draw(st.booleans(), label="assign new Parameters to the root's modules")
    initial, reference = (
        graphs.initial_values(case),
        graphs.reference_training(case, world.world_size),
    )
    views = world.run(graphs.train_on_rank, case, assign_root)
    losses = np.mean([v.losses for v in views], axis=0)
    for rank, view in enumerate(views):
        assert view.after_reset is not None, "meta cases report the shards after reset"
        expect.assert_first_pieces(view.after_reset, initial, rank, world.world_size)
        expect.assert_trained_like(view, reference, rank, losses=losses)


@pytest.mark.spec("fsdp_init.meta.unmaterialized_error")
@costly(2)  # 39 ms an example at world size 4
@given(data=st.data())
def test_forward_with_meta_parameters_lists_them(world: World, data: st.DataObject) -> None:
    case = data.draw(graph_cases(world.world_size, meta=True), label="case")
    parity.attach(case.call())
    nodes = range(len(case.graph.nodes))
    keep = tuple(sorted(data.draw(st.sets(st.sampled_from(nodes)), label="left on meta")))
    done = frozenset(
        case.graph.source(loc) for n in nodes if n not in keep for loc in case.graph.param_locs(n)
    )
    expected = model.meta_error(case.graph, done)
    for rank, message in enumerate(world.run(graphs.meta_error_on_rank, case, keep)):
        head = None if message is None else message.split("\n")[0]
        assert_equal_values(head, expected, what=f"forward error on rank {rank}")


@pytest.mark.spec("fsdp_init.meta.broadcast_state_dict")
@costly(2)  # 38 ms an example at world size 4
@given(data=st.data())
def test_meta_init_from_broadcast_state_dict(world: World, data: st.DataObject) -> None:
    case = data.draw(graph_cases(world.world_size, train=True, ties=False), label="case")
    parity.attach(case.call())
    initial, reference = (
        graphs.initial_values(case),
        graphs.reference_training(case, world.world_size),
    )
    views = world.run(graphs.broadcast_load_on_rank, case)
    losses = np.mean([v.losses for v in views], axis=0)
    for rank, view in enumerate(views):
        assert view.after_reset is not None, "loaded values are reported"
        for loc, value in sorted(view.after_reset.items()):
            what = f"{loc} after load_state_dict(assign=True) on rank {rank}"
            assert_array_equal(value, initial[loc], what=what)
        expect.assert_trained_like(view, reference, rank, losses=losses)


def _torch_init_views(world: World, case: TorchInitCase) -> list[torch_init.InitView]:
    if world.runner == "threads" and world.device != "cpu":
        pytest.skip("rank threads share one accelerator generator and DTensor's RNG tracker")
    parity.attach(case.call())
    return world.run(torch_init.torch_init_on_rank, case)


@pytest.mark.spec("fsdp_init.meta.torch_init")
@costly(2)  # 20 ms an example at world size 4
@given(data=st.data())
def test_torch_reset_parameters_on_sharded_params(world: World, data: st.DataObject) -> None:
    case = data.draw(torch_init_cases(world.world_size), label="case")
    views = _torch_init_views(world, replace(case, steps=0))
    torch_init.assert_initialised(views, case, world.device)


@pytest.mark.spec("fsdp_init.meta.torch_init_adam")
@costly(4)  # 66 ms an example at world size 4
@given(data=st.data())
def test_adam_after_torch_init_matches_one_device(world: World, data: st.DataObject) -> None:
    case = data.draw(torch_init_cases(world.world_size), label="case")
    torch_init.assert_trained(_torch_init_views(world, case), case, world.world_size)


@pytest.mark.spec("fsdp_init.mesh.default")
@costly(3)  # 61 ms an example at world size 4
@given(data=st.data())
def test_fully_shard_without_a_mesh(world: World, data: st.DataObject) -> None:
    host = devices.accelerator_type()
    if world.device != host:
        pytest.skip(f"the default mesh is on the host's {host}, this World is on {world.device}")
    case = data.draw(torch_init_cases(world.world_size, default_mesh=True), label="case")
    views = _torch_init_views(world, case)
    torch_init.assert_default_mesh(views, host)
    torch_init.assert_trained(views, case, world.world_size)


# --- the mesh argument -----------------------------------------------------------------------


@pytest.mark.spec("fsdp_init.mesh.rejected")
@PROPERTY
@given(data=st.data())
def test_mesh_of_wrong_rank_or_without_names_is_refused(world: World, data: st.DataObject) -> None:
    shapes = tuple(s for s in factorisations(world.world_size, 3) if len(s) > 1)
    shape = data.draw(st.sampled_from(shapes), label="mesh shape")
    named = len(shape) == 3 and data.draw(st.booleans(), label="named")
    case = data.draw(mesh_mlp_cases(world.world_size, kind="hsdp"), label="mlp")
    for rank, raised in enumerate(world.run(meshes.mesh_error_on_rank, shape, named, case)):
        assert raised is not None, f"rank {rank}: fully_shard accepted a mesh of shape {shape}"
        kind, message, mesh = raised
        expected = meshes.expected_mesh_error(shape, mesh)
        assert_equal_values((kind, message), expected, what=f"error on rank {rank} for {shape}")


# --- 2-D meshes ---------------------------------------------------------------------------------


@pytest.mark.spec("fsdp_init.tp.placements")
@costly(3)  # 61 ms an example at world size 4
@given(data=st.data())
def test_fsdp_over_tp_placements_mean_nested_shards(world: World, data: st.DataObject) -> None:
    case = data.draw(mesh_mlp_cases(world.world_size, kind="tp", meta=True), label="case")
    parity.attach(case.call("FSDP over TP"))
    reference, loss = meshes.reference_step(case, case.mesh_shape[0])
    views = world.run(meshes.tp_on_rank, case)
    for rank, view in enumerate(views):
        for name, param in view.params.items():
            meshes.assert_fsdp_over_tp(param, name, reference["values"][name], rank, case)
        if case.trains_with_tp:
            expect.assert_grads(view.grads, reference["grads"], rank)
    if case.trains_with_tp:
        mean = np.asarray(np.mean([v.loss for v in views]))
        expect.assert_close_to_one_device(mean, np.asarray(loss), what="mean loss")


@pytest.mark.spec("fsdp_init.tp.distribute_tensor_agrees")
@pytest.mark.world_size(*strided_disagreement_world_sizes(16))
@PROPERTY
@given(data=st.data())
def test_distribute_tensor_with_fsdp_placements_agrees(world: World, data: st.DataObject) -> None:
    case = data.draw(strided_disagreement_cases(world.world_size), label="case")
    parity.attach(
        case.call("distribute_tensor(full, param.device_mesh, param.placements) vs FSDP over TP")
    )
    for rank, found in enumerate(world.run(meshes.strided_on_rank, case)):
        if not found:
            raise failure(f"rank {rank}: no _StridedShard parameter")
        for name, (held, spread) in found.items():
            assert_array_equal(spread, held, what=f"local data of {name} on rank {rank}")


@pytest.mark.spec("fsdp_init.hsdp.replicas")
@costly(2)  # 24 ms an example at world size 4
@given(data=st.data())
def test_hsdp_placements_and_broadcast_across_replicas(world: World, data: st.DataObject) -> None:
    case = data.draw(mesh_mlp_cases(world.world_size, kind="hsdp"), label="case")
    parity.attach(case.call("HSDP"))
    replicas, shards = case.mesh_shape
    reference, _ = meshes.reference_step(case, world.world_size)
    buffers = {"buffer": meshes.buffer_value(case)}
    for rank, view in enumerate(world.run(meshes.hsdp_on_rank, case)):
        for name, param in view.params.items():
            who, full = f"{name} on rank {rank}", reference["values"][name]
            what = f"placements of {who}"
            assert_equal_values(param.placements, (Replicate(), Shard(0)), what=what)
            local = expect.piece(full, shards, 0, rank % shards)
            assert_array_equal(param.local, local, what=f"local shard of {who}")
            meshes.assert_replicas(view, name, local, replicas, rank)
        expect.assert_grads(view.grads, reference["grads"], rank)
        for name, value in buffers.items():
            meshes.assert_replicas(view, name, value, replicas, rank)


@pytest.mark.spec("fsdp_init.mesh.from_group")
@costly(2)  # 25 ms an example at world size 4
@given(data=st.data())
def test_from_group_mesh_trains_like_init_device_mesh(world: World, data: st.DataObject) -> None:
    hsdp = data.draw(st.booleans(), label="2-D HSDP (else 1-D dp of a (dp, tp) mesh)")
    case = data.draw(mesh_mlp_cases(world.world_size, kind="hsdp"), label="case")
    made = "HSDP" if hsdp else "1-D"
    parity.attach(case.call(f"DeviceMesh.from_group vs init_device_mesh, {made}"))
    for rank, view in enumerate(world.run(meshes.from_group_on_rank, case, hsdp)):
        assert_equal_values(view.meshes[1], view.meshes[0], what=f"mesh on rank {rank}")
        assert_equal_values(view.losses[1], view.losses[0], what=f"loss on rank {rank}")
        for kind, (made_from, made_ref) in (("param", view.params), ("grad", view.grads)):
            assert_equal_values(sorted(made_ref), sorted(made_from), what=f"{kind} names")
            for name in made_from:
                what = f"local {kind} of {name} on rank {rank}"
                assert_array_equal(made_ref[name], made_from[name], what=what)


@pytest.mark.spec("fsdp_init.hook.all_reduce")
@costly(3)  # 69 ms an example at world size 4
@given(data=st.data())
def test_all_reduce_hook_gives_hsdp_gradients(world: World, data: st.DataObject) -> None:
    case = data.draw(mesh_mlp_cases(world.world_size, kind="hsdp"), label="case")
    parity.attach(case.call("FSDP over shard groups + all-reduce hook over replicate groups"))
    reference, _ = meshes.reference_step(case, world.world_size)
    for rank, (grads, calls) in enumerate(world.run(meshes.hook_on_rank, case)):
        assert_equal_values(calls, 2 if case.nested else 1, what=f"hook calls on rank {rank}")
        expect.assert_grads(grads, reference["grads"], rank)


@pytest.mark.spec("fsdp_init.hook.stream_rejected")
@costly(2)  # 34 ms an example at world size 4
@given(data=st.data())
def test_hsdp_refuses_a_hook_stream(world: World, data: st.DataObject) -> None:
    case = data.draw(mesh_mlp_cases(world.world_size, kind="hsdp"), label="case")
    parity.attach(case.call("HSDP"))
    expected = "stream cannot be set when using native HSDP"
    for rank, message in enumerate(world.run(meshes.stream_rejected_on_rank, case)):
        assert_equal_values(message, expected, what=f"ValueError on rank {rank}")


@pytest.mark.spec("fsdp_init.hook.runs_in_stream")
@PROPERTY
@given(data=st.data())
def test_fsdp_hook_runs_in_its_stream(world: World, data: st.DataObject) -> None:
    _skip_unless_accelerator(world, "a hook stream is an accelerator stream (CPU has no events)")
    case = data.draw(mesh_mlp_cases(world.world_size, kind="hsdp"), label="case")
    for rank, ran in enumerate(world.run(meshes.hook_stream_on_rank, case)):
        assert_equal_values(ran, True, what=f"hook ran in the given stream on rank {rank}")


# --- devices (accelerators) ------------------------------------------------------------------


@pytest.mark.spec("fsdp_init.device.moves_to_mesh_device")
@PROPERTY
@given(data=st.data())
def test_fully_shard_moves_states_to_mesh_device(world: World, data: st.DataObject) -> None:
    _skip_unless_accelerator(world, "fully_shard moves CPU states to the mesh's accelerator")
    case = data.draw(graph_cases(world.world_size, ties=False), label="case")
    parity.attach(case.call())
    root = model.simulate(case.graph)[-1]
    chosen = st.sets(st.sampled_from(root.params)) if root.params else st.just(set())
    ignored = tuple(sorted(data.draw(chosen, label="ignored")))
    for rank, seen in enumerate(world.run(misc.device_on_rank, case, ignored)):
        for place, device in seen["after"].items():
            node, name = place.split(".")
            stays = case.graph.source((int(node), name)) in ignored
            expected = "cpu" if stays else seen["device"]
            assert_equal_values(device, expected, what=f"device of {place} on rank {rank}")
            assert_equal_values(seen["moved"][place], seen["device"], what=f"{place} after .to()")


@pytest.mark.spec("fsdp_init.device.dtensor_moves")
@PROPERTY
@given(data=st.data())
def test_tp_parameters_and_buffers_move_to_mesh_device(world: World, data: st.DataObject) -> None:
    _skip_unless_accelerator(world, "fully_shard moves CPU buffers beside accelerator DTensors")
    case = data.draw(mesh_mlp_cases(world.world_size, kind="tp"), label="case")
    for rank, seen in enumerate(world.run(misc.tp_device_on_rank, case)):
        here = seen["device"]
        for stage, expected in misc.expected_tp_devices(case, here).items():
            what = f"(device, local device) of each tensor {stage} fully_shard on rank {rank}"
            assert_equal_values(seen[stage], expected, what=what)


@pytest.mark.spec("fsdp_init.device.dtensor_mesh_mismatch")
@pytest.mark.runner(
    "threads", reason="a CPU mesh beside the accelerator's needs gloo; nccl ranks have none"
)
@PROPERTY
@given(data=st.data())
def test_dtensor_on_another_device_type_is_refused(world: World, data: st.DataObject) -> None:
    _skip_unless_accelerator(world, "a CPU TP mesh against an accelerator FSDP mesh")
    case = data.draw(mesh_mlp_cases(world.world_size, kind="tp"), label="case")
    expected = (
        "Requires DTensor to have mesh of the same type as the FSDP mesh but got cpu for "
        f"DTensor and {world.device} for FSDP"
    )
    for rank, message in enumerate(world.run(misc.mismatch_on_rank, case)):
        assert_equal_values(message, expected, what=f"ValueError on rank {rank}")


# --- fixed small models ------------------------------------------------------------------------


@pytest.mark.spec("fsdp_init.params.unsupported_rejected")
@PROPERTY
@given(data=st.data())
def test_scalar_and_noncontiguous_parameters_are_refused(world: World, data: st.DataObject) -> None:
    case = data.draw(graph_cases(world.world_size, ties=False), label="case")
    parity.attach(case.call())
    kind = data.draw(st.sampled_from(("scalar", "noncontiguous")), label="kind")
    linears = [n for n, s in enumerate(case.graph.nodes) if s.kind == "linear"]
    node = data.draw(st.sampled_from(linears), label="node")
    wrap = next(g.wrap for g in model.simulate(case.graph) if node in g.modules)
    expected = misc.unsupported_outcome(kind, wrap, case.width)
    for rank, raised in enumerate(world.run(misc.unsupported_on_rank, case, kind, node)):
        got = misc.raised_prefix(raised, len(expected[2]))
        assert_equal_values(got, expected if expected[2] else None, what=f"error on rank {rank}")


@pytest.mark.spec("fsdp_init.params.zero_size_dim")
@PROPERTY
@given(data=st.data())
def test_zero_size_dims_are_sharded_like_others(world: World, data: st.DataObject) -> None:
    shape = data.draw(zero_size_shapes(world.world_size), label="parameter shape")
    parity.attach(f"fully_shard of a parameter of shape {shape}")
    for rank, (global_shape, local) in enumerate(world.run(misc.zero_size_on_rank, shape)):
        assert_equal_values(global_shape, shape, what=f"global shape on rank {rank}")
        rows = shard_sizes(shape[0], world.world_size)[rank]
        assert_equal_values(local, (rows, *shape[1:]), what=f"local shape on rank {rank}")


@pytest.mark.spec("fsdp_init.containers.forward_required")
@costly(2)  # 28 ms an example at world size 4
@given(data=st.data())
def test_containers_need_a_forward(world: World, data: st.DataObject) -> None:
    case = data.draw(container_cases(world.world_size), label="case")
    reference = misc.container_reference(case, world.world_size)
    prefix = "fully_shard does not support containers that do not implement forward: "
    for rank, (message, text, output) in enumerate(world.run(misc.container_on_rank, case)):
        parity.attach(case.call(False))
        assert_equal_values(message, prefix + text, what=f"ValueError on rank {rank}")
        rows = reference[rank * case.batch_per_rank : (rank + 1) * case.batch_per_rank]
        parity.attach(case.call(True))
        assert_close(
            output,
            rows,
            rtol=expect.RTOL,
            atol=expect.ATOL,
            dtype="float64",
            what=f"output on rank {rank}",
            why="a batch of rows may be multiplied in another blocking than the whole batch",
        )


@pytest.mark.spec("fsdp_init.shard_placement.layout")
@PROPERTY
@given(data=st.data())
def test_shard_placement_fn_layout(world: World, data: st.DataObject) -> None:
    case = data.draw(shard_dim_cases(world.world_size), label="case")
    parity.attach(case.call())
    values = misc.linear_values(case)
    shapes = tuple(v.shape for v in values.values())
    outcome = layouts.shard_dim_outcome(shapes, case.shard_dims, world.world_size)
    for rank, result in enumerate(world.run(misc.shard_dim_on_rank, case)):
        misc.assert_shard_dim_result(result, outcome, values, rank, world.world_size)


@pytest.mark.spec("fsdp_init.params.frozen_mixed_dtypes")
@costly(2)  # 30 ms an example at world size 4
@given(data=st.data())
def test_frozen_parameters_of_mixed_dtypes(world: World, data: st.DataObject) -> None:
    case = data.draw(graph_cases(world.world_size), label="case")
    parity.attach(misc.mixed_call(case))
    reference = misc.mixed_reference(case, world.world_size)
    for rank, view in enumerate(world.run(misc.mixed_on_rank, case)):
        misc.assert_mixed(view, reference, rank, world.world_size, case)


@pytest.mark.spec("fsdp_init.fsdp_module.classes_and_bf16")
@costly(3)  # 46 ms an example at world size 4
@given(data=st.data())
def test_old_import_path_classes_and_bf16_training(world: World, data: st.DataObject) -> None:
    case = data.draw(graph_cases(world.world_size, ties=False), label="case")
    parity.attach(misc.classes_call(case))
    wrapped = {n for w in case.graph.wraps for n in w.nodes}
    expected = tuple(n in wrapped for n in range(len(case.graph.nodes)))
    reference = misc.bf16_reference(case, world.world_size)
    for rank, view in enumerate(world.run(misc.classes_on_rank, case)):
        misc.assert_classes(view, expected, reference, rank)
