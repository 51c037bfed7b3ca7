"""Strategies for DDP communication hooks (``cases.comm_hooks``)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from hypothesis import strategies as st

from harness.cases.comm_hooks import HOOKS, CommHook
from harness.errors import check_subset
from harness.strategies._common import sampled


def comm_hooks(
    names: Sequence[str] = HOOKS, *, several_buckets: bool = False
) -> st.SearchStrategy[CommHook]:
    """A hook of ``names``; PowerSGD starts compressing at iteration 2 or 3 (after one or
    two of plain all-reduce), with and without error feedback, and without warm start only
    on a model of one bucket (``several_buckets=False``).

    Without warm start, the first bucket PowerSGD finishes clears the P and Q memories of
    every bucket while the others' callbacks still need theirs: KeyError in a callback, or
    a hang, on torch 2.13 and 2.15 (gloo), depending on the order the futures complete in."""
    check_subset("names", names, HOOKS, non_empty=True)
    return _comm_hooks(tuple(names), several_buckets)


@cache
def _comm_hooks(names: tuple[str, ...], several_buckets: bool) -> st.SearchStrategy[CommHook]:
    return st.builds(
        CommHook,
        name=sampled(names),
        start_iter=sampled((2, 3)),
        error_feedback=st.booleans(),
        warm_start=st.just(True) if several_buckets else st.booleans(),
    )
