"""Faults in tensor parallelism: what a parallel style does with a layer's partial output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._patch import Fault, Patch

_STYLE = "torch.distributed.tensor.parallel.style"


def _partial_output_kept_local(original: Callable[..., Any]) -> Callable[..., Any]:
    def prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: Any, outputs: Any, device_mesh: Any
    ) -> Any:
        from torch.distributed.tensor import DTensor

        if any(placement.is_partial() for placement in outputs.placements):
            outputs = DTensor.from_local(
                outputs.to_local(), device_mesh, output_layouts, run_check=False
            )
        return original(output_layouts, use_local_output, mod, outputs, device_mesh)

    return prepare_output_fn


FAULTS = (
    Fault(
        id="tp.rowwise_output_not_reduced",
        area="tp",
        bug_class="a partial result relabelled instead of reduced",
        summary="RowwiseParallel declares each rank's partial output to be the replicated "
        "(or sharded) result without the all-reduce / reduce-scatter",
        patches=(
            Patch(f"{_STYLE}:RowwiseParallel._prepare_output_fn", _partial_output_kept_local),
        ),
    ),
)
