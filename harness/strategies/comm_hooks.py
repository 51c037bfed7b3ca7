"""Strategies for DDP communication hooks (``cases.comm_hooks``)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from hypothesis import strategies as st

from harness.cases.comm_hooks import HOOKS, CommHook
from harness.errors import check_subset
from harness.strategies._common import sampled


def comm_hooks(
    names: Sequence[str] = HOOKS, *, states: bool = False
) -> st.SearchStrategy[CommHook]:
    """A hook of ``names``; ``states=True`` sometimes registers it with the DDP model's
    process group as its state (the default hooks all-reduce over the state's group)."""
    check_subset("names", names, HOOKS, non_empty=True)
    return _comm_hooks(tuple(names), states)


@cache
def _comm_hooks(names: tuple[str, ...], states: bool) -> st.SearchStrategy[CommHook]:
    group_state = st.booleans() if states else st.just(False)
    return st.builds(CommHook, name=sampled(names), group_state=group_state)
