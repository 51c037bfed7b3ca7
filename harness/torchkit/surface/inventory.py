"""The in-scope public API, per area: each callable and its options, for the running torch.

``CALLABLES`` is the curated part: which public callables are in scope, by area, and per
callable the parameters that are not options. Everything else comes from the callables'
signatures (``inspect.signature``) in the torch that runs, so an option a release adds or
drops is in or out of its inventory by itself, and a callable a release lacks is skipped.

An option is a parameter a caller chooses: not ``self``/``cls``, not ``*args``/``**kwargs``,
not a private one (``_name``), and not one of the data a call works on (``DATA_INPUTS``:
the module, the parameters, the tensor, the state dict, a location on disk).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.torchkit.surface.values import summary

AREAS = ("dtensor", "tp", "fsdp2", "fsdp1", "ddp_zero", "state_dict", "optim", "checkpoint_compile")

DATA_INPUTS = frozenset(
    {
        "self", "cls", "module", "model", "params", "parameters", "tensor", "tensors",
        "local_tensor", "input", "optimizer", "optimizers", "state_dict", "model_state_dict",
        "optim_state_dict", "function", "path", "checkpoint_id",
    }
)  # fmt: skip
"""Parameters that name what a call works on, not how: never options. A location on disk
(``path``, ``checkpoint_id``) is a fresh temporary directory each time, not a choice."""


@dataclass(frozen=True)
class Entry:
    """One curated callable: ``module:Qual.name`` (a class stands for its ``__init__``)."""

    area: str
    path: str
    not_options: tuple[str, ...] = ()


def _entries(area: str, module: str, names: str) -> tuple[Entry, ...]:
    """The callables ``names`` (separated by spaces) of ``module``."""
    return tuple(Entry(area, f"{module}:{name}") for name in names.split())


_FSDP = "torch.distributed.fsdp"
_FSDP_METHODS = (
    "reshard unshard set_is_last_backward set_requires_gradient_sync "
    "set_requires_all_reduce set_reshard_after_forward set_reshard_after_backward "
    "set_unshard_in_backward set_modules_to_forward_prefetch "
    "set_modules_to_backward_prefetch set_post_optim_event set_all_reduce_hook "
    "set_gradient_divide_factor set_reduce_scatter_divide_factor "
    "set_force_sum_reduction_for_comms set_custom_all_gather set_custom_reduce_scatter "
    "set_allocate_memory_from_process_group_for_comm set_reduce_scatter_unused_params "
    "set_separate_reduce_scatter_group set_symm_mem_for_comm"
)
_DTENSOR = (
    "distribute_tensor distribute_module DTensor.from_local DTensor.to_local "
    "DTensor.redistribute DTensor.full_tensor zeros ones empty rand randn"
)
_MESH = (
    "init_device_mesh DeviceMesh DeviceMesh.__getitem__ DeviceMesh.from_group "
    "DeviceMesh.get_group DeviceMesh.get_local_rank"
)
_TP = (
    "parallelize_module ColwiseParallel RowwiseParallel SequenceParallel PrepareModuleInput "
    "PrepareModuleOutput PrepareModuleInputOutput loss_parallel"
)
_DDP = (
    "DistributedDataParallel DistributedDataParallel.no_sync DistributedDataParallel.join "
    "DistributedDataParallel.register_comm_hook"
)
_STATE_DICT = (
    "get_state_dict set_state_dict get_model_state_dict get_optimizer_state_dict "
    "set_model_state_dict set_optimizer_state_dict StateDictOptions"
)
_DCP = (
    "save load async_save FileSystemWriter FileSystemReader DefaultSavePlanner DefaultLoadPlanner"
)
_OPTIMIZERS = (
    "SGD Adam AdamW Adagrad RMSprop Adamax NAdam RAdam Adadelta ASGD Rprop Adafactor LBFGS"
)
_SCHEDULERS = (
    "StepLR MultiStepLR ConstantLR LinearLR ExponentialLR CosineAnnealingLR LambdaLR "
    "SequentialLR OneCycleLR ReduceLROnPlateau"
)
_WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
_FORMAT_UTILS = "torch.distributed.checkpoint.format_utils"

CALLABLES: tuple[Entry, ...] = (
    *_entries("dtensor", "torch.distributed.tensor", _DTENSOR),
    # the global shape, as ``zeros``' ``*size``: the data of the call
    Entry("dtensor", "torch.distributed.tensor:full", ("size",)),
    *_entries("dtensor", "torch.distributed.device_mesh", _MESH),
    *_entries("tp", "torch.distributed.tensor.parallel", _TP),
    *_entries(
        "fsdp2",
        _FSDP,
        "fully_shard MixedPrecisionPolicy OffloadPolicy CPUOffloadPolicy "
        "register_fsdp_forward_method",
    ),
    *(Entry("fsdp2", f"{_FSDP}:FSDPModule.{name}") for name in _FSDP_METHODS.split()),
    *_entries("fsdp1", _FSDP, "FullyShardedDataParallel MixedPrecision CPUOffload"),
    *_entries("ddp_zero", "torch.nn.parallel", _DDP),
    *_entries("ddp_zero", "torch.distributed.optim", "ZeroRedundancyOptimizer"),
    *_entries("state_dict", "torch.distributed.checkpoint.state_dict", _STATE_DICT),
    *_entries("state_dict", "torch.distributed.checkpoint", _DCP),
    # the stager an async save is handed, and its options
    *_entries("state_dict", "torch.distributed.checkpoint.staging", "DefaultStager StagingOptions"),
    # checkpoint loads: a checkpoint's directory and a torch.save file are the call's data
    *(
        Entry("state_dict", f"{_FORMAT_UTILS}:{name}", ("dcp_checkpoint_dir", "torch_save_path"))
        for name in ("dcp_to_torch_save", "torch_save_to_dcp")
    ),
    *_entries("optim", "torch.optim", _OPTIMIZERS),
    *_entries("optim", "torch.optim.lr_scheduler", _SCHEDULERS),
    *_entries("optim", "torch.nn.utils", "clip_grad_norm_ clip_grad_value_ get_total_norm"),
    # the norm clip_grad_norm_ computed, handed on: the data of the call
    Entry("optim", "torch.nn.utils:clip_grads_with_norm_", ("total_norm",)),
    *_entries(
        "checkpoint_compile",
        "torch.utils.checkpoint",
        "checkpoint create_selective_checkpoint_contexts",
    ),
    *_entries("checkpoint_compile", _WRAPPER, "checkpoint_wrapper apply_activation_checkpointing"),
    *_entries("checkpoint_compile", "torch", "compile"),
)


@dataclass(frozen=True)
class Option:
    """One option of a callable: its name and its default as the recorder spells values
    (``None`` where the option has no default)."""

    name: str
    default: str | None


@dataclass(frozen=True)
class Api:
    """An inventoried callable of the running torch."""

    area: str
    module: str
    qualname: str
    options: tuple[Option, ...]

    @property
    def key(self) -> str:
        """``torch.distributed.fsdp.fully_shard``: how records and reports name it."""
        return f"{self.module}.{self.qualname}"

    def option_id(self, option: str) -> str:
        """``torch.distributed.fsdp.fully_shard(mesh)``."""
        return f"{self.key}({option})"


def resolve(path: str) -> tuple[Any, Any] | None:
    """``(owner, attribute)`` of ``module:Qual.name`` in the running torch (the owner a
    module or a class, the attribute as its ``__dict__`` holds it); None where it is gone."""
    module_name, _, qualname = path.partition(":")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError:
        return None
    *outer, name = qualname.split(".")
    for part in outer:
        owner = getattr(owner, part, None)
    if owner is None:
        return None
    if isinstance(owner, type):
        attribute = next((k.__dict__[name] for k in owner.__mro__ if name in k.__dict__), None)
    else:
        attribute = getattr(owner, name, None)
    return None if attribute is None else (owner, attribute)


def callable_of(attribute: Any) -> Callable[..., Any]:
    """The function whose signature holds the options: a class's ``__init__``, a static or
    class method's function."""
    if isinstance(attribute, type):
        init: Callable[..., Any] = getattr(attribute, "__init__")  # noqa: B009 (the class's own)
        return init
    if isinstance(attribute, staticmethod | classmethod):
        function: Callable[..., Any] = attribute.__func__
        return function
    assert callable(attribute), f"not a callable: {attribute!r}"
    return attribute  # type: ignore[no-any-return]


def options_of(
    function: Callable[..., Any], not_options: tuple[str, ...] = ()
) -> tuple[Option, ...]:
    """The options in ``function``'s signature (none where it has no signature)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return ()
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return tuple(
        Option(p.name, None if p.default is inspect.Parameter.empty else summary(p.default))
        for p in parameters
        if p.kind not in variadic
        and not p.name.startswith("_")
        and p.name not in DATA_INPUTS
        and p.name not in not_options
    )


@functools.cache
def inventory() -> tuple[Api, ...]:
    """Every in-scope callable the running torch has, with its options."""
    found = []
    for entry in CALLABLES:
        resolved = resolve(entry.path)
        if resolved is None:
            continue
        module, _, qualname = entry.path.partition(":")
        options = options_of(callable_of(resolved[1]), entry.not_options)
        found.append(Api(entry.area, module, qualname, options))
    return tuple(found)
