"""Cases of the compile suite: a DTensor program (``harness.cases.programs``) run eagerly and
through ``torch.compile(..., fullgraph=True)`` with one backend.

What dynamo guards on is the program's structure: its mesh, its leaves' shape, placements
and how they are made, its steps and their own arguments, never the values its leaves hold
(``ProgramCase.leaf_array`` draws those from the leaves' seeds). ``structure`` is that key:
two cases of one structure reuse one compiled graph in a rank's process.

A compile torch refuses (``Unsupported``: a graph break under ``fullgraph=True``, an op
dynamo cannot trace) is coverage; ``refusal_kind`` says which exception types are refusals,
by the names of their classes, so that it needs no torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

from harness.cases.programs import OPS, ProgramCase
from harness.cases.training import ParityCase
from harness.errors import check_one_of, require
from specs.placements import Placement

BACKENDS = ("aot_eager", "inductor")
"""``aot_eager`` runs AOTAutograd's graphs with eager kernels: it promises eager's values
bit for bit. ``inductor`` generates kernels of its own (C++ on CPU), which may reorder float
arithmetic."""

REFUSALS = ("Unsupported", "UserError", "UncapturedHigherOrderOpError")
"""The exceptions of ``torch._dynamo.exc`` by which dynamo declines a program it cannot
capture whole: ``Unsupported`` (every graph break ``fullgraph=True`` turns into an error,
and its subclasses) and the errors dynamo raises on a user's use of an unsupported
feature. A backend's crash (``BackendCompilerFailed``), an error of the traced code
(``TorchRuntimeError``) or anything else is no refusal: where eager runs the program, it is
a deviation."""

FAMILIES: dict[str, str] = {
    "neg": "pointwise",
    "tanh": "pointwise",
    "relu": "pointwise",
    "add_scalar": "pointwise",
    "rsub_scalar": "pointwise",
    "mul_scalar": "pointwise",
    "div_scalar": "pointwise",
    "add": "pointwise",
    "sub": "pointwise",
    "mul": "pointwise",
    "add_scalar_": "in_place",
    "mul_scalar_": "in_place",
    "mul_": "in_place",
    "sum": "reduction",
    "sum_dim": "reduction",
    "mean_dim": "reduction",
    "transpose": "view",
    "unsqueeze": "view",
    "matmul": "contraction",
    "einsum": "contraction",
    "redistribute": "redistribute",
    "roundtrip": "local",
    "relabel": "local",
    "full_tensor": "redistribute",
    "all_reduce": "collectives",
    "reduce_scatter": "collectives",
    "all_gather": "collectives",
}
"""Each program op's family, the unit the suite counts refusals by: ``local`` is
``to_local``/``from_local``, ``redistribute`` every collective a program asks for through
DTensor, ``collectives`` the ``torch.distributed`` calls on local tensors (which dynamo
remaps to functional collectives)."""


@dataclass(frozen=True)
class CompileCase:
    """``program`` run eagerly and compiled with ``backend`` (``fullgraph=True``)."""

    program: ProgramCase
    backend: str
    split: int | None = None
    """The compiled function runs the first ``split`` steps and returns their values live
    (still requiring grad); the other steps and the loss run eagerly on them, as a user's
    loss outside a compiled block: gradients reach the compiled backward in the placements
    eager's ops give them, which may differ from those tracing assumed. None: every step and
    the loss compiled, the values returned detached."""
    guard_placements: tuple[Placement, ...] = ()
    """Leaf 0's placements in a first call of the same compiled callable: ``structure``
    leaves leaf 0's placements out, so the case's own call meets a graph compiled for other
    placements, which dynamo's guard on a DTensor's spec must turn down (a new graph)."""

    def __post_init__(self) -> None:
        require(isinstance(self.program, ProgramCase), "program", self.program, "a ProgramCase")
        check_one_of("backend", self.backend, BACKENDS)
        if self.split is not None:
            steps = len(self.program.steps)
            require(0 < self.split <= steps, "split", self.split, f"1-{steps} (steps compiled)")
            # an output left out of the loss gets no tangent: torch refuses that (#172556)
            loss = self.program.loss_of_all
            require(loss, "program.loss_of_all", loss, "True where the loss is outside")
        if self.guard_placements:
            own = self.program.leaves[0].placements
            different = len(self.guard_placements) == len(own) and self.guard_placements != own
            require(different, "guard_placements", self.guard_placements, f"other than {own}")

    def first_call(self) -> CompileCase | None:
        """The case whose call comes first through this case's compiled callable (leaf 0 in
        ``guard_placements``), or None."""
        if not self.guard_placements:
            return None
        program = self.program
        first = replace(program.leaves[0], placements=self.guard_placements)
        leaves = (first, *program.leaves[1:])
        return CompileCase(replace(program, leaves=leaves), self.backend, self.split)

    def structure(self) -> Hashable:
        """What a compiled graph of this case is specific to (see the module's docstring);
        leaf 0's placements left out where ``guard_placements`` is set."""
        program = self.program
        leaves: tuple[tuple[Hashable, ...], ...] = tuple(
            (leaf.placements, leaf.how, leaf.explicit_shape, leaf.transposed)
            for leaf in program.leaves
        )
        if self.guard_placements:
            leaves = (("guarded", *leaves[0][1:]), *leaves[1:])
        return (
            self.backend,
            program.mesh,
            program.shape,
            leaves,
            program.steps,
            program.loss_of_all,
            self.split,
            bool(self.guard_placements),
        )

    def families(self) -> tuple[str, ...]:
        """The op families of the program's steps, each once, in order of first use."""
        return tuple(dict.fromkeys(FAMILIES[step.op] for step in self.program.steps))

    def call(self) -> str:
        split = "" if self.split is None else f" (its first {self.split} steps; the rest eager)"
        first = self.first_call()
        before = "" if first is None else f", called first with x0 in {self.guard_placements}"
        return (
            f"torch.compile(program, backend={self.backend!r}, fullgraph=True){split} and "
            f"eagerly{before}, {self.program.call()}"
        )


COMPILED_LAYOUTS = ("fsdp", "fsdp_tp")
"""The training layouts whose blocks ``CompiledTrainingCase`` compiles: fully_shard over
compiled blocks, and tensor parallelism inside them."""


@dataclass(frozen=True)
class CompiledTrainingCase:
    """``training`` run eagerly, and with each block (a Linear) compiled by ``backend``
    (``fullgraph=True``) between tensor parallelism and ``fully_shard``, as torchtitan
    orders them: FSDP2's hooks run eagerly around each compiled block."""

    training: ParityCase
    backend: str

    def __post_init__(self) -> None:
        require(isinstance(self.training, ParityCase), "training", self.training, "a ParityCase")
        check_one_of("training.layout", self.training.layout, COMPILED_LAYOUTS)
        check_one_of("backend", self.backend, BACKENDS)

    def call(self) -> str:
        return (
            f"each block torch.compile(block, backend={self.backend!r}, fullgraph=True) "
            f"before fully_shard, and eagerly: {self.training.call()}"
        )


def refusal_kind(class_names: Sequence[str]) -> str | None:
    """The refusal an exception stands for, given the names of its class and its bases (its
    ``__mro__``, most derived first): the most derived class's name where any of them is a
    refusal (``REFUSALS``), else None (the error is no refusal)."""
    require(bool(class_names), "class_names", class_names, "the names of a class and its bases")
    if any(name in REFUSALS for name in class_names):
        return class_names[0]
    return None


assert set(FAMILIES) == set(OPS), "every program op has a family"
