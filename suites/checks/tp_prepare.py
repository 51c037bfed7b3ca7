"""Rank function and single-device reference of tp.prepare.layouts: PrepareModuleInput,
PrepareModuleOutput, PrepareModuleInputOutput and SequenceParallel with drawn layouts
around ``SquareEach``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    SequenceParallel,
    parallelize_module,
)

from harness import RankContext
from harness.cases import seeded_arrays
from harness.cases.tp import Layout, PrepareCase
from harness.torchkit.dtensor import (
    from_torch_placements,
    tensor_from,
    to_numpy,
    to_torch_placements,
)
from harness.torchkit.models import SquareEach
from specs.placements import Placement, Replicate, Shard, local_arrays, normalize


@dataclass(frozen=True)
class PreparedOutput:
    """One output as the forward handed it back: a DTensor's placements and whole value,
    or (``placements`` None) the local tensor itself."""

    placements: tuple[Placement | str, ...] | None
    value: np.ndarray


@dataclass(frozen=True)
class PrepareResult:
    """The outputs, and the gradients of the inputs as this rank fed them."""

    outputs: tuple[PreparedOutput, ...]
    grads: tuple[np.ndarray, ...]


def prepare_inputs(case: PrepareCase) -> list[np.ndarray]:
    """The seeded global ``x`` (and ``y``)."""
    return seeded_arrays((case.seed,), [case.shape] * (1 + case.keyword), case.dtype)


def piece(array: np.ndarray, placement: Placement, tp: int, rank: int) -> np.ndarray:
    """This rank's local piece of ``array`` laid out as ``placement`` over ``tp`` ranks."""
    return local_arrays(array, (tp,), normalize((placement,), array.ndim))[(rank,)]


def _placements(layouts: tuple[Layout, ...], bare: bool) -> Any:
    """Torch's spelling of a prepare style's layouts: a bare placement where ``bare``."""
    spelled = tuple(None if p is None else to_torch_placements((p,))[0] for p in layouts)
    return spelled[0] if bare and len(spelled) == 1 and spelled[0] is not None else spelled


def _input_options(case: PrepareCase) -> dict[str, Any]:
    options: dict[str, Any] = {
        "input_layouts": _placements((case.input_layout,), case.bare),
        "desired_input_layouts": _placements((case.desired_input_layout,), case.bare),
    }
    if case.kwarg_layouts is not None:
        given, desired = to_torch_placements(case.kwarg_layouts)
        options["input_kwarg_layouts"] = {"y": given}
        options["desired_input_kwarg_layouts"] = {"y": desired}
    return options


def _output_options(case: PrepareCase) -> dict[str, Any]:
    return {
        "output_layouts": _placements(case.output_layouts, case.bare),
        "desired_output_layouts": _placements(case.desired_output_layouts, case.bare),
        "use_local_output": case.use_local_output,
    }


def prepare_style(case: PrepareCase) -> Any:
    """The style ``case.style_call()`` spells."""
    if case.style == "input":
        return PrepareModuleInput(**_input_options(case), use_local_output=case.use_local_input)
    if case.style == "output":
        return PrepareModuleOutput(**_output_options(case))
    if case.style == "sequence":
        assert isinstance(case.input_layout, Shard)
        dim, local = case.input_layout.dim, case.use_local_input
        return SequenceParallel(sequence_dim=dim, use_local_output=local)
    return PrepareModuleInputOutput(
        **_input_options(case), use_local_input=case.use_local_input, **_output_options(case)
    )


def _mesh(ctx: RankContext, case: PrepareCase) -> Any:
    if case.named_mesh:
        return ctx.mesh((1, ctx.world_size), ("dp", "tp"))["tp"]
    return ctx.mesh((ctx.world_size,))


def _whole(output: torch.Tensor, placement: Placement, mesh: Any) -> torch.Tensor:
    """The whole output: a DTensor's, or a local piece's of ``placement`` (a collective)."""
    if isinstance(output, DTensor):
        return output.full_tensor()
    if isinstance(placement, Replicate):
        return output
    return DTensor.from_local(output, mesh, to_torch_placements((placement,))).full_tensor()


def prepare_on_rank(ctx: RankContext, case: PrepareCase) -> PrepareResult:
    """Each rank feeds its pieces, runs the forward and backward of the sum of the whole
    outputs, and reports the outputs and its pieces' gradients."""
    mesh = _mesh(ctx, case)
    model = parallelize_module(SquareEach(), mesh, prepare_style(case))
    fed = [
        tensor_from(piece(array, p, case.tp, ctx.rank), case.dtype, ctx.device).requires_grad_()
        for array, p in zip(prepare_inputs(case), case.fed(), strict=True)
    ]
    result = model(fed[0], **({"y": fed[1]} if case.keyword else {}))
    outputs = result if isinstance(result, tuple) else (result,)
    states = case.results()
    wholes = [_whole(o, s.placement, mesh) for o, s in zip(outputs, states, strict=True)]
    sum(w.sum() for w in wholes).backward()  # type: ignore[union-attr]
    return PrepareResult(
        outputs=tuple(_prepared(o, w) for o, w in zip(outputs, wholes, strict=True)),
        grads=tuple(to_numpy(t.grad) for t in fed if t.grad is not None),
    )


def _prepared(output: torch.Tensor, whole: torch.Tensor) -> PreparedOutput:
    if isinstance(output, DTensor):
        return PreparedOutput(from_torch_placements(output.placements), to_numpy(whole))
    return PreparedOutput(None, to_numpy(output))


def prepare_reference(case: PrepareCase) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``SquareEach``'s whole outputs and the inputs' gradients on one device."""
    cpu = torch.device("cpu")
    inputs = [tensor_from(a, case.dtype, cpu).requires_grad_() for a in prepare_inputs(case)]
    result = SquareEach()(inputs[0], **({"y": inputs[1]} if case.keyword else {}))
    outputs = result if isinstance(result, tuple) else (result,)
    sum(o.sum() for o in outputs).backward()
    grads = [to_numpy(t.grad) for t in inputs if t.grad is not None]
    return [to_numpy(o.detach()) for o in outputs], grads
