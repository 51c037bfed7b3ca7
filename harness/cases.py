"""The concrete cases strategies draw and ranks receive: small, picklable, readable reprs.

A case holds only plain values (tuples, ints, strings and the torch-free placements of
``specs.placements``). Every rank derives its tensors from ``seed``, so every rank sees the
same global input without drawing anything itself.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from specs.placements import Partial, Placement

DTYPES = ("float32", "float64", "bfloat16", "int64")
# The largest magnitude a global value may have: every partial sum the placement properties
# form stays below 256, where bfloat16 still represents every integer exactly.
_MAX_MAGNITUDE = 64


def partial_sum_factor(mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]) -> int:
    """Product of the sizes of the mesh axes holding ``Partial('sum')``."""
    sizes = [m for m, p in zip(mesh_shape, placements, strict=True) if p == Partial("sum")]
    return math.prod(sizes)


@functools.lru_cache(maxsize=64)
def integer_array(shape: tuple[int, ...], seed: int, *, multiple_of: int = 1) -> np.ndarray:
    """Seeded integer-valued float64 array, every value a multiple of ``multiple_of``.

    Integer values keep sums, averages over the mesh and divisions by ``multiple_of`` exact
    in every dtype the cases use, so placement properties can compare exactly. The array is
    read-only and memoised: every rank thread and the driver ask for the same one.
    """
    if multiple_of < 1:
        raise ValueError(f"multiple_of={multiple_of!r} must be a positive int")
    bound = max(0, _MAX_MAGNITUDE // multiple_of)
    rng = np.random.default_rng(seed)
    values = rng.integers(-bound, bound + 1, size=shape) * multiple_of
    array = np.asarray(values, dtype=np.float64)  # a 0-d draw comes back as a numpy scalar
    array.flags.writeable = False
    return array


@dataclass(frozen=True)
class DistributeCase:
    """``distribute_tensor(global, mesh(mesh_shape), placements)``."""

    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: str
    seed: int
    src_data_rank: int | None = 0
    """``distribute_tensor``'s source: the group rank, on every mesh axis, whose tensor is
    the global one; None: every rank keeps pieces of its own tensor, no communication."""

    def global_array(self) -> np.ndarray:
        # distribute_tensor divides a Partial('sum') value by the axis size: keep it exact.
        factor = partial_sum_factor(self.mesh_shape, self.placements)
        return integer_array(self.shape, self.seed, multiple_of=factor)

    def source_rank(self) -> int | None:
        """The rank at mesh coordinate ``(src_data_rank,) * mesh ndim``."""
        if self.src_data_rank is None:
            return None
        stride = math.prod(self.mesh_shape)
        rank = 0
        for size in self.mesh_shape:
            stride //= size
            rank += self.src_data_rank * stride
        return rank

    def input_of(self, rank: int) -> np.ndarray:
        """What ``rank`` passes to ``distribute_tensor``: the global array on the source
        rank, another seeded array on every other rank (the source's must win)."""
        if rank == self.source_rank():
            return self.global_array()
        factor = partial_sum_factor(self.mesh_shape, self.placements)
        return integer_array(self.shape, self.seed + 1 + rank, multiple_of=factor)

    def call(self) -> str:
        source = "" if self.src_data_rank == 0 else f", src_data_rank={self.src_data_rank}"
        return (
            f"distribute_tensor(shape={self.shape}, dtype={self.dtype}, "
            f"mesh={self.mesh_shape}, placements={self.placements}{source})"
        )


@dataclass(frozen=True)
class OpCase:
    """``op(distribute_tensor(...), dim, keepdim)`` for each ``(dim, keepdim)`` of
    ``applications``, in order on the same DTensor, against the op on the global tensor."""

    source: DistributeCase
    op: str
    applications: tuple[tuple[int, bool], ...]

    def __post_init__(self) -> None:
        if not self.applications:
            raise ValueError(f"applications={self.applications!r} must name at least one")

    def call(self, index: int | None = None) -> str:
        chosen = self.applications if index is None else self.applications[index : index + 1]
        calls = ", then ".join(f"{self.op}(dim={d}, keepdim={k})" for d, k in chosen)
        return f"{calls} of {self.source.call()}"


@dataclass(frozen=True)
class ReshapeCase:
    """``distribute_tensor(...).view(target)`` (or ``.reshape``) against one device's."""

    source: DistributeCase
    target: tuple[int, ...]
    method: str
    """``view`` or ``reshape``."""

    def __post_init__(self) -> None:
        if self.method not in ("view", "reshape"):
            raise ValueError(f"method={self.method!r} must be 'view' or 'reshape'")
        if math.prod(self.target) != math.prod(self.source.shape):
            raise ValueError(
                f"target={self.target!r} must hold the {math.prod(self.source.shape)} elements "
                f"of shape {self.source.shape!r}"
            )

    def call(self) -> str:
        return f"{self.method}{self.target} of {self.source.call()}"


@dataclass(frozen=True)
class RedistributeCase:
    """``DTensor.from_local(model locals, mesh, src).redistribute(mesh, dst)``."""

    mesh_shape: tuple[int, ...]
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: str
    seed: int

    def global_array(self) -> np.ndarray:
        return integer_array(self.shape, self.seed)

    def call(self) -> str:
        return (
            f"redistribute(shape={self.shape}, dtype={self.dtype}, mesh={self.mesh_shape}, "
            f"{self.src} -> {self.dst})"
        )


@dataclass(frozen=True)
class MLPCase:
    """A Linear/ReLU stack trained for one optimizer step, sharded or on one device."""

    dims: tuple[int, ...]
    """Feature sizes, input first: ``(4, 3, 2)`` is Linear(4, 3), ReLU, Linear(3, 2)."""
    bias: bool
    shard_layers: bool
    """``fully_shard`` each Linear before the root (several groups) or only the root."""
    batch_per_rank: int
    lr: float
    momentum: float
    dtype: str
    seed: int

    def call(self) -> str:
        return (
            f"fully_shard(MLP{self.dims}, bias={self.bias}, shard_layers={self.shard_layers}) "
            f"+ SGD(lr={self.lr}, momentum={self.momentum}), batch {self.batch_per_rank}/rank, "
            f"{self.dtype}"
        )


OPTIMIZERS = ("SGD", "Adam", "AdamW")
IMPLEMENTATIONS = ("default", "foreach", "fused")
LAYOUTS = ("fsdp", "hsdp", "fsdp_tp", "hsdp_tp", "ddp", "zero")
TP_LAYOUTS = ("fsdp_tp", "hsdp_tp")
"""Layouts whose last mesh axis is tensor-parallel (a Colwise/Rowwise two-layer MLP)."""


@dataclass(frozen=True)
class OptimConfig:
    """A ``torch.optim`` optimizer, its implementation and hyper-parameters, an optional
    second parameter group (the biases) with other hyper-parameters, an optional StepLR."""

    name: str
    impl: str
    lr: float
    options: tuple[tuple[str, Any], ...] = ()
    second_group: tuple[tuple[str, Any], ...] | None = None
    scheduler: tuple[int, float] | None = None
    """``(step_size, gamma)`` of a ``StepLR``."""

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"name={self.name!r} must be one of {OPTIMIZERS}")
        if self.impl not in IMPLEMENTATIONS:
            raise ValueError(f"impl={self.impl!r} must be one of {IMPLEMENTATIONS}")

    def kwargs(self) -> dict[str, Any]:
        """Constructor keyword arguments (the first group's hyper-parameters)."""
        chosen = {"lr": self.lr, **dict(self.options)}
        if self.impl != "default":
            chosen[self.impl] = True
        return chosen

    def describe(self) -> str:
        options = ", ".join(f"{k}={v}" for k, v in self.kwargs().items())
        extra = f", biases: {dict(self.second_group)}" if self.second_group else ""
        lr_steps = f", StepLR{self.scheduler}" if self.scheduler else ""
        return f"{self.name}({options}){extra}{lr_steps}"


@dataclass(frozen=True)
class ParityCase:
    """Train an MLP for ``steps`` steps under ``layout`` and on one device, then compare."""

    layout: str
    mesh_shape: tuple[int, ...]
    """``(world,)`` for fsdp/ddp/zero; ``(replicate, shard)`` for hsdp; ``(dp, tp)`` for
    fsdp_tp; ``(replicate, shard, tp)`` for hsdp_tp."""
    dims: tuple[int, ...]
    bias: bool
    batch_per_rank: int
    dtype: str
    optim: OptimConfig
    steps: int
    mixed_precision: bool
    """FSDP's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``."""
    seed: int
    micro_batches: int = 1
    """Each data-parallel rank's rows of a step split into this many equal micro-batches,
    gradients accumulated without a gradient sync until the last one."""
    sync_each_micro_batch: bool = False
    """Sync (reduce) the gradients after every micro-batch, accumulating the reduced ones."""
    clip_norm: float | None = None
    """``clip_grad_norm_`` of all parameters to this total norm before each step."""
    clip_norm_type: float = 2.0
    """The norm ``clip_grad_norm_`` measures (2, 1 or inf)."""
    wrapper_options: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments of the DDP constructor (ddp, zero) or of every ``fully_shard``."""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} must be one of {LAYOUTS}")
        if self.micro_batches < 1 or self.batch_per_rank % self.micro_batches:
            raise ValueError(
                f"micro_batches={self.micro_batches!r} must be >= 1 and divide "
                f"batch_per_rank={self.batch_per_rank!r}"
            )

    @property
    def data_parallel(self) -> int:
        """Ranks that see different data: all but the tensor-parallel axis."""
        tp = self.mesh_shape[-1] if self.layout in TP_LAYOUTS else 1
        return math.prod(self.mesh_shape) // tp

    def call(self) -> str:
        precision = ", bf16 params/fp32 reduce" if self.mixed_precision else ""
        synced = ", each synced" if self.sync_each_micro_batch else ""
        micro = f" in {self.micro_batches} micro-batches{synced}" if self.micro_batches > 1 else ""
        clip = (
            f", clip_grad_norm_({self.clip_norm}, norm_type={self.clip_norm_type})"
            if self.clip_norm is not None
            else ""
        )
        options = ", ".join(f"{k}={v}" for k, v in self.wrapper_options)
        return (
            f"{self.layout}({options}{', ' if options else ''}mesh={self.mesh_shape}) "
            f"MLP{self.dims} bias={self.bias} "
            f"{self.dtype}{precision}, {self.steps} step(s) of {self.optim.describe()}{clip}, "
            f"batch {self.batch_per_rank}/data-parallel rank{micro}"
        )


@dataclass(frozen=True)
class ParamsCase:
    """Free-standing parameters of ``shapes`` (seeded, float64) stepped by an optimizer with
    seeded gradients that are the same on every rank (as if already averaged)."""

    shapes: tuple[tuple[int, ...], ...]
    optim: OptimConfig
    steps: int
    seed: int
    lr_after_load: float = 0.5
    """The lr a second optimizer is built with before it loads the first one's state."""
    steps_after: int = 1
    recipient: int = 0
    """The rank ``consolidate_state_dict`` gathers the state on."""

    def call(self) -> str:
        return (
            f"{self.optim.describe()} on params {list(self.shapes)}, {self.steps} step(s), "
            f"state to rank {self.recipient}, reload with lr={self.lr_after_load}, "
            f"{self.steps_after} more step(s)"
        )


@dataclass(frozen=True)
class StepCase:
    """Parameters of ``shapes`` laid out by ``placements`` (one tuple per parameter, one
    placement per mesh axis; plain tensors on every rank when None) stepped ``steps`` times
    by ``optim`` with seeded gradients that are the same on every rank."""

    mesh_shape: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    placements: tuple[tuple[Placement, ...], ...] | None
    dtype: str
    optim: OptimConfig
    steps: int
    seed: int

    def params(self) -> list[np.ndarray]:
        """The initial parameters, rounded to ``dtype`` and held in float64."""
        rng = np.random.default_rng([self.seed, 0])
        return [self._rounded(rng.uniform(-1.0, 1.0, size=shape)) for shape in self.shapes]

    def grads(self, step: int) -> list[np.ndarray]:
        """The gradients of ``step``, rounded to ``dtype`` and held in float64."""
        rng = np.random.default_rng([self.seed, step + 1])
        return [self._rounded(rng.uniform(-1.0, 1.0, size=shape)) for shape in self.shapes]

    def _rounded(self, array: np.ndarray) -> np.ndarray:
        return np.asarray(array, dtype=self.dtype).astype(np.float64)

    def call(self) -> str:
        layout = (
            "plain tensors"
            if self.placements is None
            else f"DTensors on mesh {self.mesh_shape} with placements {list(self.placements)}"
        )
        return (
            f"{self.steps} step(s) of {self.optim.describe()} on {self.dtype} params "
            f"{list(self.shapes)} as {layout}"
        )


@dataclass(frozen=True)
class PartitionCase:
    """Parameter groups of these element counts; optionally one group added afterwards."""

    groups: tuple[tuple[int, ...], ...]
    added: tuple[int, ...] | None

    def all_groups(self) -> tuple[tuple[int, ...], ...]:
        return self.groups if self.added is None else (*self.groups, self.added)


@dataclass(frozen=True)
class OverlapCase:
    """DDP with a ZeRO step inside its communication hook, against DDP and a local SGD."""

    dims: tuple[int, ...]
    inputs: int
    interleaved: bool
    gradient_as_bucket_view: bool
    static_graph: bool
    shard_buckets: bool
    seed: int
    bias: bool = True
    dtype: str = "float64"


@dataclass(frozen=True)
class JoinCase:
    """Uneven inputs: rank r trains on ``inputs + r`` batches for ``epochs`` epochs."""

    dims: tuple[int, ...]
    inputs: int
    epochs: int
    lr: float
    seed: int
    bias: bool = True
    dtype: str = "float64"


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
        if self.train.layout not in SHARDED_LAYOUTS:
            raise ValueError(f"train.layout={self.train.layout!r} must be one of {SHARDED_LAYOUTS}")
        if self.train.optim.scheduler is not None:
            raise ValueError(f"train.optim.scheduler={self.train.optim.scheduler!r} must be None")

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
        raise ValueError(f"world_size={world_size!r} has no layout in {self.layouts}")

    def call(self) -> str:
        steps = " ".join(f"{a}({n})" if a in ("train", "resize") else a for a, n in self.actions)
        meshes = ", ".join(f"{n}: {layout}{mesh}" for n, layout, mesh in self.layouts)
        return f"{self.base.call()}; start at {self.start} rank(s): {steps} [{meshes}]"
