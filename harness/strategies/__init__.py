"""Hypothesis strategies for distconf cases, valid by construction.

Every strategy takes the world size it draws for (and its own options), validates its
arguments through ``harness.errors`` and draws only cases that are valid: a case never
needs filtering in a test. One module per area; the cases they draw are ``harness.cases``
of the same name. This package exports every strategy the suites use."""

from harness.cases.training import FSDP_LAYOUTS
from harness.strategies._common import (
    MAX_MESH_NDIM,
    MAX_SIDE,
    dtypes,
    factorisations,
    mesh_shapes,
    seeds,
    shapes,
)
from harness.strategies.checkpointing import checkpointings
from harness.strategies.comm_hooks import comm_hooks
from harness.strategies.compile import compile_cases
from harness.strategies.dcp_layouts import dcp_layout_cases as dcp_layout_cases
from harness.strategies.ddp import cpu_device_cases, delayed_all_reduces
from harness.strategies.hsdp import (
    group_error_cases,
    hsdp_cases,
    hsdp_meshes,
    save_load_cases,
    sync_cases,
)
from harness.strategies.knobs import KNOB_FAMILIES
from harness.strategies.meshes import mesh_cases
from harness.strategies.modules import (
    container_cases,
    graph_cases,
    mesh_mlp_cases,
    module_graphs,
    owns_subtree,
    shard_dim_cases,
    strided_disagreement_cases,
    strided_disagreement_world_sizes,
    torch_init_cases,
    zero_size_shapes,
)
from harness.strategies.ops import opinfo_cases, usable_samples
from harness.strategies.placements import (
    distribute_cases,
    extremum_empty_shard_cases,
    extremum_to_shard_cases,
    factory_cases,
    flatten_empty_cases,
    flattened_cases,
    from_the_back_cases,
    matmul_empty_batch_cases,
    op_cases,
    partial_sum_integer_cases,
    partial_target_cases,
    placements,
    redistribute_cases,
    reshape_cases,
    scan_negative_dim_cases,
    uneven_redistribute_cases,
    uneven_shard_cases,
)
from harness.strategies.programs import (
    einsum_unit_dim_cases,
    inplace_on_partial_cases,
    program_cases,
)
from harness.strategies.schedules import clip_cases, clippings, schedule_cases, schedules
from harness.strategies.state_dict import (
    layout_meshes,
    mid_step_cases,
    reshard_cases,
    resume_cases,
    state_dict_cases,
    strided_meshes,
    tied_after_forward_cases,
    uneven_strided_cases,
)
from harness.strategies.tp import (
    class_counts,
    hidden_sizes,
    loss_cases,
    loss_error_cases,
    prepare_cases,
    tied_cases,
    tp_cases,
    transformer_cases,
)
from harness.strategies.training import (
    DTENSOR_UNSUPPORTED,
    join_cases,
    mlp_cases,
    optim_configs,
    overlap_cases,
    params_cases,
    parity_cases,
    partition_cases,
    step_cases,
)
from harness.strategies.zero import fitting_overlap_cases, frozen_groups_cases

__all__ = [
    "DTENSOR_UNSUPPORTED",
    "FSDP_LAYOUTS",
    "KNOB_FAMILIES",
    "MAX_MESH_NDIM",
    "MAX_SIDE",
    "checkpointings",
    "class_counts",
    "clip_cases",
    "clippings",
    "comm_hooks",
    "compile_cases",
    "container_cases",
    "cpu_device_cases",
    "delayed_all_reduces",
    "distribute_cases",
    "dtypes",
    "einsum_unit_dim_cases",
    "extremum_empty_shard_cases",
    "extremum_to_shard_cases",
    "factorisations",
    "factory_cases",
    "fitting_overlap_cases",
    "flatten_empty_cases",
    "flattened_cases",
    "from_the_back_cases",
    "frozen_groups_cases",
    "graph_cases",
    "group_error_cases",
    "hidden_sizes",
    "hsdp_cases",
    "hsdp_meshes",
    "inplace_on_partial_cases",
    "join_cases",
    "layout_meshes",
    "loss_cases",
    "loss_error_cases",
    "matmul_empty_batch_cases",
    "mesh_cases",
    "mesh_mlp_cases",
    "mesh_shapes",
    "mid_step_cases",
    "mlp_cases",
    "module_graphs",
    "op_cases",
    "opinfo_cases",
    "optim_configs",
    "overlap_cases",
    "owns_subtree",
    "params_cases",
    "parity_cases",
    "partial_sum_integer_cases",
    "partial_target_cases",
    "partition_cases",
    "placements",
    "prepare_cases",
    "program_cases",
    "redistribute_cases",
    "reshape_cases",
    "reshard_cases",
    "resume_cases",
    "save_load_cases",
    "scan_negative_dim_cases",
    "schedule_cases",
    "schedules",
    "seeds",
    "shapes",
    "shard_dim_cases",
    "state_dict_cases",
    "step_cases",
    "strided_disagreement_cases",
    "strided_disagreement_world_sizes",
    "strided_meshes",
    "sync_cases",
    "tied_after_forward_cases",
    "tied_cases",
    "torch_init_cases",
    "tp_cases",
    "transformer_cases",
    "uneven_redistribute_cases",
    "uneven_shard_cases",
    "uneven_strided_cases",
    "usable_samples",
    "zero_size_shapes",
]
