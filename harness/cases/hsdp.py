"""Cases of the HSDP properties: plain, picklable values, as every case.

Training cases wrap a ``ParityCase`` (model, optimizer, steps, seed), so the single-device
reference and the per-step batches are the optimizer suite's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.cases.training import ParityCase
from harness.errors import check_one_of, require

HSDP_APIS = ("fsdp1", "fully_shard")
HYBRID_STRATEGIES = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
"""FSDP1's strategy names; for ``fully_shard`` the second means ``reshard_after_forward=False``."""
GROUP_SOURCES = ("device_mesh", "process_groups")
DEFAULT_GROUPS = "default"
"""FSDP1 given neither: it makes its own (shard, replicate) groups from the device count."""
WRAPPINGS = ("hybrid", "mixed")
"""``hybrid``: every Linear and the root hybrid-sharded; ``mixed``: the Linears after the
first hybrid-sharded, the root (holding the first Linear) fully sharded over the world."""
SINGLE_GROUPS = ("world group", "shard group", "replicate group", "three groups", "1-D mesh")
"""What FSDP1 gets where hybrid sharding needs a (shard, replicate) pair."""


@dataclass(frozen=True)
class HSDPCase:
    """Hybrid sharding under ``api`` trained as ``training`` says, on its (replicate, shard)
    mesh."""

    api: str
    strategy: str
    wrapping: str
    groups: str
    """FSDP1: ``device_mesh`` or the ``(shard, replicate)`` process groups of that mesh."""
    use_orig_params: bool
    training: ParityCase
    tied: bool = False
    """The first and the last Linear share one weight (``training.dims`` starts and ends
    with the same two sizes); both stay in the root's unit, as upstream's
    TransformerWithSharedParams keeps its tied embedding and output projection."""

    def __post_init__(self) -> None:
        check_one_of("api", self.api, HSDP_APIS)
        check_one_of("strategy", self.strategy, HYBRID_STRATEGIES)
        check_one_of("wrapping", self.wrapping, WRAPPINGS)
        check_one_of("groups", self.groups, (*GROUP_SOURCES, DEFAULT_GROUPS))
        check_one_of("training.layout", self.training.layout, ("hsdp",))
        mesh = self.training.mesh_shape
        require(len(mesh) == 2, "training.mesh_shape", mesh, "2-D")
        dims = self.training.dims
        tieable = len(dims) >= 4 and dims[:2] == dims[-2:]
        require(tieable or not self.tied, "training.dims", dims, "(a, b, ..., a, b) when tied")
        if self.groups == DEFAULT_GROUPS:
            require(self.api == "fsdp1", "api", self.api, "'fsdp1' with default groups")
            require(self.wrapping == "hybrid", "wrapping", self.wrapping, "'hybrid' (a policy)")

    @property
    def own_units(self) -> tuple[int, ...]:
        """The Linears (by position, first 0) wrapped on their own; the others stay in the
        root's unit: the first under ``mixed`` wrapping, the tied first and last."""
        linears = range(len(self.training.dims) - 1)
        held = {0, len(linears) - 1} if self.tied else ({0} if self.wrapping == "mixed" else set())
        return tuple(i for i in linears if i not in held)

    @property
    def root_holds_params(self) -> bool:
        return self.tied or self.wrapping == "mixed"

    @property
    def mesh_shape(self) -> tuple[int, int]:
        replicate, shard = self.training.mesh_shape
        return replicate, shard

    def describe(self) -> str:
        if self.api == "fully_shard":
            reshard = self.strategy == "HYBRID_SHARD"
            how = f"fully_shard(reshard_after_forward={reshard})"
        else:
            how = f"FSDP1({self.strategy}, {self.groups}, use_orig_params={self.use_orig_params})"
        tied = ", first and last Linear weights tied" if self.tied else ""
        return f"{how}, {self.wrapping} wrapping{tied}"

    def call(self) -> str:
        return f"{self.describe()}: {self.training.call()}"


@dataclass(frozen=True)
class SyncCase:
    """FSDP1 hybrid sharding with ``sync_module_states=True`` over rank-dependent weights:
    rank ``r`` builds its MLP from ``seed + r``."""

    strategy: str
    groups: str
    use_orig_params: bool
    mesh_shape: tuple[int, int]
    dims: tuple[int, ...]
    bias: bool
    dtype: str
    seed: int

    def __post_init__(self) -> None:
        check_one_of("strategy", self.strategy, HYBRID_STRATEGIES)
        check_one_of("groups", self.groups, GROUP_SOURCES)

    def call(self) -> str:
        return (
            f"FSDP1({self.strategy}, {self.groups}, use_orig_params={self.use_orig_params}, "
            f"sync_module_states=True) on mesh {self.mesh_shape}, MLP{self.dims} "
            f"bias={self.bias} {self.dtype}, rank r's weights from seed {self.seed}+r"
        )


@dataclass(frozen=True)
class GroupErrorCase:
    """FSDP1 hybrid sharding given the wrong groups (``given``; None: no group at all)."""

    strategy: str
    given: str | None
    mesh_shape: tuple[int, int]
    dims: tuple[int, ...]

    def __post_init__(self) -> None:
        check_one_of("strategy", self.strategy, HYBRID_STRATEGIES)
        check_one_of("given", self.given, (None, *SINGLE_GROUPS))
