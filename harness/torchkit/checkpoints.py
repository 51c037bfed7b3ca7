"""The torch objects of a checkpoint case (``cases.checkpoints``): planners, storage writer and
reader, state-dict options, stagers; the process group an async save runs on; a data
position as a user ``Stateful``."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions

from harness.cases.checkpoints import CheckpointOptions
from harness.torchkit import internals


def save_planner(options: CheckpointOptions, rank: int, world_size: int) -> DefaultSavePlanner:
    """The case's ``DefaultSavePlanner``. ``enable_plan_caching`` caches plans in a class
    attribute under a key each planner names (its class's name): rank threads of one process
    would share one entry, where rank processes have one each; the key names the World's
    size and the rank, so threads cache as processes do."""
    planner = DefaultSavePlanner(**dict(options.save_planner))
    internals.key_plan_cache(planner, f"{world_size}:{rank}")
    return planner


def load_planner(options: CheckpointOptions) -> DefaultLoadPlanner:
    return DefaultLoadPlanner(**dict(options.load_planner))


def writer(options: CheckpointOptions, directory: str) -> FileSystemWriter:
    return FileSystemWriter(directory, **dict(options.writer))


def reader(directory: str) -> FileSystemReader:
    return FileSystemReader(directory)


def state_dict_options(chosen: tuple[tuple[str, Any], ...]) -> StateDictOptions:
    return StateDictOptions(**dict(chosen))


def stager(staging: tuple[tuple[str, bool], ...] | None) -> DefaultStager | None:
    """A ``DefaultStager`` of those ``StagingOptions`` (the fields left out False: ``()`` is
    one a CPU accepts, where its defaults ask for an accelerator), or None."""
    if staging is None:
        return None
    chosen = {"use_pinned_memory": False, "use_shared_memory": False}
    chosen |= {"use_async_staging": False, "use_non_blocking_copy": False}
    return DefaultStager(StagingOptions(**(chosen | dict(staging))))


_CHECKPOINT_GROUPS: list[tuple[Any, Any]] = []
"""(the default group, a gloo group of every rank made beside it), in this rank process."""


def checkpoint_group() -> Any:
    """A gloo group of every rank, made once per default group: an async save's background
    thread runs collectives while training runs its own, and on one group their order
    differs between ranks (gloo then fails "Received data size doesn't match"), which is why
    async_save's docs ask for a CPU backend of its own beside the training one."""
    world = dist.group.WORLD
    if not _CHECKPOINT_GROUPS or _CHECKPOINT_GROUPS[0][0] is not world:
        _CHECKPOINT_GROUPS[:] = [(world, dist.new_group(backend="gloo"))]
    return _CHECKPOINT_GROUPS[0][1]


class DataPosition:
    """A data loader's position as a user ``Stateful``: the next step's batch and how many
    batches it has handed out (the same here; a load that left either out shows)."""

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.handed_out = step

    def next_step(self) -> int:
        step = self.step
        self.step += 1
        self.handed_out += 1
        return step

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "handed_out": self.handed_out}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.handed_out = int(state_dict["handed_out"])
