"""Cases of the checkpoint-loads properties: what a load is given that does not fit the
model it loads into (keys missing or unexpected, another shape or dtype), the options that
choose the keys of a state dict, a checkpoint read without a process group, and a save that
fails."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from harness.cases.state_dict import ReshardCase, StateDictCase
from harness.errors import check_int, check_one_of, check_subset, require

CHANGES = ("grown", "shrunk")
"""The loading model against the saved one: one Linear more (its keys are missing from what
is loaded), or one fewer (what is loaded holds keys the model lacks)."""
UNTP_LAYOUTS = ("fsdp", "hsdp")
"""Layouts whose MLP may have any number of layers (a TP plan names the layers it shards)."""
MISMATCHES = ("shape", "dtype")
"""The loading model's first Linear takes one more input feature, or every tensor is of the
other float dtype."""
MISMATCH_VIAS = ("dcp", "set_full", "set_sharded")
"""``dcp.load`` of a checkpoint saved at another world size, or ``set_model_state_dict`` of
a full or a sharded state dict taken in memory on the same ranks."""
FLOAT_DTYPES = ("float32", "float64")
TARGETS = ("same", "new")
"""Where the failing save writes: into the first checkpoint's directory, or a new one."""


def changed_dims(dims: tuple[int, ...], change: str) -> tuple[int, ...]:
    """An MLP's dims with one Linear more (``grown``) or one fewer (``shrunk``)."""
    check_one_of("change", change, CHANGES)
    if change == "grown":
        return (*dims, dims[-1])
    require(len(dims) >= 3, "dims", dims, "3 or more dims to shrink (2 Linears or more)")
    return dims[:-1]


def linear_keys(
    dims: tuple[int, ...], bias: bool, naming: str = "indexed", buffer: bool = False
) -> list[str]:
    """The state-dict keys of ``build_mlp``'s model of ``dims``: Linear, ReLU, Linear, ...,
    its children named as ``naming`` says (``child_names``); ``buffer``: the first Linear
    holds a registered buffer, ``BUFFER``, after its parameters."""
    names = ("weight", "bias") if bias else ("weight",)
    children = child_names(dims, naming)
    keys = []
    for i in range(len(dims) - 1):
        keys += [f"{children[2 * i]}.{name}" for name in names]
        keys += [f"{children[0]}.{BUFFER}"] if buffer and i == 0 else []
    return keys


NAMINGS = ("indexed", "prefixing")
"""How the MLP's children are named: ``nn.Sequential``'s indices (``0``, ``1``, ``2``...),
or names each Linear's sibling extends (``layer``, ``act1``, ``layer2``, ``act2``,
``layer3``: ``layer`` is a prefix of ``layer2``, as a user's ``encoder`` and ``encoder2``)."""
BUFFER = "running_mean"
"""The buffer a model of ``buffer=True`` registers on its first Linear."""


def child_names(dims: tuple[int, ...], naming: str) -> tuple[str, ...]:
    """The names of the MLP's children (Linear, ReLU, Linear, ...) under ``naming``."""
    check_one_of("naming", naming, NAMINGS)
    count = 2 * (len(dims) - 1) - 1
    if naming == "indexed":
        return tuple(str(i) for i in range(count))
    linear = ["layer" if i == 0 else f"layer{i + 1}" for i in range(len(dims) - 1)]
    return tuple(linear[i // 2] if i % 2 == 0 else f"act{i // 2 + 1}" for i in range(count))


def _with_dims(case: StateDictCase, dims: tuple[int, ...]) -> StateDictCase:
    return replace(case, train=replace(case.train, dims=dims))


def _refresh(case: StateDictCase) -> StateDictCase:
    """``case`` from another seed: a load that does nothing shows."""
    return replace(case, train=replace(case.train, seed=(case.train.seed + 1) % 2**32))


@dataclass(frozen=True)
class PartialLoadCase:
    """A model saved by ``reshard.save`` (``dcp.save``), loaded by ``reshard.load``'s layout
    and world size into a model one Linear ``change``d (``CHANGES``), strictly (the default
    planner) and with ``DefaultLoadPlanner(allow_partial_load=True)``."""

    reshard: ReshardCase
    change: str

    def __post_init__(self) -> None:
        check_one_of("change", self.change, CHANGES)
        for side in ("save", "load"):
            layout = getattr(self.reshard, side).train.layout
            check_one_of(f"reshard.{side}.train.layout", layout, UNTP_LAYOUTS)
        changed_dims(self.reshard.save.train.dims, self.change)

    @property
    def loading(self) -> StateDictCase:
        load = self.reshard.load
        return _with_dims(load, changed_dims(load.train.dims, self.change))

    @property
    def loading_size(self) -> int:
        return math.prod(self.reshard.load.train.mesh_shape)

    def call(self) -> str:
        return (
            f"{self.reshard.call()}, the loading model {self.change} by one Linear "
            f"{self.loading.train.dims}; dcp.load(planner=DefaultLoadPlanner("
            "allow_partial_load=False | True))"
        )


@dataclass(frozen=True)
class StrictSetCase:
    """``case``'s model state dict (full or sharded) set into a fresh model one Linear
    ``change``d, by ``set_state_dict`` (``joint``) or ``set_model_state_dict``, with
    ``StateDictOptions(strict=strict, full_state_dict=full)``; where ``broadcast``, with
    ``broadcast_from_rank0=True`` too, rank 0 alone given the full state dict (the others an
    empty one)."""

    case: StateDictCase
    change: str
    full: bool
    joint: bool
    strict: bool
    broadcast: bool = False

    def __post_init__(self) -> None:
        check_one_of("change", self.change, CHANGES)
        # StateDictOptions refuses broadcast_from_rank0 without full_state_dict
        require(self.full or not self.broadcast, "broadcast", self.broadcast, "False unless full")
        check_one_of("case.train.layout", self.case.train.layout, UNTP_LAYOUTS)
        changed_dims(self.case.train.dims, self.change)

    @property
    def loading(self) -> StateDictCase:
        return _refresh(_with_dims(self.case, changed_dims(self.case.train.dims, self.change)))

    def call(self) -> str:
        how = "set_state_dict" if self.joint else "set_model_state_dict"
        broadcast = ", broadcast_from_rank0=True" if self.broadcast else ""
        given = " (rank 0's; the others {})" if self.broadcast else ""
        return (
            f"{self.case.call()}; {how}(a model {self.change} by one Linear "
            f"{self.loading.train.dims}, its state dict{given}, options=StateDictOptions("
            f"full_state_dict={self.full}{broadcast}, strict={self.strict}))"
        )


@dataclass(frozen=True)
class MismatchCase:
    """A state dict of ``reshard.save``'s model loaded ``via`` (``MISMATCH_VIAS``) into a
    model whose tensors differ by ``mismatch`` (``MISMATCHES``): at ``reshard.load``'s layout
    and world size through DCP, on the saving ranks in memory."""

    reshard: ReshardCase
    mismatch: str
    via: str

    def __post_init__(self) -> None:
        check_one_of("mismatch", self.mismatch, MISMATCHES)
        check_one_of("via", self.via, MISMATCH_VIAS)
        for side in ("save", "load"):
            dtype = getattr(self.reshard, side).train.dtype
            check_one_of(f"reshard.{side}.train.dtype", dtype, FLOAT_DTYPES)

    @property
    def loading(self) -> StateDictCase:
        base = self.reshard.load if self.via == "dcp" else _refresh(self.reshard.save)
        train = base.train
        if self.mismatch == "shape":
            return _with_dims(base, (train.dims[0] + 1, *train.dims[1:]))
        other = FLOAT_DTYPES[1 - FLOAT_DTYPES.index(self.reshard.save.train.dtype)]
        return replace(base, train=replace(train, dtype=other))

    @property
    def load_size(self) -> int:
        return math.prod(self.loading.train.mesh_shape)

    def call(self) -> str:
        load = self.loading.train
        into = f"a model of dims {load.dims} in {load.dtype}"
        how = {
            "dcp": f"dcp.load at world size {self.load_size} ({load.layout}, {load.mesh_shape})",
            "set_full": "set_model_state_dict(full_state_dict=True)",
            "set_sharded": "set_model_state_dict(sharded)",
        }[self.via]
        return f"{self.reshard.save.call()}; {how} into {into}"


WRAPPERS = ("fully_shard", "ddp")
"""What wraps the model of a key-options case: its layout's ``fully_shard`` (and TP), or
``DistributedDataParallel`` (whose FQNs carry ``module.``, which the state-dict API drops)."""


@dataclass(frozen=True)
class KeyOptionsCase:
    """``get_model_state_dict`` of ``case``'s model (its children named as ``naming`` says,
    a buffer on its first Linear, under ``wrapper``) with ``frozen`` parameters
    (``requires_grad=False``) under ``StateDictOptions(ignore_frozen_params, full_state_dict,
    cpu_offload)``, set into a fresh model with ``strict``; where ``submodule`` (a Linear's
    index in the Sequential) is set, also of ``submodules={model[submodule]}`` with
    ``keep_submodule_prefixes`` (and ``ignore_frozen_params`` only where nothing is frozen:
    torch 2.13 raises KeyError for the two with a frozen parameter anywhere)."""

    case: StateDictCase
    frozen: tuple[str, ...]
    ignore_frozen: bool
    full: bool
    cpu_offload: bool
    submodule: int | None
    keep_prefixes: bool
    strict: bool
    wrapper: str = "fully_shard"
    naming: str = "indexed"
    buffer: bool = False

    def __post_init__(self) -> None:
        check_one_of("wrapper", self.wrapper, WRAPPERS)
        check_one_of("naming", self.naming, NAMINGS)
        if self.naming != "indexed" and self.wrapper == "fully_shard":
            layout = self.case.train.layout
            check_one_of("case.train.layout", layout, UNTP_LAYOUTS)  # a TP plan names "0", "2"
        keys = linear_keys(self.case.train.dims, self.case.train.bias, self.naming)
        check_subset("frozen", self.frozen, keys)
        if self.submodule is not None:
            check_int("submodule", self.submodule, 0)
            linears = range(0, 2 * (len(self.case.train.dims) - 1), 2)
            check_one_of("submodule", self.submodule, tuple(linears))

    @property
    def names(self) -> tuple[str, ...]:
        """The model's children's names."""
        return child_names(self.case.train.dims, self.naming)

    @property
    def keys(self) -> list[str]:
        """The model's keys, in order."""
        train = self.case.train
        return linear_keys(train.dims, train.bias, self.naming, self.buffer)

    @property
    def expected_keys(self) -> list[str]:
        """The keys the whole model's state dict has: frozen ones left out with
        ``ignore_frozen``."""
        return [k for k in self.keys if not (self.ignore_frozen and k in self.frozen)]

    @property
    def submodule_ignores_frozen(self) -> bool:
        return self.ignore_frozen and not self.frozen

    @property
    def submodule_prefix(self) -> str:
        assert self.submodule is not None
        return f"{self.names[self.submodule]}."

    @property
    def submodule_keys(self) -> list[str]:
        """The keys of the submodule's state dict, without its prefix unless
        ``keep_prefixes``."""
        prefix = self.submodule_prefix
        mine = [k for k in self.keys if k.startswith(prefix)]
        return mine if self.keep_prefixes else [k.removeprefix(prefix) for k in mine]

    def options(self) -> str:
        return (
            f"StateDictOptions(ignore_frozen_params={self.ignore_frozen}, "
            f"full_state_dict={self.full}, cpu_offload={self.cpu_offload}, strict={self.strict})"
        )

    def call(self) -> str:
        model = f"children {list(self.names)}" + (f", {BUFFER} buffer" if self.buffer else "")
        wrapped = "DistributedDataParallel" if self.wrapper == "ddp" else "its layout"
        sub = ""
        if self.submodule is not None:
            sub = (
                f"; get_model_state_dict(model, submodules={{model.{self.names[self.submodule]}}}"
                f", keep_submodule_prefixes={self.keep_prefixes}, ignore_frozen_params="
                f"{self.submodule_ignores_frozen}, ...)"
            )
        return (
            f"{self.case.call()}; {model} under {wrapped}; frozen {list(self.frozen)}; "
            f"get_model_state_dict(model, options={self.options()}), set_model_state_dict(fresh "
            f"model, ...){sub}"
        )


@dataclass(frozen=True)
class FailedSaveCase:
    """``case``'s model saved (``dcp.save``) into a directory, then a freshly initialised one
    saved into ``target`` (``TARGETS``) through a ``FileSystemWriter`` whose ``write_data``
    raises on ``failing_rank``; then the first directory loaded at ``load``'s layout."""

    case: StateDictCase
    failing_rank: int
    target: str
    load: StateDictCase

    def __post_init__(self) -> None:
        check_one_of("target", self.target, TARGETS)
        size = math.prod(self.case.train.mesh_shape)
        check_one_of("failing_rank", self.failing_rank, range(size))

    @property
    def second(self) -> StateDictCase:
        """The model of the failing save: another seed."""
        return _refresh(self.case)

    def call(self) -> str:
        into = "the same directory" if self.target == "same" else "a new directory"
        size = math.prod(self.load.train.mesh_shape)
        return (
            f"{self.case.call()}; dcp.save into D; dcp.save of another model into {into}, "
            f"FileSystemWriter.write_data raising on rank {self.failing_rank}; dcp.load(D) at "
            f"world size {size} ({self.load.train.layout}, {self.load.train.mesh_shape})"
        )
