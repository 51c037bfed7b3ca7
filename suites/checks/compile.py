"""Rank function of the compile suite: a DTensor program run eagerly, then compiled."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from harness import RankContext
from harness.cases.compile import FAMILIES, CompileCase
from harness.torchkit.compile import Compiled, compiled, refusal_of, timed
from harness.torchkit.programs import loss_of, run_steps
from suites.checks.programs import ProgramRun, Runs, eager_steps, run_program


@dataclass(frozen=True)
class CompiledRun:
    """One rank's program run eagerly and compiled, and what compiling cost there.

    ``compiled`` is None where torch refused to compile it (``refusal``, the family of the
    first step whose program prefix it refuses, ``refused_family``)."""

    eager: ProgramRun
    compiled: ProgramRun | None
    refusal: str
    refused_family: str
    reused: bool
    """The structure's graph was compiled by an earlier example on this rank."""
    graphs: int
    """Graphs compiled during this example's compiled run."""
    seconds: float
    """The compiled run's seconds (forward and backward; compiling, where it compiled)."""
    stale: bool = False
    """The compiled callable, called before with other leaf placements
    (``CompileCase.guard_placements``), ran this case's without compiling a graph for them."""


def compiled_program_on_rank(ctx: RankContext, case: CompileCase) -> CompiledRun:
    eager = run_program(ctx, case.program, eager_steps(case.program))
    mesh = ctx.mesh_of(case.program.mesh)
    key = (case.structure(), id(mesh))  # the entry's closure holds the mesh: its id stays its own
    entry = compiled(key, lambda: _steps_of(case, mesh), case.backend)
    reused = entry.graphs > 0 or bool(entry.refusal)
    try:
        first = case.first_call()
        if first is not None and first.structure() not in entry.called and not entry.refusal:
            run_program(ctx, first.program, _through(entry, first))
            entry.called.add(first.structure())
        if entry.refusal:
            return CompiledRun(eager, None, entry.refusal, _family(ctx, case), reused, 0, 0.0)
        own = replace(case, guard_placements=()).structure()  # leaf 0's placements too
        seen, new = bool(entry.called), own not in entry.called
        run, cost = timed(entry, lambda: run_program(ctx, case.program, _through(entry, case)))
        entry.called.add(own)
    except Exception as error:
        refusal = refusal_of(error)
        if refusal is None:
            raise
        entry.refusal = refusal
        return CompiledRun(eager, None, refusal, _family(ctx, case), reused, entry.graphs, 0.0)
    stale = seen and new and cost.graphs == 0
    return CompiledRun(eager, run, "", "", reused, cost.graphs, cost.seconds, stale)


def _steps_of(case: CompileCase, mesh: DeviceMesh) -> Callable[..., Any]:
    program = case.program
    if case.split is not None:
        prefix = replace(program, steps=program.steps[: case.split])

        def compiled_prefix(*inputs: torch.Tensor) -> list[torch.Tensor]:
            return run_steps(prefix, list(inputs), mesh)[len(inputs) :]

        return compiled_prefix

    def compiled_steps(
        *inputs: torch.Tensor,
    ) -> tuple[list[torch.Tensor], torch.Tensor, list[bool]]:
        values = run_steps(program, list(inputs), mesh)
        # Only the loss is differentiated: a compiled graph's other outputs that require
        # grad get no DTensor tangent from backward(), which torch refuses ("Expected a
        # DTensor tangent but got a plain Tensor", pytorch#172556); as its message advises,
        # they leave detached, with whether they required grad said apart.
        flags = [value.requires_grad for value in values]
        return [value.detach() for value in values], loss_of(program, values), flags

    return compiled_steps


def _through(entry: Compiled, case: CompileCase) -> Runs:
    program, split = case.program, case.split

    def run(
        inputs: list[torch.Tensor], mesh: DeviceMesh
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        if split is not None:
            values = run_steps(program, [*inputs, *entry.call(*inputs)], mesh, first=split)
            return values, loss_of(program, values)
        values, loss, flags = entry.call(*inputs)
        return [v.requires_grad_(f) for v, f in zip(values, flags, strict=True)], loss

    return run


def _family(ctx: RankContext, case: CompileCase) -> str:
    """The family of the first step whose prefix of the program torch refuses to compile
    (each prefix compiled apart, cached like any program)."""
    program = case.program
    mesh = ctx.mesh_of(program.mesh)
    for count in range(1, len(program.steps) + 1):
        prefix = CompileCase(replace(program, steps=program.steps[:count]), case.backend)
        entry = compiled(
            (prefix.structure(), id(mesh), "prefix"),
            lambda prefix=prefix: _steps_of(prefix, mesh),  # type: ignore[misc]
            case.backend,
        )
        if entry.refusal:
            return FAMILIES[program.steps[count - 1].op]
        try:
            run_program(ctx, prefix.program, _through(entry, prefix))
        except Exception as error:
            if refusal_of(error) is None:
                raise
            entry.refusal = refusal_of(error) or ""
            return FAMILIES[program.steps[count - 1].op]
    return "loss"
