"""Hypothesis strategies for distconf cases, valid by construction (see ``_common``)."""

from harness.strategies._common import (
    MAX_MESH_NDIM,
    MAX_SIDE,
    dtypes,
    factorisations,
    mesh_shapes,
    seeds,
    shapes,
)
from harness.strategies.hsdp import hsdp_cases, hsdp_meshes, save_load_cases
from harness.strategies.modules import (
    graph_cases,
    mesh_mlp_cases,
    module_graphs,
    shard_dim_cases,
    zero_size_shapes,
)
from harness.strategies.placements import (
    distribute_cases,
    extremum_empty_shard_cases,
    extremum_to_shard_cases,
    flatten_empty_cases,
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
from harness.strategies.tp import loss_cases, tied_cases, tp_cases, transformer_cases
from harness.strategies.training import mlp_cases

__all__ = [
    "MAX_MESH_NDIM",
    "MAX_SIDE",
    "distribute_cases",
    "dtypes",
    "extremum_empty_shard_cases",
    "extremum_to_shard_cases",
    "factorisations",
    "flatten_empty_cases",
    "graph_cases",
    "hsdp_cases",
    "hsdp_meshes",
    "loss_cases",
    "mesh_mlp_cases",
    "mesh_shapes",
    "mlp_cases",
    "module_graphs",
    "op_cases",
    "partial_sum_integer_cases",
    "partial_target_cases",
    "placements",
    "redistribute_cases",
    "reshape_cases",
    "save_load_cases",
    "scan_negative_dim_cases",
    "seeds",
    "shapes",
    "shard_dim_cases",
    "tied_cases",
    "tp_cases",
    "transformer_cases",
    "uneven_redistribute_cases",
    "uneven_shard_cases",
    "zero_size_shapes",
]
