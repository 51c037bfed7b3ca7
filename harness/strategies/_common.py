"""Building blocks of distconf's hypothesis strategies: argument checks, world and tensor
shapes, dtypes, seeds.

Strategies run only in the driver. Each public strategy validates its arguments eagerly
through ``harness.errors`` (``world_size=0 must be a positive int``); what it draws always
fits together. Strategy objects are built once per distinct argument: building them inside
every draw costs more than the draw itself.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from functools import cache
from itertools import product
from typing import Any, TypeVar

from hypothesis import strategies as st

from harness.cases.placements import DTYPES
from harness.errors import check_int, check_subset, require

T = TypeVar("T")
MAX_SIDE = 17
MAX_MESH_NDIM = 3

Lacks = frozenset[str]
"""What the World a case is drawn for cannot serve (``World.lacks``); a strategy given it
never draws what it names (``mesh.from_group``: a mesh from an axis group;
``scatter.group_src``: a ``src_data_rank`` other than 0)."""


def checked_lacks(lacks: object) -> Lacks:
    """``lacks`` as a frozenset of names, refused (``InvalidArgument``) when it is not one."""
    require(
        isinstance(lacks, frozenset | set | tuple | list)
        and all(isinstance(name, str) for name in lacks),
        "lacks",
        lacks,
        "a frozenset of the names a World lacks (World.lacks)",
    )
    assert isinstance(lacks, frozenset | set | tuple | list)
    return frozenset(lacks)


def takes_world_size(
    composite: Callable[..., st.SearchStrategy[T]],
) -> Callable[..., st.SearchStrategy[T]]:
    """Validate ``world_size`` (``harness.errors.check_int``) when the strategy is built, not
    when it is first drawn from; build each distinct strategy once (tests ask for one in
    every example)."""
    built = functools.lru_cache(maxsize=256, typed=True)(composite)

    @functools.wraps(composite)
    def strategy(world_size: int, **kwargs: Any) -> st.SearchStrategy[T]:
        check_int("world_size", world_size)
        if "lacks" in kwargs:
            kwargs["lacks"] = checked_lacks(kwargs["lacks"])
        return built(world_size, **kwargs)

    return strategy


@cache
def factorisations(world_size: int, max_ndim: int) -> tuple[tuple[int, ...], ...]:
    """Every ordered factorisation of ``world_size`` into 1..``max_ndim`` factors, 1s included."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return tuple(
        shape
        for ndim in range(1, max_ndim + 1)
        for shape in product(divisors, repeat=ndim)
        if math.prod(shape) == world_size
    )


def reshard_factors(shard_size: int) -> tuple[int, ...]:
    """The ints ``reshard_after_forward`` can take to reshard a shard group of
    ``shard_size`` ranks to a smaller one: its factors above 1 and below it."""
    return tuple(f for f in range(2, shard_size) if shard_size % f == 0)


def sampled(values: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    """``st.sampled_from(values)``, built once per distinct ``values``: keyed by each value's
    type too, since ``(True,) == (1,)`` and ``(False,) == (0,)`` hash alike and a cache keyed
    on the values alone hands ``sampled((True,))`` to whoever asks for ``sampled((1,))``."""
    return _sampled(tuple(type(v) for v in values), values)


@cache
def _sampled(types: tuple[type, ...], values: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    return st.sampled_from(values)


_SEEDS = st.integers(0, 2**32 - 1)


def mesh_shapes(
    world_size: int, *, max_ndim: int = MAX_MESH_NDIM
) -> st.SearchStrategy[tuple[int, ...]]:
    """Mesh shapes whose product is ``world_size``, 1-D first (hypothesis shrinks there).

    Four draws in five avoid size-1 axes, which add mesh dims that move no data; the fifth
    may have them (a size-1 axis is still a case DTensor must get right).
    """
    check_int("world_size", world_size)
    check_int("max_ndim", max_ndim)
    every = factorisations(world_size, max_ndim)
    real = tuple(shape for shape in every if 1 not in shape) or every
    return mix((4, sampled(real)), (1, sampled(every)))


def shapes(
    *, min_ndim: int = 0, max_ndim: int = 3, max_side: int = MAX_SIDE, near: int = 4
) -> st.SearchStrategy[tuple[int, ...]]:
    """Global tensor shapes, weighted towards sides that make uneven pieces on a mesh axis
    of size ``near``: most sides are 1..2*near+1 (smaller than the axis, not divisible by
    it, a few pieces each), some are empty (0) or up to ``max_side``; 0-d tensors are rare.
    Every draw checks values: a shape with a zero side or no dims is never the majority."""
    check_int("min_ndim", min_ndim, 0)
    check_int("max_ndim", max_ndim, min_ndim)
    check_int("max_side", max_side, 0)
    check_int("near", near)
    return _shapes(min_ndim, max_ndim, max_side, min(near, max_side))


@cache
def mix(*weighted: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """Draw from each strategy with its weight; the first shrinks best (list it first)."""
    picks = tuple(strategy for weight, strategy in weighted for _ in range(weight))
    return st.integers(0, len(picks) - 1).flatmap(lambda pick: picks[pick])


@cache
def _shapes(
    min_ndim: int, max_ndim: int, max_side: int, near: int
) -> st.SearchStrategy[tuple[int, ...]]:
    ranks = tuple(range(max(1, min_ndim), max_ndim + 1)) or (min_ndim,)
    ndim = mix((9, sampled(ranks)), (1, sampled((min_ndim,))))
    uneven = st.integers(min(1, max_side), min(max_side, 2 * near + 1))
    side = mix((16, uneven), (3, st.integers(0, max_side)), (1, st.just(0)))
    return ndim.flatmap(lambda n: st.tuples(*[side] * n))


def dtypes(allowed: Sequence[str] = DTYPES) -> st.SearchStrategy[str]:
    check_subset("allowed", allowed, DTYPES, non_empty=True)
    return sampled(tuple(allowed))


def seeds() -> st.SearchStrategy[int]:
    return _SEEDS
