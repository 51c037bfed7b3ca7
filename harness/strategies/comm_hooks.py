"""Strategies for DDP communication hooks (``cases.comm_hooks``)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from hypothesis import strategies as st

from harness.cases.comm_hooks import HOOKS, CommHook
from harness.errors import check_subset
from harness.strategies._common import sampled


def comm_hooks(names: Sequence[str] = HOOKS) -> st.SearchStrategy[CommHook]:
    """A hook of ``names``."""
    check_subset("names", names, HOOKS, non_empty=True)
    return _comm_hooks(tuple(names))


@cache
def _comm_hooks(names: tuple[str, ...]) -> st.SearchStrategy[CommHook]:
    return st.builds(CommHook, name=sampled(names))
