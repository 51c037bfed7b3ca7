"""What differs between ranks, said so that a check runs the same whether each rank runs it
or one thread simulates every rank (torch's ``LocalTensorMode``).

On a rank of the thread, process or torchrun runner, ``ctx.rank`` is that rank. Under
simulation one call of a check stands for every rank at once: its tensors are
``LocalTensor``s (one local tensor per rank), an integer that differs between ranks is a
``SymInt`` holding one value per rank, and there is no one rank to read, so ``ctx.rank``
raises ``RankIsSimulated``. A check that needs its rank says so through this module instead:

- ``rank_tensor(ctx, make)``: ``make(ctx.rank)`` on a rank; under simulation a
  ``LocalTensor`` of ``make(r)`` for every rank ``r`` (torch's ``rank_map``).
- ``each(ctx, make)`` (``rank_of(ctx)``: ``each(ctx, lambda r: r)``): ``make(ctx.rank)`` on
  a rank; under simulation ``make(r)`` for every rank, run outside the simulation and held in
  a ``PerRank`` that the runner splits when the check returns.
- ``per_shard(tensor, make)``, ``integer(value)``, ``map_value(value, make)``: a value
  computed from a tensor, an integer or a value that may hold one per rank, kept per rank.
- ``group_ranks(group)``, ``mesh_ranks(mesh)``, ``shard_box(dtensor)``: what a rank's group,
  mesh and shard are. Under simulation only rank 0's group and mesh objects exist; every
  rank's is the one torch's simulation runs that rank's collectives on.
- ``check_distribute_source`` and ``SimulatedContext.mesh_of`` refuse, with
  ``RunnerUnsupported``, what the simulation cannot take (``distribute_tensor`` scattering,
  or broadcasting over non-consecutive ranks, from group rank k > 0; a mesh from
  ``DeviceMesh.from_group``).
- ``split(value, rank)``: the runner's side, one rank's part of a check's result.

Nothing here knows a runner: whether a check is simulated is whether ``LocalTensorMode`` is
enabled on this thread, and while torch's ``_local_tensor`` module was never imported
nothing is (every helper is then the plain per-rank call).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NoReturn, TypeVar, cast

import numpy as np
import torch

from harness.cases.meshes import MeshCase
from harness.errors import DistconfError, RunnerUnsupported
from harness.torchkit import internals
from harness.torchkit.context import RankContext

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

T = TypeVar("T")

TORCH_MODULE = "torch.distributed._local_tensor"
"""Torch's simulation of SPMD ranks in one thread (private in torch 2.13)."""

_RANK_NOTE = "distconf_simulated_rank"


class RankIsSimulated(DistconfError, RuntimeError):
    """A simulated check read ``ctx.rank``: one thread runs every rank, so there is none."""


@dataclass(frozen=True)
class PerRank(Generic[T]):
    """A value that differs between simulated ranks: ``values[r]`` is rank ``r``'s. It
    stands in for a ``T`` inside a simulated check until the runner splits the result."""

    values: Mapping[int, T]


class SimulatedContext(RankContext):
    """The context of a check that runs once for every rank of its World.

    ``rank`` raises (there is no one rank); meshes are built outside the simulation, as
    upstream's ``LocalDTensorTestBase`` builds them, and used inside it.
    """

    @property
    def rank(self) -> int:
        raise RankIsSimulated(
            f"ctx.rank was read in a check that one thread runs for all {self.world_size} "
            f"ranks at once ({self.runner} runner, torch's LocalTensorMode): there is no one "
            "rank. Say what differs between ranks with harness.torchkit.local: "
            "rank_tensor(ctx, make) for a tensor, each(ctx, make) for any other value"
        )

    @rank.setter
    def rank(self, value: int) -> None:
        """RankContext's ``__init__`` sets a rank; a simulated check has none to keep."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(ranks=0..{self.world_size - 1}, "
            f"device={self.device!r}, runner={self.runner!r})"
        )

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__

    def mesh(self, shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> DeviceMesh:
        with unsimulated():
            return super().mesh(shape, names)

    def mesh_of(self, case: MeshCase) -> DeviceMesh:
        if case.how == "from_group":
            # Every rank passes its own axis group: rank-divergent mesh objects, while the
            # simulation holds one mesh for all ranks, listing only rank 0's group (its
            # get_coordinate then asserts every simulated rank is in it).
            unsupported(
                f"DeviceMesh.from_group (case {case.call()}): each rank builds the mesh of "
                "its own axis group, and the simulation holds one mesh object for all ranks"
            )
        with unsimulated():
            return super().mesh_of(case)


def check_distribute_source(
    mesh: DeviceMesh, placements: Sequence[Any], source: int | None
) -> None:
    """Under simulation, refuse ``distribute_tensor(..., src_data_rank=source)`` from group
    rank ``source`` > 0 where the simulation fails or is wrong (torch runs rank 0's call for
    every rank): a ``Shard`` scatters, and rank 0, off the root, passes no scatter list
    (``_local_scatter_`` asserts); a broadcast (``Replicate``, ``Partial``) over a group of
    non-consecutive ranks takes the group's first rank plus ``source`` as its source
    (``_local_broadcast_``: silently wrong values)."""
    if source in (None, 0) or simulated_ranks() is None:
        return
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    what = f"distribute_tensor(..., src_data_rank=...) from group rank {source}"
    if any(isinstance(p, Shard) for p in placements):
        unsupported(f"{what}: a Shard scatters, and rank 0's call passes no scatter list")
    for axis in range(mesh.ndim):
        ranks = dist.get_process_group_ranks(mesh.get_group(axis))
        if ranks != list(range(ranks[0], ranks[0] + len(ranks))):
            unsupported(
                f"{what}: the broadcast over mesh axis {axis} (ranks {ranks}, not consecutive) "
                "would take the group's first rank plus the group rank as its source"
            )


def unsupported(what: str) -> NoReturn:
    """Refuse what the simulation cannot do (``RunnerUnsupported``), raised from this one
    place: hypothesis then sees every refusal as one kind of failure, not one per caller."""
    raise RunnerUnsupported(f"LocalTensorMode cannot simulate {what}")


def simulated_ranks() -> tuple[int, ...] | None:
    """The ranks this thread simulates at once; None on a real rank."""
    mode = _enabled_mode()
    return None if mode is None else tuple(sorted(mode.ranks))


def rank_tensor(ctx: RankContext, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """``make(ctx.rank)``; under simulation a ``LocalTensor`` of every rank's ``make(r)``."""
    mode = _enabled_mode()
    if mode is None:
        return make(ctx.rank)
    return cast(torch.Tensor, mode.rank_map(_noting_rank(make)))


def each(ctx: RankContext, make: Callable[[int], T]) -> T:
    """``make(ctx.rank)``; under simulation every rank's ``make(r)`` in a ``PerRank``, which
    stands for a ``T`` until the runner splits the check's result per rank."""
    mode = _enabled_mode()
    if mode is None:
        return make(ctx.rank)
    made = _noting_rank(make)
    with mode.disable():
        values = {rank: made(rank) for rank in sorted(mode.ranks)}
    return cast(T, PerRank(values))


def shard(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s local tensor of a ``LocalTensor``; any other tensor itself."""
    return _local_tensors(tensor)[rank] if is_simulated_tensor(tensor) else tensor


def int_on(value: int | torch.SymInt, rank: int) -> int:
    """Rank ``rank``'s value of an integer that may differ between simulated ranks."""
    per_rank = _per_rank_ints(value)
    return _plain_int(value) if per_rank is None else per_rank[rank]


def is_simulated_tensor(value: object) -> bool:
    """Whether ``value`` is a ``LocalTensor`` (one local tensor per simulated rank)."""
    module = sys.modules.get(TORCH_MODULE)
    return module is not None and isinstance(value, module.LocalTensor)


def per_shard(tensor: torch.Tensor, make: Callable[[torch.Tensor], T]) -> T:
    """``make(tensor)``; for a ``LocalTensor``, every rank's ``make`` of its local tensor, in
    a ``PerRank`` (outside the simulation: ``make`` sees plain tensors)."""
    if not is_simulated_tensor(tensor):
        return make(tensor)
    with unsimulated():
        values = {rank: make(local) for rank, local in sorted(_local_tensors(tensor).items())}
    return cast(T, PerRank(values))


def integer(value: int | torch.SymInt) -> int:
    """``int(value)``; an integer that differs between simulated ranks (a ``SymInt`` of one
    value per rank) in a ``PerRank``."""
    per_rank = _per_rank_ints(value)
    return _plain_int(value) if per_rank is None else cast(int, PerRank(per_rank))


def rank_of(ctx: RankContext) -> int:
    """``ctx.rank``; under simulation each rank's own, in a ``PerRank``."""
    return each(ctx, lambda rank: rank)


def group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` in group-rank order. Under simulation the group object
    is rank 0's, and each rank's is the group torch's simulation runs that rank's
    collectives on (derived from rank 0's), in a ``PerRank``."""
    import torch.distributed as dist

    ranks = simulated_ranks()
    if ranks is None:
        return dist.get_process_group_ranks(group)
    groups = _simulated_groups(group)
    return cast(list[int], PerRank({r: next(g for g in groups if r in g) for r in ranks}))


def mesh_ranks(mesh: DeviceMesh) -> tuple[int, ...]:
    """The global ranks of this rank's ``mesh``, flattened row-major. Under simulation a
    sliced mesh object is rank 0's slice, and each rank's is found in the mesh's layout as
    torch's simulation finds a rank's coordinate, in a ``PerRank``."""
    ranks = simulated_ranks()
    if ranks is None:
        return tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())
    try:
        every = mesh._layout.remap_to_tensor(mesh._rank_map)
    except AttributeError as exc:  # private DeviceMesh state of torch 2.13
        raise RuntimeError(f"torch {torch.__version__}: DeviceMesh lacks {exc.name}") from exc
    slices = [tuple(int(r) for r in s) for s in every.reshape(every.shape[0], -1).tolist()]
    return cast(tuple[int, ...], PerRank({r: next(s for s in slices if r in s) for r in ranks}))


def shard_box(dtensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where this rank's shard of ``dtensor`` sits in the global tensor (its shape and
    offset: ``internals.local_shape_and_global_offset``); under simulation each rank's, as
    per-rank ints (``int()`` of a per-rank ``SymInt`` raises)."""
    if simulated_ranks() is None:
        return internals.local_shape_and_global_offset(dtensor)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        dtensor.shape, dtensor.device_mesh, dtensor.placements
    )
    return tuple(integer(v) for v in shape), tuple(integer(v) for v in offset)


def map_value(value: T, make: Callable[[T], Any]) -> Any:
    """``make(value)``; for a ``PerRank`` value, ``make`` of each rank's, in a ``PerRank``."""
    if isinstance(value, PerRank):
        return PerRank({rank: make(v) for rank, v in value.values.items()})
    return make(value)


@contextmanager
def unsimulated() -> Iterator[None]:
    """Outside the simulation for the block (plain tensors, DeviceMesh unpatched), where
    there is one; a no-op on a real rank."""
    module = sys.modules.get(TORCH_MODULE)
    if module is None:
        yield
        return
    with module.maybe_disable_local_tensor_mode():
        yield


def split(value: Any, rank: int) -> Any:
    """Rank ``rank``'s part of a simulated check's result: every ``PerRank``, ``LocalTensor``
    and per-rank ``SymInt`` in it, at any depth of lists, tuples, dicts and dataclasses,
    replaced by that rank's value (a part that holds none is returned as it is)."""
    if isinstance(value, PerRank):
        return split(value.values[rank], rank)
    if isinstance(value, str | bytes | bool | int | float | complex | np.ndarray | type(None)):
        return value
    if isinstance(value, torch.SymInt):
        return int_on(value, rank)
    if isinstance(value, torch.Tensor):
        return shard(value, rank)
    if isinstance(value, list | tuple):
        items = [split(item, rank) for item in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        pairs = [(split(k, rank), split(v, rank)) for k, v in value.items()]
        unchanged = all(
            k is old_k and v is old_v
            for (k, v), (old_k, old_v) in zip(pairs, value.items(), strict=True)
        )
        return value if unchanged else type(value)(pairs)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [f.name for f in dataclasses.fields(value) if f.init]
        changes = {name: split(getattr(value, name), rank) for name in fields}
        if all(changes[name] is getattr(value, name) for name in fields):
            return value
        return dataclasses.replace(value, **changes)
    return value


def note_rank(exc: BaseException) -> int | None:
    """The simulated rank whose ``make`` raised ``exc`` (``each``, ``rank_tensor``), if any."""
    rank = getattr(exc, _RANK_NOTE, None)
    return rank if isinstance(rank, int) else None


# --- torch's simulation ---------------------------------------------------------------------


def _enabled_mode() -> Any:
    module = sys.modules.get(TORCH_MODULE)
    return None if module is None else module.enabled_local_tensor_mode()


def _local_tensors(tensor: torch.Tensor) -> dict[int, torch.Tensor]:
    return cast(dict[int, torch.Tensor], tensor._local_tensors)  # type: ignore[attr-defined]


def _noting_rank(make: Callable[[int], T]) -> Callable[[int], T]:
    """``make``, leaving the rank it failed for on the exception (the runner reports it)."""

    def made(rank: int) -> T:
        try:
            return make(rank)
        except BaseException as exc:
            if note_rank(exc) is None:
                setattr(exc, _RANK_NOTE, rank)
                exc.add_note(f"(on simulated rank {rank})")
            raise

    return made


def _plain_int(value: int | torch.SymInt) -> int:
    """``int(value)``; the simulation's constant ``SymInt`` (the same on every rank) has no
    ``int()`` of its own."""
    constant = getattr(value.node, "val", None) if isinstance(value, torch.SymInt) else None
    return int(value) if constant is None else int(constant)


def _per_rank_ints(value: object) -> dict[int, int] | None:
    if not isinstance(value, torch.SymInt):
        return None
    per_rank = getattr(value.node, "_local_ints", None)
    return None if per_rank is None else {int(r): int(v) for r, v in per_rank.items()}


def _simulated_groups(group: Any) -> list[list[int]]:
    """Every group of ranks torch's simulation runs a collective on ``group`` over: rank 0's
    group laid out again from each offset of its complement in the world
    (``_local_tensor._c10d._prepare_collective_groups``)."""
    module = sys.modules[TORCH_MODULE]
    try:
        prepare = module._c10d._prepare_collective_groups
    except AttributeError as exc:
        raise RuntimeError(
            f"torch {torch.__version__}: {TORCH_MODULE}._c10d lacks {exc.name}"
        ) from exc
    relative, offsets, _ = prepare(group)
    return [[offset + r for r in relative] for offset in offsets]
