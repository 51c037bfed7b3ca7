"""Cases of the placement and uneven-shard properties: DTensor layouts, ops, views."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from harness.cases.meshes import MeshCase
from harness.errors import check_int, check_one_of, require
from specs.placements import Coord, Partial, Placement

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
    check_int("multiple_of", multiple_of)
    bound = max(0, _MAX_MAGNITUDE // multiple_of)
    rng = np.random.default_rng(seed)
    values = rng.integers(-bound, bound + 1, size=shape) * multiple_of
    array = np.asarray(values, dtype=np.float64)  # a 0-d draw comes back as a numpy scalar
    array.flags.writeable = False
    return array


class _OnAMesh:
    """A case laid out on the mesh ``construction`` builds (None: ``init_device_mesh`` of
    ``mesh_shape``), whose shape is ``mesh_shape``. A construction from a shape is kept as
    None, so a case spells and compares the same however its plain mesh was given."""

    mesh_shape: tuple[int, ...]
    construction: MeshCase | None

    def _check_mesh(self) -> None:
        if self.construction is not None and self.construction.how == "shape":
            object.__setattr__(self, "construction", None)
        built = self.mesh.shape
        shaped = f"the shape of the mesh it builds, {built}"
        require(built == tuple(self.mesh_shape), "mesh_shape", self.mesh_shape, shaped)

    @property
    def mesh(self) -> MeshCase:
        return self.construction or MeshCase(tuple(self.mesh_shape))

    def coord_of(self, rank: int) -> Coord:
        """``rank``'s coordinate on its mesh (on a slice: on the slice holding it)."""
        return self.mesh.coord_of(rank)

    def mesh_call(self) -> str:
        return "" if self.construction is None else f", mesh built as {self.construction.call()}"


@dataclass(frozen=True)
class DistributeCase(_OnAMesh):
    """``distribute_tensor(global, mesh, placements)``."""

    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: str
    seed: int
    src_data_rank: int | None = 0
    """``distribute_tensor``'s source: the group rank, on every mesh axis, whose tensor is
    the global one; None: every rank keeps pieces of its own tensor, no communication."""
    construction: MeshCase | None = None

    def __post_init__(self) -> None:
        self._check_mesh()

    def global_array(self) -> np.ndarray:
        # distribute_tensor divides a Partial('sum') value by the axis size: keep it exact.
        factor = partial_sum_factor(self.mesh_shape, self.placements)
        return integer_array(self.shape, self.seed, multiple_of=factor)

    def is_source(self, rank: int) -> bool:
        """``rank`` sits at coordinate ``(src_data_rank,) * mesh ndim`` of its mesh."""
        if self.src_data_rank is None:
            return False
        return self.coord_of(rank) == (self.src_data_rank,) * len(self.mesh_shape)

    def input_of(self, rank: int) -> np.ndarray:
        """What ``rank`` passes to ``distribute_tensor``: the global array on the source
        rank, another seeded array on every other rank (the source's must win)."""
        if self.is_source(rank):
            return self.global_array()
        factor = partial_sum_factor(self.mesh_shape, self.placements)
        return integer_array(self.shape, self.seed + 1 + rank, multiple_of=factor)

    def call(self) -> str:
        source = "" if self.src_data_rank == 0 else f", src_data_rank={self.src_data_rank}"
        return (
            f"distribute_tensor(shape={self.shape}, dtype={self.dtype}, "
            f"mesh={self.mesh_shape}, placements={self.placements}{source}{self.mesh_call()})"
        )


@dataclass(frozen=True)
class OpCase:
    """``op(distribute_tensor(...), dim, keepdim)`` for each ``(dim, keepdim)`` of
    ``applications``, in order on the same DTensor, against the op on the global tensor."""

    source: DistributeCase
    op: str
    applications: tuple[tuple[int, bool], ...]

    def __post_init__(self) -> None:
        applications = self.applications
        require(bool(applications), "applications", applications, "a non-empty tuple")

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
        check_one_of("method", self.method, ("view", "reshape"))
        size, shape = math.prod(self.source.shape), self.source.shape
        holds_all = math.prod(self.target) == size
        require(holds_all, "target", self.target, f"a shape of the {size} elements of {shape!r}")

    def call(self) -> str:
        return f"{self.method}{self.target} of {self.source.call()}"


@dataclass(frozen=True)
class RedistributeCase(_OnAMesh):
    """``DTensor.from_local(model locals, mesh, src).redistribute(mesh, dst)``."""

    mesh_shape: tuple[int, ...]
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: str
    seed: int
    construction: MeshCase | None = None

    def __post_init__(self) -> None:
        self._check_mesh()

    def global_array(self) -> np.ndarray:
        return integer_array(self.shape, self.seed)

    def call(self) -> str:
        return (
            f"redistribute(shape={self.shape}, dtype={self.dtype}, mesh={self.mesh_shape}, "
            f"{self.src} -> {self.dst}{self.mesh_call()})"
        )


FACTORIES = ("ones", "zeros", "full", "empty", "rand", "randn")
FillValue = bool | int | float


@dataclass(frozen=True)
class FactoryCase(_OnAMesh):
    """``torch.distributed.tensor.<factory>(shape[, fill_value], dtype=, requires_grad=,
    device_mesh=, placements=)`` against ``torch.<factory>`` of the same arguments."""

    mesh_shape: tuple[int, ...]
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    factory: str
    dtype: str | None
    """None: torch's default (full: inferred from the fill value)."""
    requires_grad: bool
    fill_value: FillValue | None = None
    construction: MeshCase | None = None

    def __post_init__(self) -> None:
        self._check_mesh()
        check_one_of("factory", self.factory, FACTORIES)
        filled = self.factory == "full"
        require(
            filled == (self.fill_value is not None),
            "fill_value",
            self.fill_value,
            "given for full only",
        )
        if self.dtype is not None:
            check_one_of("dtype", self.dtype, DTYPES)

    @property
    def deterministic(self) -> bool:
        """Its values are known (not empty's garbage or rand's draws)."""
        return self.factory in ("ones", "zeros", "full")

    def call(self) -> str:
        fill = "" if self.fill_value is None else f", {self.fill_value!r}"
        dtype = "" if self.dtype is None else f", dtype=torch.{self.dtype}"
        return (
            f"torch.distributed.tensor.{self.factory}({self.shape}{fill}{dtype}, "
            f"requires_grad={self.requires_grad}, mesh={self.mesh_shape}, "
            f"placements={self.placements}{self.mesh_call()})"
        )


@dataclass(frozen=True)
class FlattenedCase:
    """``distribute_tensor`` on a named mesh of ``source.mesh_shape`` after
    ``mesh[flattened axes]._flatten()``, one tensor dim sharded on every flattened axis."""

    source: DistributeCase
    flattened: tuple[int, ...]

    def __post_init__(self) -> None:
        ndim = len(self.source.mesh_shape)
        fits = len(self.flattened) >= 2 and set(self.flattened) <= set(range(ndim))
        require(fits, "flattened", self.flattened, f"2 or more axes of a {ndim}-D mesh")

    def call(self) -> str:
        axes = ", ".join(f"'p{axis}'" for axis in self.flattened)
        return f"mesh[{axes}]._flatten() first; then {self.source.call()} on mesh"
