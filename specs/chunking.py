"""Chunk sizes and offsets under ``torch.chunk`` semantics.

``torch.chunk(t, k)`` splits a dim of size ``n`` into pieces of ``ceil(n / k)`` elements; the
last piece is short and there may be fewer than ``k`` pieces. DTensor's ``Shard`` gives rank
``r`` of a mesh axis of size ``k`` the ``r``-th piece, and an empty piece to every rank past
the last one.
"""

from __future__ import annotations

from harness.errors import check_int, require


def _check_sizes(n: int, k: int) -> None:
    """``n``: the size of the dim to split; ``k``: the number of ranks on the mesh axis."""
    check_int("n", n, 0)
    check_int("k", k)


def chunk_size(n: int, k: int) -> int:
    """Size of every full chunk: ``ceil(n / k)`` (0 when ``n`` is 0)."""
    _check_sizes(n, k)
    return -(-n // k)


def num_chunks(n: int, k: int) -> int:
    """How many non-empty chunks ``torch.chunk`` returns; may be fewer than ``k``."""
    full = chunk_size(n, k)
    return 0 if full == 0 else -(-n // full)


def shard_sizes(n: int, k: int) -> tuple[int, ...]:
    """The size of the piece held by each of the ``k`` ranks, trailing ranks short or empty."""
    full = chunk_size(n, k)
    return tuple(max(0, min(full, n - r * full)) for r in range(k))


def shard_offsets(n: int, k: int) -> tuple[int, ...]:
    """The global index where each rank's piece starts (``n`` for an empty piece past the end)."""
    full = chunk_size(n, k)
    return tuple(min(r * full, n) for r in range(k))


def shard_range(n: int, k: int, rank: int) -> tuple[int, int]:
    """``(offset, size)`` of ``rank``'s piece."""
    _check_sizes(n, k)
    require(isinstance(rank, int) and 0 <= rank < k, "rank", rank, f"an int in [0, {k})")
    return shard_offsets(n, k)[rank], shard_sizes(n, k)[rank]
