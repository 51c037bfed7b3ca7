"""The concrete cases strategies draw and ranks receive: small, picklable, readable reprs.

A case holds only plain values (tuples, ints, strings and the torch-free placements of
``specs.placements``). Every rank derives its tensors from ``seed`` (``seeded_arrays``), so
every rank sees the same global input without drawing anything itself. One module per
strategies module; ``call()`` spells the case as the call it stands for (the reproduction in
failure messages).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def seeded_arrays(
    key: Sequence[int], shapes: Sequence[tuple[int, ...]], dtype: str
) -> list[np.ndarray]:
    """Arrays of ``shapes`` uniform in [-1, 1) from a generator seeded with ``key`` (a case's
    seed and the stream it names), rounded to ``dtype`` and held in float64."""
    rng = np.random.default_rng(list(key))
    values = [rng.uniform(-1.0, 1.0, size=shape) for shape in shapes]
    return [np.asarray(value, dtype=dtype).astype(np.float64) for value in values]
