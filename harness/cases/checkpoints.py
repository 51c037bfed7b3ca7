"""Cases of the checkpoint properties: the options of a DCP save and load (planners, storage,
state-dict options), ``dcp.async_save`` while training goes on, and a DCP state dict holding
an lr scheduler and a user ``Stateful`` beside the model and optimizer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from harness.cases.schedules import Schedule
from harness.cases.state_dict import ReshardCase, StateDictCase
from harness.errors import check_int, check_one_of, require

REWRITES = ("over_earlier", "empty")
"""Where a save writes: a directory already holding an earlier checkpoint of other values
(``FileSystemWriter(overwrite=...)``; refused, the save goes on into an empty directory
beside it), or an empty directory. The first is first: hypothesis' first example is its
simplest. With ``enable_plan_caching`` every save is the second through its planner: a first
goes elsewhere, a training step before the second (the per-rank progress then grows)."""


def _spelled(name: str, options: tuple[tuple[str, Any], ...]) -> str:
    return f"{name}({', '.join(f'{k}={v}' for k, v in options)})"


@dataclass(frozen=True)
class CheckpointOptions:
    """Keyword arguments of each object a DCP save and load are given: ``DefaultSavePlanner``,
    ``DefaultLoadPlanner``, ``FileSystemWriter`` (but its path), and ``StateDictOptions`` for
    the saving side's ``get_state_dict`` and for the loading side's ``get_state_dict`` /
    ``set_state_dict``."""

    save_planner: tuple[tuple[str, Any], ...] = ()
    load_planner: tuple[tuple[str, Any], ...] = ()
    writer: tuple[tuple[str, Any], ...] = ()
    save_options: tuple[tuple[str, Any], ...] = ()
    load_options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        saving, loading = dict(self.save_options), dict(self.load_options)
        flat = saving.get("flatten_optimizer_state_dict", False)
        same = flat == loading.get("flatten_optimizer_state_dict", False)
        require(same, "load_options", self.load_options, f"flatten_optimizer_state_dict={flat}")
        for name, chosen in (("save_options", saving), ("load_options", loading)):
            broadcast = chosen.get("broadcast_from_rank0", False)
            full = chosen.get("full_state_dict", False)
            require(full or not broadcast, name, chosen, "full_state_dict=True where broadcast")
        offloaded = loading.get("full_state_dict", False) and loading.get("cpu_offload", False)
        broadcast = loading.get("broadcast_from_rank0", False)
        require(broadcast or not offloaded, "load_options", loading, "broadcast_from_rank0=True")
        threads = dict(self.writer).get("thread_count", 1)
        check_int("writer thread_count", threads)

    @property
    def overwrite(self) -> bool:
        return bool(dict(self.writer).get("overwrite", True))

    def describe(self) -> str:
        return "; ".join(
            (
                f"get_state_dict({_spelled('StateDictOptions', self.save_options)})",
                f"dcp.save(planner={_spelled('DefaultSavePlanner', self.save_planner)}, "
                f"storage_writer={_spelled('FileSystemWriter', self.writer)})",
                f"dcp.load(planner={_spelled('DefaultLoadPlanner', self.load_planner)}, "
                "storage_reader=FileSystemReader)",
                f"set_state_dict({_spelled('StateDictOptions', self.load_options)})",
            )
        )


@dataclass(frozen=True)
class OptionsCase:
    """A ``ReshardCase`` (saved at one world size and layout, loaded at another) saved and
    loaded with ``options``, into a directory as ``rewrite`` says. Beside the model and
    optimizer the saved state dict holds each rank's own plain values (its losses so far, a
    tensor, and its name, a string) under keys every rank shares: DCP keeps one rank's, the
    lowest's under ``dedup_save_to_lowest_rank``."""

    reshard: ReshardCase
    options: CheckpointOptions
    rewrite: str = "empty"

    def __post_init__(self) -> None:
        check_one_of("rewrite", self.rewrite, REWRITES)
        steps = self.reshard.save.train.steps
        check_int("reshard.save.train.steps", steps, 1)

    @property
    def cached(self) -> bool:
        """``enable_plan_caching``: the planner saves twice, a training step between."""
        return bool(dict(self.options.save_planner).get("enable_plan_caching", False))

    @property
    def saved_steps(self) -> int:
        """The training steps taken before the save the load reads (the length of each
        rank's saved losses)."""
        return self.reshard.save.train.steps + int(self.cached)

    @property
    def refused(self) -> bool:
        """The save over an earlier checkpoint must be refused (``overwrite=False``)."""
        return self.rewrite == "over_earlier" and not self.options.overwrite

    def call(self) -> str:
        cached = "; saved twice with one planner, a step between" if self.cached else ""
        return (
            f"{self.reshard.call()}; {self.options.describe()}; into {self.rewrite}{cached}; "
            "each rank's losses and name saved under shared keys"
        )


ASYNC_CHECKPOINTERS = ("thread",)
"""``AsyncCheckpointerType`` values drawn. ``process`` starts a child process per rank: the
processes runner's rank processes are daemonic ("daemonic processes are not allowed to have
children") and the thread runner has no CPU process group (see the suite)."""
STAGING_OPTIONS = ("use_pinned_memory", "use_shared_memory", "use_async_staging")
"""``StagingOptions`` fields drawn for a ``DefaultStager``; ``use_non_blocking_copy`` needs an
accelerator ("Non-blocking copy requires that the current accelerator is available"), and so
does ``use_pinned_memory`` to mean anything: both follow the World's device."""


@dataclass(frozen=True)
class AsyncCase:
    """``case`` trained, then ``dcp.async_save`` on a checkpoint group of its own, then
    ``after`` more steps while it runs; ``staging`` the ``StagingOptions`` of a
    ``DefaultStager`` handed to it (None: async_save's own)."""

    case: StateDictCase
    after: int
    checkpointer: str = "thread"
    staging: tuple[tuple[str, bool], ...] | None = None
    storage_writer: bool = False
    """A ``FileSystemWriter`` of the directory handed as ``storage_writer=`` (else
    ``checkpoint_id=``)."""
    planner: bool = False
    """A ``DefaultSavePlanner()`` handed as ``planner=`` (else async_save's own)."""
    use_collectives: bool = True
    in_place: bool = False
    """Right after the call (its staging done) every parameter is negated in place, and
    negated back once the save completed, before the ``after`` steps: a user reusing the live
    tensors at once, before any background write can have read them (training's first
    in-place update comes after a forward and a backward, which a background write may
    outrun)."""

    def __post_init__(self) -> None:
        check_int("after", self.after, minimum=1)
        check_one_of("checkpointer", self.checkpointer, ASYNC_CHECKPOINTERS)
        for name, _ in self.staging or ():
            check_one_of("staging option", name, (*STAGING_OPTIONS, "use_non_blocking_copy"))

    def call(self) -> str:
        options = "" if self.staging is None else f", {_spelled('DefaultStager', self.staging)}"
        options += ", storage_writer=FileSystemWriter(d)" if self.storage_writer else ""
        options += ", planner=DefaultSavePlanner()" if self.planner else ""
        options += "" if self.use_collectives else ", use_collectives=False"
        then = (
            f"every parameter negated in place, .result(), negated back, {self.after} step(s)"
            if self.in_place
            else f"{self.after} step(s) before .result()"
        )
        return (
            f"{self.case.call()}; dcp.async_save(async_checkpointer_type={self.checkpointer}"
            f"{options}) then {then}"
        )


ASYNC_FAILURES = ("overwrite", "write_data")
"""How an async save is made to fail: a ``FileSystemWriter(overwrite=False)`` of the earlier
checkpoint's directory (refused on every rank), or a ``FileSystemWriter`` of a new directory
whose ``write_data`` raises on one rank (a rank whose storage fails mid-save)."""


@dataclass(frozen=True)
class AsyncFailureCase:
    """``case`` trained and saved by ``dcp.save``, trained one more step, then saved by
    ``dcp.async_save`` through a writer that fails as ``failure`` says (``ASYNC_FAILURES``; on
    ``failing_rank`` for ``write_data``), staged by the writer itself (an ``AsyncStager``) or,
    where ``default_stager``, by a ``DefaultStager``."""

    case: StateDictCase
    failure: str
    failing_rank: int = 0
    default_stager: bool = False

    def __post_init__(self) -> None:
        check_one_of("failure", self.failure, ASYNC_FAILURES)
        size = math.prod(self.case.train.mesh_shape)
        check_one_of("failing_rank", self.failing_rank, range(size))

    def call(self) -> str:
        writer = (
            "FileSystemWriter(D, overwrite=False)"
            if self.failure == "overwrite"
            else f"FileSystemWriter(D2) whose write_data raises on rank {self.failing_rank}"
        )
        stager = ", async_stager=DefaultStager(StagingOptions(False, False, False, False))"
        stager = stager if self.default_stager else ""
        return (
            f"{self.case.call()}; dcp.save into D; one more step; dcp.async_save("
            f"storage_writer={writer}{stager}).result(); dcp.load(D)"
        )


@dataclass(frozen=True)
class StatefulCase:
    """``case``'s model, some parameters frozen (``frozen``, by name), its trainable ones
    split into ``groups`` (names per group, one may be empty) with an lr each, stepped under
    ``schedule``; a data position (a user ``Stateful``) counts the steps taken. Trained
    ``save_at`` steps, saved by DCP, loaded into fresh objects, trained on to
    ``case.train.steps``."""

    case: StateDictCase
    frozen: tuple[str, ...]
    groups: tuple[tuple[str, ...], ...]
    lrs: tuple[float, ...]
    schedule: Schedule
    save_at: int

    def __post_init__(self) -> None:
        require(len(self.groups) >= 1, "groups", self.groups, "one or more parameter groups")
        # set_state_dict refuses more than one ("DSD only support exactly one param group
        # with zero parameters")
        empty = sum(1 for g in self.groups if not g)
        require(empty <= 1, "groups", self.groups, "at most one group without parameters")
        require(empty < len(self.groups), "groups", self.groups, "a group with parameters")
        require(len(self.lrs) == len(self.groups), "lrs", self.lrs, "one lr per group")
        steps = self.case.train.steps
        check_int("save_at", self.save_at, minimum=1)
        require(self.save_at < steps, "save_at", self.save_at, f"< case.train.steps={steps}")
        named = [n for g in self.groups for n in g]
        require(len(set(named)) == len(named), "groups", self.groups, "each name in one group")
        require(not set(named) & set(self.frozen), "frozen", self.frozen, "in no group")

    def call(self) -> str:
        groups = ", ".join(
            f"{list(g)} lr={lr}" for g, lr in zip(self.groups, self.lrs, strict=True)
        )
        return (
            f"{self.case.call()}; frozen {list(self.frozen)}; groups [{groups}], "
            f"{self.schedule.describe()}; dcp.save after {self.save_at} step(s), resumed to "
            f"{self.case.train.steps}"
        )
