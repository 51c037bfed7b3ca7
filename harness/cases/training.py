"""Cases of the optimizer-parity and ZeRO properties: models, optimizers, training layouts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from harness.cases import seeded_arrays
from harness.cases.comm_hooks import CommHook
from harness.cases.knobs import NO_KNOBS, Knobs, Precision
from harness.cases.schedules import Clipping, Schedule
from harness.errors import check_one_of, require
from specs.placements import Placement


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


OPTIMIZERS = (
    *("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "Adadelta"),
    *("ASGD", "Rprop", "Adafactor"),
)
"""Every ``torch.optim`` optimizer a training step drives (LBFGS needs a closure)."""
CORE_OPTIMIZERS = ("SGD", "Adam", "AdamW")
"""The optimizers every training property draws. The optimizer-parity properties (training
under each layout against one device) draw all of ``OPTIMIZERS``; the state-dict, HSDP, TP
and ZeRO properties keep to these until what the others met there is pinned (README)."""
IMPLEMENTATIONS = ("default", "foreach", "fused")
FUSED = ("SGD", "Adam", "AdamW", "Adagrad")
"""The optimizers with a fused implementation (torch.optim's ``fused``)."""
FUSED_CPU_ONLY = ("Adagrad",)
"""Those whose fused kernel torch has on the CPU only (documented; on CUDA its constructor
refuses: "`fused=True` requires all the params to be ... of supported devices")."""
LAYOUTS = ("fsdp", "hsdp", "fsdp_tp", "hsdp_tp", "ddp", "zero")
TP_LAYOUTS = ("fsdp_tp", "hsdp_tp")
"""Layouts whose last mesh axis is tensor-parallel (a Colwise/Rowwise two-layer MLP)."""
FSDP_LAYOUTS = ("fsdp", "hsdp", "fsdp_tp", "hsdp_tp")
"""Layouts that call ``fully_shard``: the ones knobs and precision policies apply to."""


DDP_GROUPS = {
    "process_group": "<the world's 1-D mesh's group>",
    "device_mesh": "<the world's 1-D mesh>",
}
"""DDP's group options (one at most) and how a case spells the value it passes: the
group of the ranks, or a 1-D ``DeviceMesh`` over them."""


def delayable_parameters(dims: tuple[int, ...], bias: bool, first: int) -> tuple[str, ...]:
    """The names of the parameters of an MLP of ``dims`` (Linear, ReLU, Linear, ...)
    from its Linear number ``first`` on: what ``delay_all_reduce_named_params`` names."""
    linears = range(first, len(dims) - 1)
    kinds = ("weight", "bias") if bias else ("weight",)
    return tuple(f"{2 * index}.{kind}" for index in linears for kind in kinds)


def data_parallel(layout: str, mesh: tuple[int, ...]) -> int:
    """Ranks that see different data: all but the tensor-parallel axis."""
    tp = mesh[-1] if layout in TP_LAYOUTS else 1
    return math.prod(mesh) // tp


def shard_size(layout: str, mesh: tuple[int, ...]) -> int:
    """Ranks of the mesh axis ``fully_shard`` shards over (its reduce-scatter group): the
    last axis but TP's."""
    check_one_of("layout", layout, FSDP_LAYOUTS)
    return mesh[-2] if layout in TP_LAYOUTS else mesh[-1]


@dataclass(frozen=True)
class OptimConfig:
    """A ``torch.optim`` optimizer, its implementation and hyper-parameters, an optional
    second parameter group (the biases) with other hyper-parameters, an optional lr
    schedule."""

    name: str
    impl: str
    lr: float
    options: tuple[tuple[str, Any], ...] = ()
    second_group: tuple[tuple[str, Any], ...] | None = None
    scheduler: Schedule | None = None
    tensor_lr: bool = False
    """The learning rate given as a 0-d tensor (``lr=torch.tensor(lr)``)."""

    def __post_init__(self) -> None:
        check_one_of("name", self.name, OPTIMIZERS)
        check_one_of("impl", self.impl, IMPLEMENTATIONS)
        fused = f"an optimizer with a fused implementation, one of {FUSED!r}, where impl='fused'"
        require(self.impl != "fused" or self.name in FUSED, "name", self.name, fused)

    def kwargs(self) -> dict[str, Any]:
        """Constructor keyword arguments (the first group's hyper-parameters; the lr as a
        float even where ``tensor_lr``: the optimizer's builder makes it a tensor)."""
        chosen = {"lr": self.lr, **dict(self.options)}
        if self.impl != "default":
            chosen[self.impl] = True
        return chosen

    def describe(self) -> str:
        kwargs = self.kwargs()
        if self.tensor_lr:
            kwargs["lr"] = f"tensor({self.lr})"
        options = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        extra = f", biases: {dict(self.second_group)}" if self.second_group else ""
        lr_steps = f", {self.scheduler.describe()}" if self.scheduler else ""
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
    precision: Precision | None
    """FSDP's ``MixedPrecisionPolicy`` per module (None: every module in ``dtype``)."""
    seed: int
    micro_batches: int = 1
    """Each data-parallel rank's rows of a step split into this many equal micro-batches,
    gradients accumulated without a gradient sync until the last one."""
    sync_each_micro_batch: bool = False
    """Sync (reduce) the gradients after every micro-batch, accumulating the reduced ones."""
    clipping: Clipping | None = None
    comm_hook: CommHook | None = None
    """ddp, zero: the communication hook registered on the DDP model."""
    wrapper_options: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments of the DDP constructor (ddp, zero) or of every ``fully_shard``."""
    knobs: Knobs = NO_KNOBS
    dropout: float = 0.0
    """Each Linear followed by ``Dropout(dropout)`` in a unit of its own (0: none)."""

    def __post_init__(self) -> None:
        check_one_of("layout", self.layout, LAYOUTS)
        micro, rows = self.micro_batches, self.batch_per_rank
        divides = micro >= 1 and rows % micro == 0
        require(divides, "micro_batches", micro, f">= 1 and divide batch_per_rank={rows!r}")
        sharded = self.layout in FSDP_LAYOUTS
        if self.precision is not None:
            require(sharded, "precision", self.precision, f"None for layout={self.layout!r}")
            linears = len(self.dims) - 1
            count = len(self.precision.layer_dtypes)
            require(count == linears, "precision", self.precision, f"{linears} layer_dtypes")
        hooked = self.comm_hook is None or self.layout in ("ddp", "zero")
        require(hooked, "comm_hook", self.comm_hook, f"None for layout={self.layout!r}")
        if self.knobs != NO_KNOBS:
            require(sharded, "knobs", self.knobs, f"Knobs() for layout={self.layout!r}")
            self._check_knobs()

    def _check_knobs(self) -> None:
        knobs, size = self.knobs, self.shard_size
        factor = knobs.divide_factor
        require(factor is None or factor > 0, "divide_factor", factor, "None or > 0")
        to = knobs.reshard_to
        proper = to is None or (1 < to < size and size % to == 0)
        require(proper, "reshard_to", to, f"None or a divisor of {size} in 2..{size - 1}")
        hsdp = self.layout in ("hsdp", "hsdp_tp")
        held = knobs.hold_all_reduce
        require(hsdp or not held, "hold_all_reduce", held, f"False for {self.layout!r}")
        flat = knobs.flatten
        fits = flat is None or (self.layout == "fsdp" and flat[0] * flat[1] == self.mesh_shape[0])
        require(fits, "flatten", flat, f"None or a 2-D shape of {self.mesh_shape} (fsdp only)")

    @property
    def shard_size(self) -> int:
        return shard_size(self.layout, self.mesh_shape)

    @property
    def data_parallel(self) -> int:
        return data_parallel(self.layout, self.mesh_shape)

    @property
    def gradient_scale(self) -> float:
        """What the gradients are multiplied by against one device's: data-parallel size /
        divide factor (1 unless a factor is set)."""
        factor = self.knobs.divide_factor
        return 1.0 if factor is None else self.data_parallel / factor

    def call(self) -> str:
        precision = f", {self.precision.describe()}" if self.precision else ""
        knobs = self.knobs.describe()
        precision += f", knobs: {knobs}" if knobs else ""
        precision += f", dropout {self.dropout}" if self.dropout else ""
        synced = ", each synced" if self.sync_each_micro_batch else ""
        micro = f" in {self.micro_batches} micro-batches{synced}" if self.micro_batches > 1 else ""
        clip = f", {self.clipping.describe()}" if self.clipping is not None else ""
        options = ", ".join(f"{k}={v}" for k, v in self.wrapper_options)
        if self.comm_hook is not None:
            options = (options + ", " if options else "") + self.comm_hook.describe()
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
    differentiable: bool = False
    """``differentiable=True``: the parameters are clones of leaves and the gradients clones
    of leaves too, the steps recorded by autograd; afterwards the sum of the parameters
    weighted by ``weights()`` is differentiated back to both leaves."""
    idle: tuple[tuple[int, int], ...] = ()
    """``(step, parameter)`` pairs where that parameter has no gradient (``grad`` None):
    the step skips it, so parameters of one group reach different step counts."""

    def __post_init__(self) -> None:
        for step, index in self.idle:
            require(
                0 <= step < self.steps and 0 <= index < len(self.shapes),
                "idle",
                self.idle,
                f"(step, parameter) pairs within {self.steps} step(s) and "
                f"{len(self.shapes)} parameter(s)",
            )
        require(
            not (self.differentiable and self.idle), "idle", self.idle, "() when differentiable"
        )

    def weights(self) -> list[np.ndarray]:
        """The weights of the loss a differentiable run back-propagates."""
        return seeded_arrays((self.seed, 0, 1), self.shapes, self.dtype)

    def params(self) -> list[np.ndarray]:
        """The initial parameters, rounded to ``dtype`` and held in float64."""
        return seeded_arrays((self.seed, 0), self.shapes, self.dtype)

    def grads(self, step: int) -> list[np.ndarray]:
        """The gradients of ``step``, rounded to ``dtype`` and held in float64."""
        return seeded_arrays((self.seed, step + 1), self.shapes, self.dtype)

    def given_grads(self, step: int) -> list[np.ndarray | None]:
        """``grads(step)``, None for the parameters ``idle`` at ``step``."""
        return [None if (step, i) in self.idle else g for i, g in enumerate(self.grads(step))]

    def call(self) -> str:
        layout = (
            "plain tensors"
            if self.placements is None
            else f"DTensors on mesh {self.mesh_shape} with placements {list(self.placements)}"
        )
        differentiable = ", differentiable=True, backward to params and grads" * bool(
            self.differentiable
        )
        idle = f", no grad at (step, param) {list(self.idle)}" if self.idle else ""
        return (
            f"{self.steps} step(s) of {self.optim.describe()}{differentiable} on {self.dtype} "
            f"params {list(self.shapes)} as {layout}{idle}"
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
    """Uneven inputs: rank r trains on ``inputs + r`` batches (``inputs`` where not
    ``uneven``) for ``epochs`` epochs, under ``DistributedDataParallel.join`` with the
    three options it takes."""

    dims: tuple[int, ...]
    inputs: int
    epochs: int
    lr: float
    seed: int
    bias: bool = True
    dtype: str = "float64"
    uneven: bool = True
    divide_by_initial_world_size: bool = True
    enable: bool = True
    throw_on_early_termination: bool = False

    def __post_init__(self) -> None:
        # join(enable=False) leaves a rank that ran out of inputs out of the others'
        # collectives: uneven inputs would hang them, as the docs say.
        hangs = self.uneven and not self.enable
        require(not hangs, "uneven", self.uneven, "False where enable=False")

    def batches_of(self, rank: int) -> int:
        """The batches ``rank`` trains on in one epoch."""
        return self.inputs + rank if self.uneven else self.inputs

    def join_options(self) -> dict[str, bool]:
        """``DistributedDataParallel.join``'s keyword arguments."""
        return {
            "divide_by_initial_world_size": self.divide_by_initial_world_size,
            "enable": self.enable,
            "throw_on_early_termination": self.throw_on_early_termination,
        }

    def call(self) -> str:
        options = ", ".join(f"{k}={v}" for k, v in self.join_options().items())
        batches = f"{self.inputs} + rank" if self.uneven else f"{self.inputs}"
        return (
            f"with DistributedDataParallel(MLP{self.dims}, bias={self.bias}).join({options}): "
            f"{self.epochs} epoch(s) of {batches} batch(es) of SGD(lr={self.lr}), {self.dtype}"
        )
