"""The cases of the FSDP init suite: plain, picklable values with readable reprs (no torch).

A ``GraphCase`` carries a ``specs.modules.ModuleGraph`` and what a rank needs to build the same
modules from it (width, seed, meta device) and to train them. The mesh cases describe the 2-D
(FSDP + TP, HSDP) and error checks on fixed small models.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import check_one_of, require
from specs.modules import ModuleGraph


@dataclass(frozen=True)
class GraphCase:
    """A module graph, its ``fully_shard`` plan and a few steps of SGD on it."""

    graph: ModuleGraph
    width: int
    """Every linear is ``width x width``; the mlp buffer has ``width`` elements."""
    seed: int
    meta: bool = False
    """Build on the meta device (then ``to_empty`` and a seeded ``reset_parameters``)."""
    steps: int = 1
    batch_per_rank: int = 1
    lr: float = 0.1
    momentum: float = 0.0

    def call(self) -> str:
        where = ", on meta" if self.meta else ""
        return (
            f"{self.graph.describe()}, width {self.width}{where}, {self.steps} SGD step(s) "
            f"(lr={self.lr}, momentum={self.momentum}), batch {self.batch_per_rank}/rank"
        )


@dataclass(frozen=True)
class MLPMeshCase:
    """An MLP (``in_proj``: width -> hidden, ``out_proj``: hidden -> width, a buffer) on a
    2-D mesh: FSDP over TP (``dp`` x ``tp``) or HSDP (``replicate`` x ``shard``)."""

    mesh_shape: tuple[int, int]
    width: int
    hidden: int
    bias: bool
    seed: int
    nested: bool = True
    """``fully_shard`` each projection before the root (else only the root)."""
    meta: bool = False
    other_dim: bool = False
    """FSDP + TP: shard each weight on the dim TP does not (``shard_placement_fn``)."""
    batch_per_dp_rank: int = 1

    @property
    def trains_with_tp(self) -> bool:
        """TP styles rebuild activations with ``DTensor.from_local``, which assumes even
        pieces: a forward through TP needs ``hidden`` divisible by the tp axis. A hidden
        size of 1 fails DTensor's view propagation in the bias gradient of a one-row batch
        (``[1, 1]`` sharded on dim 1 viewed as ``[1]``): a TP matter, left out here."""
        return self.hidden % self.mesh_shape[1] == 0 and self.hidden > 1

    def call(self, kind: str) -> str:
        extra = ", on meta" if self.meta else ""
        extra += ", FSDP on the dim TP leaves" if self.other_dim else ""
        extra += "" if self.nested else ", root only"
        return (
            f"{kind} mesh {self.mesh_shape}, MLP(width={self.width}, hidden={self.hidden}, "
            f"bias={self.bias}){extra}"
        )


@dataclass(frozen=True)
class ShardDimCase:
    """``fully_shard(Sequential(Linear...), shard_placement_fn)`` with a drawn dim per param."""

    dims: tuple[int, ...]
    """Feature sizes, input first: ``(4, 3)`` is one Linear(4, 3)."""
    shard_dims: tuple[int, ...]
    """The ``Shard`` dim asked for each parameter, in ``named_parameters`` order."""
    seed: int

    def call(self) -> str:
        return f"fully_shard(Linear stack {self.dims}, Shard dims {self.shard_dims})"


@dataclass(frozen=True)
class ContainerCase:
    """A ``ModuleList`` / ``ModuleDict`` of ``layers`` Linear(width, width), with or without
    a ``forward``."""

    kind: str
    """``list`` or ``dict``."""
    layers: int
    width: int
    seed: int
    batch_per_rank: int = 1

    def call(self, with_forward: bool) -> str:
        name = {"list": "ModuleList", "dict": "ModuleDict"}[self.kind]
        forward = "subclass with forward" if with_forward else "plain"
        return f"fully_shard({name} of {self.layers} Linear({self.width}, {self.width}), {forward})"


@dataclass(frozen=True)
class TorchInitCase:
    """A Linear stack (ReLU between) built on the meta device, ``fully_shard``-ed (each
    Linear, then the root), materialised with ``to_empty``, filled with a constant and
    initialised by torch's own ``reset_parameters`` after ``torch.manual_seed(seed)`` on
    every rank; then ``steps`` Adam steps (the optimizer built right after ``to_empty``, as
    upstream does) on each data-parallel rank's rows."""

    dims: tuple[int, ...]
    """Feature sizes, input first: ``(4, 3)`` is one Linear(4, 3)."""
    bias: bool
    dtype: str
    mesh_shape: tuple[int, ...]
    """``(world,)`` or ``(replicate, shard)`` (HSDP)."""
    default_mesh: bool
    """``fully_shard(module)`` with no mesh argument, called inside ``torch.device('meta')``
    (1-D only)."""
    seed: int
    steps: int = 2
    lr: float = 0.01
    batch_per_rank: int = 1

    def __post_init__(self) -> None:
        check_one_of("dtype", self.dtype, ("float32", "float64"))
        require(len(self.dims) >= 2, "dims", self.dims, "at least two sizes (one Linear)")
        require(len(self.mesh_shape) in (1, 2), "mesh_shape", self.mesh_shape, "1-D or 2-D")
        one_d = len(self.mesh_shape) == 1
        require(one_d or not self.default_mesh, "default_mesh", self.default_mesh, "1-D only")

    @property
    def shards(self) -> int:
        """Ranks a parameter is sharded over (the last mesh axis)."""
        return self.mesh_shape[-1]

    def call(self) -> str:
        mesh = "no mesh (default)" if self.default_mesh else f"mesh {self.mesh_shape}"
        return (
            f"torch.manual_seed({self.seed}); with torch.device('meta'): Linear stack "
            f"{self.dims} bias={self.bias} {self.dtype}; fully_shard each Linear and the root "
            f"({mesh}); to_empty; Adam(lr={self.lr}); fill 1337; reset_parameters(); "
            f"{self.steps} Adam step(s), batch {self.batch_per_rank}/data-parallel rank"
        )
