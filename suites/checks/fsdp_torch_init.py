"""torch's own initialisation of ``fully_shard`` parameters built on the meta device: the rank
function and its one-device references.

A Linear stack is built on meta, sharded (each Linear, then the root; on a 1-D or (replicate,
shard) mesh, or with no mesh argument), materialised with ``to_empty``, filled with a
constant and initialised by ``nn.Linear.reset_parameters`` (``kaiming_uniform_`` and
``uniform_`` on the DTensor parameters) after ``torch.manual_seed(seed)`` on every rank, then
trained a few Adam steps (the optimizer built right after ``to_empty``, as upstream does).

What a random op on a DTensor draws depends on DTensor's RNG tracker
(``torch.distributed.tensor._random``): on a mesh whose device has none (``is_rng_supported_mesh``
is False: the CPU), the op runs on each rank's local piece from the caller's generator, as
if the piece were a tensor of its own (upstream's ``DistTensorRandomInitTest._run_init_op``
states exactly that for such meshes); on an accelerator, ``OffsetBasedRNGTracker`` gives
every shard its own offset of the same Philox stream (replicas share it).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from harness import RankContext
from harness.cases.modules import TorchInitCase
from harness.parity import assert_array_equal, assert_close, assert_equal_values, failure
from harness.torchkit import internals
from harness.torchkit.dtensor import (
    DTensorView,
    full_array,
    tensor_from,
    to_numpy,
    torch_dtype,
    view_of,
)
from specs.chunking import shard_sizes
from specs.placements import Shard
from suites.checks.fsdp_expect import piece

CONSTANT = 1337.0
MESH_NAMES = ("replicate", "shard")
# Rank threads share one CPU generator: each rank seeds and draws under this lock, so every
# rank draws from the same stream as a rank process does (fork_rng restores the stream).
_CPU_RNG = threading.Lock()


@dataclass(frozen=True)
class InitView:
    """One rank's view: every parameter after ``reset_parameters`` (local piece, full value,
    placements, mesh), the mesh's device type, whether DTensor's RNG tracker was in use, and
    the losses and full parameters of the Adam steps after."""

    params: dict[str, DTensorView]
    mesh_device: dict[str, str]
    tracker: bool
    losses: tuple[float, ...]
    trained: dict[str, np.ndarray]


def build_stack(case: TorchInitCase) -> nn.Sequential:
    """Linear, ReLU, Linear, ... of ``case.dims`` on the current default device."""
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(itertools.pairwise(case.dims)):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(d_in, d_out, bias=case.bias, dtype=torch_dtype(case.dtype)))
    return nn.Sequential(*layers)


def _shard_all(model: nn.Sequential, mesh: DeviceMesh | None) -> None:
    for module in [*(m for m in model if isinstance(m, nn.Linear)), model]:
        if mesh is None:
            fully_shard(module)
        else:
            fully_shard(module, mesh=mesh)


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """``torch.manual_seed(seed)`` for the block: on the CPU under the process-wide lock and
    with the generator restored after; on an accelerator as upstream does (DTensor's tracker
    syncs and offsets the device generator itself)."""
    if device.type == "cpu":
        with _CPU_RNG, torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    else:
        torch.manual_seed(seed)
        yield


def batch(case: TorchInitCase, world_size: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step``: rank ``r`` trains on rows ``r*b:(r+1)*b``."""
    rng = np.random.default_rng([case.seed, 11, step])
    rows = world_size * case.batch_per_rank
    return rng.uniform(-1, 1, (rows, case.dims[0])), rng.uniform(-1, 1, (rows, case.dims[-1]))


def torch_init_on_rank(ctx: RankContext, case: TorchInitCase) -> InitView:
    with torch.device("meta"):
        model = build_stack(case)
        if case.default_mesh:
            _shard_all(model, None)  # the default mesh is made inside the meta context
    if not case.default_mesh:
        names = MESH_NAMES if len(case.mesh_shape) == 2 else None
        _shard_all(model, ctx.mesh(case.mesh_shape, names))
    model.to_empty(device=ctx.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=case.lr)
    with torch.no_grad():
        for param in model.parameters():
            (param.to_local() if isinstance(param, DTensor) else param).fill_(CONSTANT)
    with _seeded(case.seed, ctx.device):
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    tracker = internals.dtensor_rng_tracker_active()
    params = {name: view_of(p, ctx.rank) for name, p in model.named_parameters()}
    meshes = {
        name: p.device_mesh.device_type
        for name, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    rows = slice(ctx.rank * case.batch_per_rank, (ctx.rank + 1) * case.batch_per_rank)
    losses = []
    for step in range(case.steps):
        x, y = batch(case, ctx.world_size, step)
        optimizer.zero_grad()
        out = model(tensor_from(x[rows], case.dtype, ctx.device))
        loss = F.mse_loss(out, tensor_from(y[rows], case.dtype, ctx.device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    trained = {name: full_array(p) for name, p in model.named_parameters()}
    return InitView(params, meshes, tracker, tuple(losses), trained)


def shard_index(case: TorchInitCase, rank: int) -> int:
    """Which piece of each parameter ``rank`` holds (its coordinate on the shard axis)."""
    return rank % case.shards


def local_pieces(case: TorchInitCase, index: int) -> dict[str, np.ndarray]:
    """What one device's ``nn.Linear(in, rows)`` holds after ``torch.manual_seed(seed)``,
    ``rows`` being piece ``index``'s of each Linear's ``out`` (``torch.chunk``): the pieces a
    rank without DTensor's RNG tracker draws (``reset_parameters`` on its local pieces, in
    module order, the bounds from the global fan-in, which Shard(0) leaves unchanged)."""
    pieces = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(case.seed)
        for i, (d_in, d_out) in enumerate(itertools.pairwise(case.dims)):
            rows = shard_sizes(d_out, case.shards)[index]
            layer = nn.Linear(d_in, rows, bias=case.bias, dtype=torch_dtype(case.dtype))
            for name, param in layer.named_parameters():
                pieces[f"{2 * i}.{name}"] = to_numpy(param)
    return pieces


def init_bounds(case: TorchInitCase) -> dict[str, float]:
    """``reset_parameters``' bound of every parameter: ``kaiming_uniform_(a=sqrt(5))`` and
    the bias' ``uniform_`` both draw from ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]``, ``fan_in``
    the global weight's ``in_features``."""
    bounds = {}
    for i, d_in in enumerate(case.dims[:-1]):
        for name in ("weight", "bias") if case.bias else ("weight",):
            bounds[f"{2 * i}.{name}"] = 1.0 / float(np.sqrt(d_in))
    return bounds


def reference_adam(
    case: TorchInitCase, initial: dict[str, np.ndarray], world_size: int
) -> tuple[list[float], dict[str, np.ndarray]]:
    """The same Adam steps on one CPU device from the full values ``initial`` over the whole
    global batch (FSDP averages the ranks' gradients of equal row counts)."""
    model = build_stack(case)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.from_numpy(initial[name].copy()))
    optimizer = torch.optim.Adam(model.parameters(), lr=case.lr)
    losses = []
    for step in range(case.steps):
        x, y = batch(case, world_size, step)
        optimizer.zero_grad()
        device = torch.device("cpu")
        loss = F.mse_loss(
            model(tensor_from(x, case.dtype, device)), tensor_from(y, case.dtype, device)
        )
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: to_numpy(p) for name, p in model.named_parameters()}


# --- driver-side comparisons ------------------------------------------------------------------


def assert_initialised(views: list[InitView], case: TorchInitCase, device: str) -> None:
    """What ``reset_parameters`` gave every rank (see the module docstring): without DTensor's
    RNG tracker (a CPU mesh) exactly ``local_pieces`` of the rank's shard index, bit for bit;
    with it (an accelerator), replicas bit-identical, pieces of different shards different,
    every value inside the init's bounds and no constant left. Every rank's full value is
    the same (a gather copies)."""
    __tracebackhide__ = True
    tracked = device != "cpu"
    bounds = init_bounds(case)
    first = views[0].params
    for rank, view in enumerate(views):
        assert_equal_values(
            view.tracker, tracked, what=f"DTensor RNG tracker in use on rank {rank}"
        )
        index = shard_index(case, rank)
        expected = None if tracked else local_pieces(case, index)
        assert_equal_values(sorted(view.params), sorted(bounds), what=f"parameters on rank {rank}")
        for name, param in view.params.items():
            who = f"{name} on rank {rank} (shard {index})"
            full = param.full
            assert full is not None, "view_of gathers the full value"
            first_full = first[name].full
            assert first_full is not None, "view_of gathers the full value"
            assert_array_equal(full, first_full, what=f"full_tensor() of {who} against rank 0's")
            if expected is not None:
                # One device's draw of the same piece from the same seed: bit for bit.
                assert_array_equal(param.local, expected[name], what=f"local piece of {who}")
                continue
            if np.abs(param.local).max(initial=0.0) > bounds[name]:
                raise failure(f"{who}: values outside +-{bounds[name]} (1/sqrt(fan_in))")
            replica = views[index].params[name].local  # the rank of replica 0 of this shard
            assert_array_equal(param.local, replica, what=f"{who} against replica 0's")
    if tracked:
        _assert_shards_differ(views, case)


def _assert_shards_differ(views: list[InitView], case: TorchInitCase) -> None:
    __tracebackhide__ = True
    for name in views[0].params:
        pieces = [views[i].params[name].local for i in range(case.shards)]
        for i, j in itertools.combinations(range(case.shards), 2):
            a, b = pieces[i], pieces[j]
            if a.size and a.shape == b.shape and np.array_equal(a, b):
                raise failure(f"{name}: shards {i} and {j} hold the same values")


def assert_trained(views: list[InitView], case: TorchInitCase, world_size: int) -> None:
    """Adam after the init against one device from the same full values: the mean of the
    ranks' losses (equal row counts) and every full parameter, within ``TOLERANCE``."""
    __tracebackhide__ = True
    initial = {name: p.full for name, p in views[0].params.items() if p.full is not None}
    losses, params = reference_adam(case, initial, world_size)
    rtol, atol = TOLERANCE[case.dtype]
    mean = np.mean([v.losses for v in views], axis=0)
    assert_close(
        mean, np.array(losses), rtol=rtol, atol=atol, dtype=case.dtype, what="mean loss", why=WHY
    )
    for rank, view in enumerate(views):
        for name, value in params.items():
            what = f"{name} after {case.steps} Adam step(s) on rank {rank}"
            assert_close(
                view.trained[name],
                value,
                rtol=rtol,
                atol=atol,
                dtype=case.dtype,
                what=what,
                why=WHY,
            )


# Sharded training reduces each gradient over the ranks (reduce-scatter, and all-reduce over
# replicas) where one device takes one mean over the whole batch: the same terms in another
# order, a few ulps per step, which Adam's normalisation can grow (test_hsdp.py's table). A
# missing or mis-scaled reduction, or a lost update, moves parameters by whole percent.
TOLERANCE = {"float64": (1e-10, 1e-12), "float32": (1e-4, 1e-6)}  # (rtol, atol)
WHY = "gradients are reduced over the ranks in another order than one device's mean"


def assert_default_mesh(views: list[InitView], host: str) -> None:
    """``fully_shard`` without a mesh: every parameter placed ``(Shard(0),)`` on a 1-D mesh
    of every rank on the host's accelerator (``host``; the CPU without one), holding its
    ``torch.chunk`` piece of the full value."""
    __tracebackhide__ = True
    everyone = tuple(range(len(views)))
    for rank, view in enumerate(views):
        for name, param in view.params.items():
            got = (view.mesh_device[name], param.mesh_ranks, param.placements)
            want = (host, everyone, (Shard(0),))
            assert_equal_values(got, want, what=f"(mesh device, ranks, placements) of {name}")
            assert param.full is not None, "view_of gathers the full value"
            local = piece(param.full, len(views), 0, rank)
            assert_array_equal(param.local, local, what=f"local piece of {name} on rank {rank}")
