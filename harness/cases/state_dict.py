"""Cases of the state-dict properties: what is trained, saved, reloaded and resumed."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from harness.cases.modules import GraphCase
from harness.cases.training import ParityCase
from harness.errors import check_int, check_one_of, check_subset, fail, require
from specs.resume import MID_STEP_POINTS

SHARDED_LAYOUTS = ("fsdp", "hsdp", "fsdp_tp", "hsdp_tp")


@dataclass(frozen=True)
class StateDictCase:
    """A ``fully_shard`` MLP trained ``train.steps`` steps, whose state is then taken.

    ``train`` holds the layout, mesh, model, optimizer (no LR scheduler: it is no part of
    the model or optimizer state) and the seed; the options go to every ``fully_shard``."""

    train: ParityCase
    reshard_after_forward: bool | int | None = None
    """None: torch's default (True for inner modules, False for the root); an int is the
    world size to reshard to after forward, a factor of the shard axis."""
    shard_largest_dim: bool = False
    """A ``shard_placement_fn`` sharding each parameter on its largest dim (upstream's
    ``use_shard_placement_fn``) when the shard axis divides it, else on dim 0."""
    offload: bool = False
    """``CPUOffloadPolicy(pin_memory=pin_memory)``."""
    pin_memory: bool = False

    def __post_init__(self) -> None:
        check_one_of("train.layout", self.train.layout, SHARDED_LAYOUTS)
        scheduler = self.train.optim.scheduler
        require(scheduler is None, "train.optim.scheduler", scheduler, "None")

    @property
    def shard_size(self) -> int:
        """Ranks on the axis ``fully_shard`` shards over."""
        mesh = self.train.mesh_shape
        return mesh[1] if self.train.layout in ("hsdp", "hsdp_tp") else mesh[0]

    def call(self) -> str:
        options = [f"reshard_after_forward={self.reshard_after_forward}"]
        if self.shard_largest_dim:
            options.append("shard_placement_fn=largest dim")
        if self.offload:
            options.append(f"CPUOffloadPolicy(pin_memory={self.pin_memory})")
        return f"{self.train.call()}; fully_shard({', '.join(options)})"


@dataclass(frozen=True)
class ReshardCase:
    """A checkpoint saved by ``save`` (trained ``save.train.steps`` steps) at one world size,
    loaded into ``load``: the same model and optimizer at another layout and world size,
    freshly initialised from another seed (so a load that does nothing shows)."""

    save: StateDictCase
    load: StateDictCase

    def call(self) -> str:
        load = self.load.train
        return (
            f"save: {self.save.call()} -> load at world size {math.prod(load.mesh_shape)}: "
            f"{load.layout}(mesh={load.mesh_shape})"
        )


@dataclass(frozen=True)
class ResumeCase:
    """Train, checkpoint, reload (maybe at another world size) as ``actions`` say.

    ``actions`` are ``("train", k)``, ``("checkpoint", 0)``, ``("reload", 0)`` and
    ``("resize", m)`` (reload the latest checkpoint at world size ``m``); see
    ``specs.resume``. ``layouts`` maps each world size used to its layout and mesh."""

    base: StateDictCase
    start: int
    """The world size training starts at."""
    actions: tuple[tuple[str, int], ...]
    layouts: tuple[tuple[int, str, tuple[int, ...]], ...]

    def at(self, world_size: int) -> StateDictCase:
        """The base case on ``world_size`` ranks, with that size's layout and mesh."""
        for size, layout, mesh in self.layouts:
            if size == world_size:
                train = replace(self.base.train, layout=layout, mesh_shape=mesh)
                return replace(self.base, train=train)
        fail("world_size", world_size, f"one of the sizes of layouts={self.layouts!r}")

    def call(self) -> str:
        steps = " ".join(f"{a}({n})" if a in ("train", "resize") else a for a, n in self.actions)
        meshes = ", ".join(f"{n}: {layout}{mesh}" for n, layout, mesh in self.layouts)
        return f"{self.base.call()}; start at {self.start} rank(s): {steps} [{meshes}]"


def _mesh_words(mesh_shape: tuple[int, ...]) -> str:
    """A 1-D or (replicate, shard) mesh, as a case's ``call()`` names it."""
    return f"HSDP mesh {mesh_shape}" if len(mesh_shape) == 2 else "1-D mesh"


MID_STEP_OPTIMIZERS = ("SGD", "Adam", "AdamW")
"""SGD with momentum 0.9 or 0 (no state ever), Adam and AdamW."""
MID_STEP_VIAS = ("memory", "dcp")
"""How a mid-step state dict reaches the fresh model: ``set_state_dict`` of a copy taken in
memory, or ``dcp.save`` then ``dcp.load`` into the fresh model's own state dict."""


@dataclass(frozen=True)
class MidStepCase:
    """A module graph's ``fully_shard`` plan (``graph``: nodes, ties, wraps, width, seed,
    ``steps`` steps of ``batch_per_rank`` rows per rank, ``lr``) on a 1-D mesh or a
    (replicate, shard) one (HSDP), trained by ``optimizer``; a model and optimizer state
    dict taken at ``point`` of step ``at_step`` and resumed from in a fresh model."""

    graph: GraphCase
    optimizer: str
    weight_decay: float
    mesh_shape: tuple[int, ...]
    reshard_after_forward: bool | int | None
    """None: torch's default; an int: the ranks to reshard to after forward (a factor of
    the shard axis), as ``StateDictCase.reshard_after_forward``."""
    set_to_none: bool
    """``zero_grad(set_to_none=...)``: False keeps zero gradients between steps."""
    at_step: int
    point: str
    via: str
    tensor_lr: bool = False
    """The optimizer's lr given as a 0-d tensor."""
    momentum: float = 0.9
    """SGD's momentum: 0 keeps no state, so every state dict meets an empty optimizer."""
    probe_points: tuple[str, ...] = ()
    """Points of every step where the run that takes the state dict also takes one and drops
    it (a read that must change nothing); where taking one would initialise a stateful
    optimizer (``specs.resume.initialises_optimizer``) none is taken."""

    def __post_init__(self) -> None:
        check_one_of("optimizer", self.optimizer, MID_STEP_OPTIMIZERS)
        check_one_of("point", self.point, MID_STEP_POINTS)
        check_one_of("via", self.via, MID_STEP_VIAS)
        require(len(self.mesh_shape) in (1, 2), "mesh_shape", self.mesh_shape, "1-D or 2-D")
        check_int("at_step", self.at_step, 0)
        require(self.at_step < self.graph.steps, "at_step", self.at_step, "below graph.steps")
        check_one_of("momentum", self.momentum, (0.0, 0.9))
        check_subset("probe_points", self.probe_points, MID_STEP_POINTS)

    @property
    def stateless(self) -> bool:
        """SGD without momentum: its state stays empty, every step."""
        return self.optimizer == "SGD" and self.momentum == 0.0

    @property
    def optimizer_options(self) -> tuple[tuple[str, float], ...]:
        """The optimizer's keyword arguments beside its parameters."""
        momentum = (("momentum", self.momentum),) if self.optimizer == "SGD" else ()
        return (("lr", self.graph.lr), *momentum, ("weight_decay", self.weight_decay))

    def call(self) -> str:
        graph = self.graph
        options = ", ".join(f"{k}={v}" for k, v in self.optimizer_options)
        mesh = _mesh_words(self.mesh_shape)
        probes = ""
        if self.probe_points:
            probes = f"; also taken and dropped at {', '.join(self.probe_points)} of every step"
        return (
            f"{graph.graph.describe()}, width {graph.width}, batch {graph.batch_per_rank}/rank; "
            f"fully_shard({mesh}, reshard_after_forward={self.reshard_after_forward}); "
            f"{graph.steps} step(s) of {self.optimizer}({options})"
            f"{' with a tensor lr' if self.tensor_lr else ''}, "
            f"zero_grad(set_to_none={self.set_to_none}); state dict at step {self.at_step} "
            f"{self.point}, via {self.via}{probes}"
        )


TIED_GROUP_ORDERS = (("first", "second"), ("second", "first"))
"""The ``fully_shard`` list of a tied pair: the model's order, and reversed."""
TIED_VIAS = ("state_dict", "get_model_state_dict")
"""How the state dict is taken: ``Module.state_dict()`` or DSD's ``get_model_state_dict``."""


@dataclass(frozen=True)
class TiedAfterForwardCase:
    """Two ``width``-feature Linears whose weights are one parameter (``second.weight =
    first.weight``), in one ``fully_shard`` group, under a root ``fully_shard``, on a 1-D or
    (replicate, shard) mesh with ``reshard_after_forward`` False or an int (both keep the
    parameters unsharded, or on a smaller group, after the forward); one forward, then the
    model's state dict. Each example builds the group both ways (``TIED_GROUP_ORDERS``):
    ``[second, first]`` registers the parameter to the module that holds it second in the
    model's order."""

    mesh_shape: tuple[int, ...]
    width: int
    reshard_after_forward: bool | int
    via: str
    seed: int

    def __post_init__(self) -> None:
        require(len(self.mesh_shape) in (1, 2), "mesh_shape", self.mesh_shape, "1-D or 2-D")
        check_int("width", self.width)
        keeps = self.reshard_after_forward is False or (
            isinstance(self.reshard_after_forward, int)
            and not isinstance(self.reshard_after_forward, bool)
            and self.reshard_after_forward > 1
            and self.mesh_shape[-1] % self.reshard_after_forward == 0
        )
        require(
            keeps,
            "reshard_after_forward",
            self.reshard_after_forward,
            "False or a factor above 1 of the shard axis",
        )
        check_one_of("via", self.via, TIED_VIAS)

    def call(self) -> str:
        group = " or ".join(f"[{', '.join(order)}]" for order in TIED_GROUP_ORDERS)
        mesh = _mesh_words(self.mesh_shape)
        return (
            f"first, second = Linear({self.width}, {self.width}, bias=False), "
            f"Linear({self.width}, {self.width}); second.weight = first.weight; "
            f"fully_shard({group}, {mesh}, reshard_after_forward={self.reshard_after_forward}); "
            f"fully_shard(Sequential(first, second)); a forward; {self.via}() (seed {self.seed})"
        )
