"""Strategies for training cases: small models, batches and optimizer steps."""

from __future__ import annotations

from hypothesis import strategies as st

from harness.cases import MLPCase
from harness.strategies._common import seeds, takes_world_size


@takes_world_size
@st.composite
def mlp_cases(draw: st.DrawFn, world_size: int) -> MLPCase:
    """MLPs whose feature sizes are drawn around the world size (uneven and empty shards)."""
    n_layers = draw(st.integers(1, 3))
    dims = tuple(draw(st.integers(1, 2 * world_size + 1)) for _ in range(n_layers + 1))
    return MLPCase(
        dims=dims,
        bias=draw(st.booleans()),
        shard_layers=draw(st.booleans()),
        batch_per_rank=draw(st.integers(1, 3)),
        lr=draw(st.sampled_from((0.1, 0.01))),
        momentum=draw(st.sampled_from((0.0, 0.9))),
        dtype=draw(st.sampled_from(("float64", "float32"))),
        seed=draw(seeds()),
    )
