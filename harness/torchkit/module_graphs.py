"""Torch modules built from a ``specs.modules.ModuleGraph``, identically on every rank.

Every parameter and buffer takes its values from an explicit generator seeded with the case
seed and its canonical place in the graph, never from torch's global RNG (rank threads share
it). ``reset_parameters`` writes those values, also into sharded parameters (each rank writes
its own piece of the same global value), so a graph built on the meta device, moved with
``to_empty`` and reset holds exactly what a graph built directly holds.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from harness.cases.modules import GraphCase, MLPMeshCase
from specs.modules import Loc, ModuleGraph

DTYPE = torch.float64
InitKey = tuple[int, str, tuple[int, str]]
"""What a tensor's values derive from: the case seed, a namespace and a canonical place."""


def seeded_values(key: InitKey, shape: tuple[int, ...]) -> torch.Tensor:
    """The global value of the tensor named by ``key``: uniform in ``±1/sqrt(fan_in)``."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little"))
    fan_in = shape[-1] if len(shape) > 1 else max(1, math.prod(shape))
    bound = 1.0 / math.sqrt(max(1, fan_in))
    return torch.empty(shape, dtype=DTYPE).uniform_(-bound, bound, generator=generator)


@torch.no_grad()
def write_(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """Give ``tensor`` the global value ``full``; a DTensor gets this rank's piece of it."""
    if isinstance(tensor, DTensor):
        piece = distribute_tensor(
            full.to(tensor.device), tensor.device_mesh, tensor.placements, src_data_rank=None
        ).to_local()
        tensor.to_local().copy_(piece)
    else:
        tensor.copy_(full)


class _SeededInit:
    """``reset_parameters`` from ``self.init_keys``: attribute name -> InitKey."""

    init_keys: dict[str, InitKey]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        keys = getattr(self, "init_keys", None)
        if keys is None:
            return  # called by nn.Linear's constructor: values come once the keys are set
        for name, key in keys.items():
            tensor = getattr(self, name)
            write_(tensor, seeded_values(key, tuple(tensor.shape)))


class GraphLinear(_SeededInit, nn.Linear):
    pass


class GraphMLP(_SeededInit, nn.Module):
    """``out_proj(relu(in_proj(x))) + buffer`` (the buffer cast to the activations' dtype)."""

    def __init__(self, in_proj: nn.Module, out_proj: nn.Module, width: int, device: str) -> None:
        super().__init__()
        self.in_proj, self.out_proj = in_proj, out_proj
        self.register_buffer("buffer", torch.zeros(width, dtype=DTYPE, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.out_proj(torch.relu(self.in_proj(x)))
        out: torch.Tensor = hidden + self.buffer.to(hidden.dtype)  # buffers follow activations
        return out


class GraphStack(nn.Module):
    """Runs the modules of its ``ModuleList`` one after another."""

    def __init__(self, layers: nn.ModuleList) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@dataclass
class BuiltGraph:
    """The modules of a graph on one rank, indexed by node."""

    graph: ModuleGraph
    modules: list[nn.Module]
    seed: int

    @property
    def root(self) -> nn.Module:
        return self.modules[0]

    def node_of(self, module: nn.Module) -> int:
        return next(i for i, m in enumerate(self.modules) if m is module)

    def places(self) -> Iterator[tuple[Loc, torch.Tensor]]:
        """Every parameter and buffer place with the tensor it holds now."""
        for node in range(len(self.graph.nodes)):
            for loc in self.graph.param_locs(node) + self.graph.buffer_locs(node):
                yield loc, getattr(self.modules[node], loc[1])

    def canonical(self, tensor: torch.Tensor) -> Loc:
        """The canonical place of a parameter or buffer this graph holds now."""
        for loc, held in self.places():
            if held is tensor:
                return self.graph.source(loc)
        raise AssertionError("a tensor that no place of the graph holds")

    def reset(self) -> None:
        for module in self.modules:
            if isinstance(module, _SeededInit):
                module.reset_parameters()


def _make(
    graph: ModuleGraph, node: int, made: list[nn.Module], width: int, device: str
) -> nn.Module:
    spec = graph.nodes[node]
    kids = [made[c] for c in spec.children]
    if spec.kind == "linear":
        return GraphLinear(width, width, bias=spec.bias, device=device, dtype=DTYPE)
    if spec.kind == "mlp":
        return GraphMLP(kids[0], kids[1], width, device)
    if spec.kind == "seq":
        return nn.Sequential(*kids)
    if spec.kind == "list":
        return nn.ModuleList(kids)
    return GraphStack(kids[0])  # type: ignore[arg-type]


def build_graph(case: GraphCase, device: torch.device | str) -> BuiltGraph:
    """The graph's modules on ``device`` (or meta), ties applied; values seeded unless meta."""
    graph = case.graph
    target = "meta" if case.meta else str(device)
    made: list[nn.Module] = [nn.Module()] * len(graph.nodes)
    for node in reversed(range(len(graph.nodes))):  # children have larger indices
        made[node] = _make(graph, node, made, case.width, target)
    for tie in graph.ties:
        setattr(made[tie.node], tie.name, getattr(made[tie.source], tie.name))
    for node, module in enumerate(made):
        if isinstance(module, _SeededInit):
            locs = graph.param_locs(node) + graph.buffer_locs(node)
            module.init_keys = {loc[1]: (case.seed, "graph", graph.source(loc)) for loc in locs}
    built = BuiltGraph(graph, made, case.seed)
    if not case.meta:
        built.reset()
    return built


def graph_batch(case: GraphCase, world_size: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets of one step's global batch; rank ``r`` trains on its rows."""
    rng = np.random.default_rng([case.seed, step])
    rows = world_size * case.batch_per_rank
    return rng.uniform(-1, 1, (rows, case.width)), rng.uniform(-1, 1, (rows, case.width))


def build_mesh_mlp(case: MLPMeshCase, device: torch.device | str) -> GraphMLP:
    """The MLP of a mesh case (``in_proj``: width -> hidden), seeded unless on meta."""
    target = "meta" if case.meta else str(device)
    linear = {"device": target, "dtype": DTYPE, "bias": case.bias}
    in_proj = GraphLinear(case.width, case.hidden, **linear)  # type: ignore[arg-type]
    out_proj = GraphLinear(case.hidden, case.width, **linear)  # type: ignore[arg-type]
    model = GraphMLP(in_proj, out_proj, case.width, target)
    for prefix, module in (("in_proj", in_proj), ("out_proj", out_proj)):
        names = ("weight", "bias") if case.bias else ("weight",)
        module.init_keys = {n: (case.seed, "mlp", (0, f"{prefix}.{n}")) for n in names}
    model.init_keys = {"buffer": (case.seed, "mlp", (0, "buffer"))}
    if not case.meta:
        reset_all(model)
    return model


def reset_all(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, _SeededInit):
            module.reset_parameters()


def mesh_batch(case: MLPMeshCase, dp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Global batch; data-parallel rank ``i`` trains on rows ``i*b:(i+1)*b``."""
    rng = np.random.default_rng([case.seed, 7])
    rows = dp_size * case.batch_per_dp_rank
    return rng.uniform(-1, 1, (rows, case.width)), rng.uniform(-1, 1, (rows, case.width))


class ListWithForward(nn.ModuleList):
    """A ModuleList that runs its modules in order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        return x


class DictWithForward(nn.ModuleDict):
    """A ModuleDict that runs its modules in insertion order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.values():
            x = layer(x)
        return x


def build_linears(
    dims: tuple[int, ...], seed: int, device: torch.device | str
) -> list[GraphLinear]:
    """Seeded ``Linear(dims[i], dims[i + 1])`` layers."""
    layers = [
        GraphLinear(d_in, d_out, device=device, dtype=DTYPE)
        for d_in, d_out in itertools.pairwise(dims)
    ]
    for index, layer in enumerate(layers):
        layer.init_keys = {n: (seed, "linears", (index, n)) for n in ("weight", "bias")}
        layer.reset_parameters()
    return layers


class FrozenMixedDtypes(nn.Module):
    """A frozen float8 weight beside a trainable float32 one: ``x W32^T + x W8^T``."""

    def __init__(self, width: int, seed: int, device: torch.device | str) -> None:
        super().__init__()
        shape = (width, width)
        frozen = seeded_values((seed, "mixed", (0, "w_fp8")), shape).to(torch.float8_e4m3fn)
        trained = seeded_values((seed, "mixed", (0, "w_fp32")), shape).to(torch.float32)
        self.w_fp8 = nn.Parameter(frozen.to(device), requires_grad=False)
        self.w_fp32 = nn.Parameter(trained.to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w_fp32.T + x @ self.w_fp8.to(torch.float32).T
