"""Cases of the checkpoint-loads properties on how a checkpoint's ranks coordinate (DCP's
``process_group``, ``use_collectives`` and ``no_dist``) and on the state-dict functions
called one by one with their options."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from harness.cases.state_dict import ReshardCase, StateDictCase
from harness.errors import check_int, check_one_of, require

SAVE_COORDINATIONS = ("default", "default_group", "new_group", "rank_local")
"""How ``dcp.save`` coordinates: no argument; ``process_group=`` the default group given
explicitly; ``process_group=`` a new group of every rank; ``use_collectives=False`` (each
rank writes its own ``__<rank>.metadata``, no global ``.metadata``)."""
LOAD_COORDINATIONS = ("default", "default_group", "new_group", "no_dist")
"""How ``dcp.load`` coordinates: as ``SAVE_COORDINATIONS``, or ``no_dist=True`` (each rank
plans and reads alone)."""
FQN_MODIFIERS = ("_fqn_modifiers", "distconf_fqn_modifiers")
"""``StateDictOptions(dsd_fqn_modifiers=...)``: the name of a module method that returns the
key renames its state-dict hooks make (torch's default name, or another): the MLP defines
neither, so either must leave the keys as ``Module.state_dict()`` has them."""


@dataclass(frozen=True)
class CoordinationCase:
    """``reshard.save``'s model saved by ``dcp.save`` coordinated as ``save_how`` and
    loaded by ``dcp.load`` as ``load_how`` at ``reshard.load``'s layout and world size.

    A rank-local checkpoint (``use_collectives=False``) is loaded where its ranks hold the
    same pieces: the saving case itself, from another seed (each rank finds its own
    ``__<rank>.metadata``)."""

    reshard: ReshardCase
    save_how: str
    load_how: str

    def __post_init__(self) -> None:
        check_one_of("save_how", self.save_how, SAVE_COORDINATIONS)
        check_one_of("load_how", self.load_how, LOAD_COORDINATIONS)
        if self.save_how == "rank_local":
            save, load = self.reshard.save, self.reshard.load
            same = replace(load, train=replace(load.train, seed=save.train.seed)) == save
            require(same, "reshard.load", load, "the saving case (another seed) for rank_local")

    @property
    def load_size(self) -> int:
        return math.prod(self.reshard.load.train.mesh_shape)

    def call(self) -> str:
        save = {
            "default": "dcp.save(sd, checkpoint_id=D)",
            "default_group": "dcp.save(sd, checkpoint_id=D, process_group=dist.group.WORLD)",
            "new_group": "dcp.save(sd, checkpoint_id=D, process_group=dist.new_group(all))",
            "rank_local": "dcp.save(sd, checkpoint_id=D, use_collectives=False)",
        }[self.save_how]
        load = {
            "default": "dcp.load(sd, checkpoint_id=D)",
            "default_group": "dcp.load(sd, checkpoint_id=D, process_group=dist.group.WORLD)",
            "new_group": "dcp.load(sd, checkpoint_id=D, process_group=dist.new_group(all))",
            "no_dist": "dcp.load(sd, checkpoint_id=D, no_dist=True)",
        }[self.load_how]
        return f"{self.reshard.call()}; {save}; {load}"


@dataclass(frozen=True)
class RankLocalReshardCase:
    """``save``'s model (fsdp on a 1-D mesh of 2+ ranks) saved with
    ``dcp.save(use_collectives=False)``, loaded at the same world size with every tensor
    replicated (hsdp on a (world size, 1) mesh): each rank needs pieces only other ranks'
    ``__<rank>.metadata`` describe. The first Linear has 2+ output features, so rank 1
    holds a piece of its weight."""

    save: StateDictCase

    def __post_init__(self) -> None:
        train = self.save.train
        check_one_of("save.train.layout", train.layout, ("fsdp",))
        size = math.prod(train.mesh_shape)
        check_int("world size", size, 2)
        require(train.dims[1] >= 2, "save.train.dims", train.dims, "2+ features after dims[0]")

    @property
    def load(self) -> StateDictCase:
        size = math.prod(self.save.train.mesh_shape)
        train = replace(
            self.save.train,
            layout="hsdp",
            mesh_shape=(size, 1),
            seed=(self.save.train.seed + 1) % 2**32,
        )
        return replace(self.save, train=train, shard_largest_dim=False)

    def call(self) -> str:
        size = math.prod(self.save.train.mesh_shape)
        return (
            f"{self.save.call()}; dcp.save(sd, checkpoint_id=D, use_collectives=False); "
            f"dcp.load(sd, checkpoint_id=D) into hsdp(mesh=({size}, 1)) at {size} ranks"
        )


@dataclass(frozen=True)
class ApiOptionsCase:
    """``case``'s model and trained optimizer; their state
    dicts taken by ``get_state_dict`` and by ``get_model_state_dict`` +
    ``get_optimizer_state_dict`` under ``StateDictOptions(full_state_dict, cpu_offload,
    flatten_optimizer_state_dict, dsd_fqn_modifiers=modifiers)``, of the whole model or
    (``submodule``) of ``submodules={model[submodule]}``; then set into fresh models by
    ``set_state_dict`` and by ``set_model_state_dict`` + ``set_optimizer_state_dict``."""

    case: StateDictCase
    full: bool
    cpu_offload: bool
    flatten_optimizer: bool
    modifiers: str
    submodule: int | None

    def __post_init__(self) -> None:
        check_one_of("modifiers", self.modifiers, FQN_MODIFIERS)
        check_one_of("case.train.layout", self.case.train.layout, ("fsdp", "hsdp"))
        require(self.case.train.steps >= 1, "case.train.steps", self.case.train.steps, ">= 1")
        require(
            not (self.full and self.cpu_offload),
            "cpu_offload",
            self.cpu_offload,
            "False with full_state_dict (rank 0's alone: broadcast_from_rank0's business)",
        )
        if self.submodule is not None:
            linears = range(0, 2 * (len(self.case.train.dims) - 1), 2)
            check_one_of("submodule", self.submodule, tuple(linears))

    def options(self) -> str:
        return (
            f"StateDictOptions(full_state_dict={self.full}, cpu_offload={self.cpu_offload}, "
            f"flatten_optimizer_state_dict={self.flatten_optimizer}, "
            f"dsd_fqn_modifiers={self.modifiers!r})"
        )

    def call(self) -> str:
        sub = "" if self.submodule is None else f", submodules={{model[{self.submodule}]}}"
        return (
            f"{self.case.call()}; get_state_dict(model, optim{sub}, options={self.options()}) vs "
            f"get_model_state_dict + get_optimizer_state_dict; set_state_dict vs "
            "set_model_state_dict + set_optimizer_state_dict"
        )
