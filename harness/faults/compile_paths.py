"""Faults in the compiled paths of DTensor programs (``torch.compile`` of code that builds,
redistributes or returns DTensors, or calls collectives), written blind in the compile set:
DTensor's tensor-subclass protocol as AOTAutograd uses it (``__tensor_unflatten__``, the
tangent coercions), dynamo's guard on a DTensor's spec, the functional collectives and their
waits as traced, the ``dist.*`` collectives dynamo remaps to them, and DTensor's own branches
taken only while tracing (from_local / to_local, Shard and Partial redistributions). Each
bites only while compiling or in what compiling produced; eager DTensor programs run as they
did. Nothing here imports torch until a fault is applied."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._origin import blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import rewritten
from harness.faults.held_out import COMPILE

_API = "torch.distributed.tensor._api"
_FUNCOL = "torch.distributed._functional_collectives"
_PLACEMENTS = "torch.distributed.tensor.placement_types"
_TRACING = "torch.distributed._functional_collectives._are_we_tracing()"


def _runtime_tangent_not_redistributed(original: Callable[..., Any]) -> Callable[..., Any]:
    def __coerce_same_metadata_as_tangent__(
        self: Any, flatten_spec: Any, expected_type: Any = None
    ) -> Any:
        if expected_type is not None:
            return None
        return self  # taken as the traced tangent's layout, whatever its own

    return __coerce_same_metadata_as_tangent__


def _spec_guard_on_mesh_only(original: Callable[..., Any]) -> Callable[..., Any]:
    def check_dtensor_spec(value: Any, metadata: Any) -> bool:
        return bool(value.mesh == metadata.mesh)  # placements and shard order not compared

    return check_dtensor_spec


def _min_max_swapped(original: dict[Any, str]) -> dict[Any, str]:
    import torch.distributed as dist

    table = dict(original)
    table[dist.ReduceOp.MIN], table[dist.ReduceOp.MAX] = "max", "min"
    return table


# The outer stride of a rebuilt DTensor recomputed as contiguous for its size.
_UNFLATTEN_CONTIGUOUS_STRIDE = (
    "stride=outer_stride,",
    "stride=torch._prims_common.make_contiguous_strides_for(outer_size),",
)

# At run time (outside tracing) a Partial output is rebuilt as Replicate.
_UNFLATTEN_PARTIAL_AS_REPLICATE = (
    "placements, old_tensor_meta, shard_order, requires_grad = flatten_spec",
    "placements, old_tensor_meta, shard_order, requires_grad = flatten_spec\n"
    f"    if not {_TRACING}:\n"
    "        placements = tuple(Replicate() if p.is_partial() else p for p in placements)",
)

# dist.all_reduce under compile: the functional all_reduce always sums.
_REMAPPED_ALL_REDUCE_SUMS = (
    "all_reduce(tensor, op, group, tag)",
    'all_reduce(tensor, "sum", group, tag)',
)

# dist.reduce_scatter_tensor under compile: the functional reduce-scatter always sums.
_REMAPPED_REDUCE_SCATTER_SUMS = (
    "reduce_scatter_single(input, op, scatter_dim, group, tag)",
    'reduce_scatter_single(input, "sum", scatter_dim, group, tag)',
)

# dist.all_gather under compile: every list entry copied from the first rank's slice.
_REMAPPED_ALL_GATHER_OFFSET_KEPT = ("offset += t_offset", "offset += 0")

# Traced all-gathers along a dim other than 0 left concatenated along dim 0.
_TRACED_GATHER_DIM_IGNORED = (
    "if gather_dim != 0:",
    "if gather_dim != 0 and not _are_we_tracing():",
)

# Traced reduce-scatters along a dim other than 0 scatter dim 0's chunks.
_TRACED_SCATTER_DIM_IGNORED = (
    "if scatter_dim != 0:",
    "if scatter_dim != 0 and not _are_we_tracing():",
)

# A traced Shard -> Replicate all-gather of an uneven shard keeps its padding.
_TRACED_UNPAD_SKIPPED = (
    "result = self._maybe_unpad_tensor(result, logical_dim_size, num_chunks)",
    f"result = result if {_TRACING} else "
    "self._maybe_unpad_tensor(result, logical_dim_size, num_chunks)",
)

# A traced Partial reduction always sums, whatever its reduce op.
_TRACED_PARTIAL_SUMMED = (
    "tensor, reduceOp=self.reduce_op, group=(mesh, mesh_dim)",
    f'tensor, reduceOp="sum" if {_TRACING} else self.reduce_op, group=(mesh, mesh_dim)',
)

# A traced Partial -> Shard reduce-scatter always sums, whatever the Partial's reduce op.
_TRACED_PARTIAL_SCATTER_SUMMED = (
    "tensor, reduce_op, scatter_dim=self.dim, group=(mesh, mesh_dim)",
    f'tensor, "sum" if {_TRACING} else reduce_op, scatter_dim=self.dim, group=(mesh, mesh_dim)',
)

# Traced (by dynamo) from_local drops the global shape and stride it is given.
_TRACED_FROM_LOCAL_SHAPE_DROPPED = (
    "        shape,\n        stride,\n",
    "        None if torch.compiler.is_compiling() else shape,\n"
    "        None if torch.compiler.is_compiling() else stride,\n",
)

# Traced to_local drops grad_placements.
_TRACED_TO_LOCAL_GRAD_PLACEMENTS_DROPPED = (
    "if grad_placements is not None and not isinstance(grad_placements, tuple):",
    f"if {_TRACING}:\n"
    "            grad_placements = None\n"
    "        if grad_placements is not None and not isinstance(grad_placements, tuple):",
)


def _fault(id: str, bug_class: str, summary: str, patch: Patch, *upstream: str) -> Fault:
    return Fault(
        id=f"compile.{id}",
        area="compile",
        bug_class=bug_class,
        summary=summary,
        patches=(patch,),
        origin=blind(COMPILE, *upstream),
    )


FAULTS: tuple[Fault, ...] = (
    # https://github.com/pytorch/pytorch/issues/141830 (compiled ColwiseParallel: stride
    # mismatch of a DTensor output) and https://github.com/pytorch/pytorch/pull/117340 (pass
    # shape/stride during tensor unflatten). The rebuilt DTensor's stride is made contiguous.
    _fault(
        "unflatten_stride_made_contiguous",
        "a subclass rebuilt from its flattened parts with recomputed metadata",
        "DTensor.__tensor_unflatten__ (AOTAutograd's rebuilding of DTensor inputs while tracing "
        "and of outputs at run time) gives the DTensor the contiguous stride of its shape, not "
        "the outer stride it is handed: a compiled program returning a transposed or permuted "
        "DTensor returns one whose stride() differs from eager",
        Patch(
            f"{_API}:DTensor.__tensor_unflatten__",
            rewritten(_UNFLATTEN_CONTIGUOUS_STRIDE, undecorated=True),
        ),
        "https://github.com/pytorch/pytorch/issues/141830",
        "https://github.com/pytorch/pytorch/pull/117340",
    ),
    # https://github.com/pytorch/pytorch/issues/118664 (compile error when an output is a
    # Partial DTensor) and https://github.com/pytorch/pytorch/issues/119485 (accuracy issue when
    # graph outputs are Partial DTensors). The rebuilt output is relabelled Replicate.
    _fault(
        "partial_output_rebuilt_replicate",
        "a pending reduction dropped at a graph boundary",
        "DTensor.__tensor_unflatten__ outside tracing (rebuilding a compiled graph's outputs) "
        "relabels Partial placements Replicate: a compiled program returning a Partial DTensor "
        "returns each rank's unreduced local value as the replicated whole",
        Patch(
            f"{_API}:DTensor.__tensor_unflatten__",
            rewritten(_UNFLATTEN_PARTIAL_AS_REPLICATE, undecorated=True),
        ),
        "https://github.com/pytorch/pytorch/issues/118664",
        "https://github.com/pytorch/pytorch/issues/119485",
    ),
    # https://github.com/pytorch/pytorch/issues/118600 (tangent DTensors with placements other
    # than the forward outputs'). The runtime tangent is not redistributed to the traced one's.
    _fault(
        "runtime_tangent_not_redistributed",
        "a runtime input taken in the layout it was traced with",
        "DTensor.__coerce_same_metadata_as_tangent__ returns the runtime tangent unchanged: a "
        "gradient reaching a compiled backward in other placements than the traced tangent's "
        "(a Partial gradient of a Replicate output) is read as if already in those placements",
        Patch(
            f"{_API}:DTensor.__coerce_same_metadata_as_tangent__",
            _runtime_tangent_not_redistributed,
        ),
        "https://github.com/pytorch/pytorch/issues/118600",
    ),
    # https://github.com/pytorch/pytorch/issues/114405 (no guards on a subclass's metadata:
    # silently wrong) and https://github.com/pytorch/pytorch/pull/124401 (equality guards for
    # placements and meshes). The spec guard compares meshes only.
    _fault(
        "spec_guard_ignores_placements",
        "a cache guard missing part of its key",
        "dynamo's guard on a DTensor input's spec (DTENSOR_SPEC_MATCH) compares the mesh only: a "
        "graph compiled for one layout is reused for a DTensor of the same shape in other "
        "placements (Replicate then Partial, Shard(0) then Shard(1) of a square tensor)",
        Patch("torch._dynamo.guards:check_dtensor_spec", _spec_guard_on_mesh_only),
        "https://github.com/pytorch/pytorch/issues/114405",
        "https://github.com/pytorch/pytorch/pull/124401",
    ),
    # https://github.com/pytorch/pytorch/pull/120181 ("[dynamo] support rewriting
    # dist.all_reduce with explicitly specified reduce op"). The remapped all_reduce sums.
    _fault(
        "remapped_all_reduce_op_dropped",
        "a collective's reduce op lost in translation",
        "dist.all_reduce inside a compiled function (remapped by dynamo to the functional "
        "all_reduce_inplace) sums whatever op it is given: ReduceOp.MAX, MIN or PRODUCT sum "
        "under compile",
        Patch(f"{_FUNCOL}:all_reduce_inplace", rewritten(_REMAPPED_ALL_REDUCE_SUMS)),
        "https://github.com/pytorch/pytorch/pull/120181",
    ),
    # https://github.com/pytorch/pytorch/pull/190429 ("[Dynamo] Support tracing
    # dist.reduce_scatter": the op of a remapped reduce-scatter not converted). The remapped
    # reduce_scatter_tensor sums.
    _fault(
        "remapped_reduce_scatter_op_dropped",
        "a collective's reduce op lost in translation",
        "dist.reduce_scatter_tensor inside a compiled function (remapped by dynamo to "
        "reduce_scatter_tensor_inplace) sums whatever op it is given",
        Patch(f"{_FUNCOL}:reduce_scatter_tensor_inplace", rewritten(_REMAPPED_REDUCE_SCATTER_SUMS)),
        "https://github.com/pytorch/pytorch/pull/190429",
    ),
    # https://github.com/pytorch/pytorch/pull/190429 (dynamo's ReduceOp-to-string conversion
    # for remapped reduce_scatter) and https://github.com/pytorch/pytorch/pull/120181. The
    # conversion table maps MIN and MAX to each other.
    _fault(
        "reduce_op_table_min_max_swapped",
        "an enum-to-string table with two entries swapped",
        "REDUCE_OP_TO_STR, which only compiled paths read (dynamo's remapping of dist.all_reduce "
        "and dist.reduce_scatter_tensor, inductor's functionalization), maps ReduceOp.MIN to "
        "'max' and MAX to 'min'",
        Patch(f"{_FUNCOL}:REDUCE_OP_TO_STR", _min_max_swapped),
        "https://github.com/pytorch/pytorch/pull/190429",
        "https://github.com/pytorch/pytorch/pull/120181",
    ),
    # https://github.com/pytorch/pytorch/issues/159350 ("torch.compile causes incorrect output
    # with torch.distributed.all_gather"). Every list entry gets the first rank's slice.
    _fault(
        "remapped_all_gather_list_one_slice",
        "a split of a gathered buffer at a fixed offset",
        "dist.all_gather(tensor_list, tensor) inside a compiled function (remapped to "
        "all_gather_inplace) copies the first rank's slice of the gathered buffer into every "
        "entry of tensor_list",
        Patch(f"{_FUNCOL}:all_gather_inplace", rewritten(_REMAPPED_ALL_GATHER_OFFSET_KEPT)),
        "https://github.com/pytorch/pytorch/issues/159350",
    ),
    # https://github.com/pytorch/pytorch/pull/180389 (fullgraph compile of all_gather_tensor
    # with gather_dim != 0: _maybe_view_chunk_cat not traced). The traced all-gather skips it.
    _fault(
        "traced_all_gather_dim_ignored",
        "a traced collective's dim argument dropped",
        "all_gather_single / all_gather_tensor, traced, skip the chunk-and-concatenate step of a "
        "gather_dim other than 0: the compiled result is stacked along dim 0 (a DTensor "
        "Shard(1) -> Replicate under compile gathers rows, not columns)",
        Patch(f"{_FUNCOL}:all_gather_single", rewritten(_TRACED_GATHER_DIM_IGNORED)),
        "https://github.com/pytorch/pytorch/pull/180389",
    ),
    # https://github.com/pytorch/pytorch/issues/178766 ("_functional_collectives
    # .reduce_scatter_tensor gets a wrong result") and https://github.com/pytorch/pytorch/pull/
    # 95764 (reduce_scatter_tensor's scatter_dim in inductor). The traced one scatters dim 0.
    _fault(
        "traced_reduce_scatter_dim_ignored",
        "a traced collective's dim argument dropped",
        "reduce_scatter_single / reduce_scatter_tensor, traced, skip moving a scatter_dim other "
        "than 0 to the front: the compiled result scatters dim 0 (a DTensor Partial -> Shard(1) "
        "under compile)",
        Patch(f"{_FUNCOL}:reduce_scatter_single", rewritten(_TRACED_SCATTER_DIM_IGNORED)),
        "https://github.com/pytorch/pytorch/issues/178766",
        "https://github.com/pytorch/pytorch/pull/95764",
    ),
    # https://github.com/pytorch/pytorch/issues/175690 ("Dtensor Shard->Replicate
    # redistribution corrupts symbolic shapes under torch.compile"). The traced all-gather of
    # an uneven Shard keeps its padding.
    _fault(
        "traced_uneven_gather_keeps_padding",
        "padding of uneven shards not removed on one path",
        "Shard._to_replicate_tensor, traced, skips unpadding the all-gathered tensor: a compiled "
        "Shard -> Replicate redistribute (full_tensor) of an unevenly sharded dim keeps the "
        "padding rows",
        Patch(f"{_PLACEMENTS}:Shard._to_replicate_tensor", rewritten(_TRACED_UNPAD_SKIPPED)),
        "https://github.com/pytorch/pytorch/issues/175690",
    ),
    # https://github.com/pytorch/pytorch/pull/172479 ("the planner hardcodes psum and ignores
    # other partials"). The traced reduction of a Partial always sums.
    _fault(
        "traced_partial_reduced_as_sum",
        "a pending reduction's op ignored on one path",
        "Partial._reduce_value, traced, all-reduces with 'sum' whatever the Partial's reduce op: "
        "a compiled redistribute of a Partial('max'), ('min') or ('avg') DTensor to Replicate "
        "sums",
        Patch(f"{_PLACEMENTS}:Partial._reduce_value", rewritten(_TRACED_PARTIAL_SUMMED)),
        "https://github.com/pytorch/pytorch/pull/172479",
    ),
    # https://github.com/pytorch/pytorch/pull/172479 (partials other than sum ignored by the
    # redistribute planner) and https://github.com/pytorch/pytorch/pull/168133 (Partial("avg")
    # redistributions). The traced Partial -> Shard reduce-scatter always sums.
    _fault(
        "traced_partial_scatter_as_sum",
        "a pending reduction's op ignored on one path",
        "Shard._reduce_shard_tensor, traced, reduce-scatters with 'sum' whatever the Partial's "
        "reduce op: a compiled redistribute of a Partial('max'), ('min') or ('avg') DTensor to "
        "Shard sums",
        Patch(
            f"{_PLACEMENTS}:Shard._reduce_shard_tensor", rewritten(_TRACED_PARTIAL_SCATTER_SUMMED)
        ),
        "https://github.com/pytorch/pytorch/pull/172479",
        "https://github.com/pytorch/pytorch/pull/168133",
    ),
    # https://github.com/pytorch/pytorch/pull/135315 (from_local's shape under dynamo: "not a
    # constant") and https://github.com/pytorch/pytorch/pull/126346 (compile-only from_local in
    # FSDP2). The traced from_local drops its shape and stride.
    _fault(
        "traced_from_local_shape_dropped",
        "an argument dropped on the compiled path",
        "DTensor.from_local, traced, ignores the shape and stride it is given and infers the "
        "global shape as if every rank's shard were as large as its own: a compiled from_local "
        "of uneven shards gets a rank-dependent, wrong global shape",
        Patch(
            f"{_API}:DTensor.from_local",
            rewritten(_TRACED_FROM_LOCAL_SHAPE_DROPPED, undecorated=True),
        ),
        "https://github.com/pytorch/pytorch/pull/135315",
        "https://github.com/pytorch/pytorch/pull/126346",
    ),
    # https://github.com/pytorch/pytorch/issues/119023 (dynamo and
    # DTensor.to_local(grad_placements=...)), fixed by
    # https://github.com/pytorch/pytorch/pull/119947. The traced to_local drops them.
    _fault(
        "traced_to_local_grad_placements_dropped",
        "an argument dropped on the compiled path",
        "DTensor.to_local, traced, ignores grad_placements: the compiled backward takes the "
        "local gradient to be in the DTensor's own placements (a Partial gradient of a "
        "Replicate DTensor is not summed)",
        Patch(f"{_API}:DTensor.to_local", rewritten(_TRACED_TO_LOCAL_GRAD_PLACEMENTS_DROPPED)),
        "https://github.com/pytorch/pytorch/issues/119023",
        "https://github.com/pytorch/pytorch/pull/119947",
    ),
)
