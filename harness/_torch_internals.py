"""The private torch internals distconf touches, in one place, each failing loudly when gone.

``torch.testing._internal`` is not here: only ``harness/runners/_threaded_pg.py`` imports it.
"""

from __future__ import annotations

import logging
from typing import Any

# DTensor warns on every redistribute that needs several collectives ("N sequential
# all_gather operations"), once per rank: advice for model authors, noise in a failure report.
_CHATTY_LOGGERS = ("torch.distributed.tensor._redistribute",)


def quiet_known_warnings() -> None:
    for name in _CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def clear_dtensor_plan_caches() -> None:
    """Drop DTensor's process-wide redistribute caches, which are keyed by device mesh.

    Two caches hold rank-dependent values under mesh keys: the planner cache
    (``get_redistribute_planner``, whose planner keeps its mesh alive, so an entry never dies)
    and ``_gen_transform_infos`` (the logical shapes of uneven shards). A mesh compares equal
    to an older one with the same layout (and, on the threaded backend, the same thread
    ident, which the OS reuses), so without this a new mesh can be served a plan that belongs
    to another rank or to process groups that were destroyed.
    """
    from torch.distributed.tensor import _redistribute

    clears: list[Any] = [
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
    ]
    for clear in clears:
        if not callable(clear):
            raise RuntimeError(
                "torch.distributed.tensor._redistribute no longer has "
                "_gen_transform_infos.cache_clear and clear_redistribute_planner_cache: "
                "review harness._torch_internals for this torch version"
            )
        clear()


def group_ranks_of_name(group_name: str) -> tuple[int, ...]:
    """Global ranks of the process group a functional collective names by its group name."""
    from torch.distributed import distributed_c10d

    resolve = getattr(distributed_c10d, "_resolve_process_group", None)
    if not callable(resolve):
        raise RuntimeError(
            "torch.distributed.distributed_c10d no longer has _resolve_process_group: "
            "review harness._torch_internals for this torch version"
        )
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(resolve(group_name)))


def fsdp1_replicate_group(unit: Any) -> Any:
    """The replicate group FSDP1 all-reduces a hybrid unit's gradients over: the private
    ``_inter_node_pg`` (None when the unit is not hybrid)."""
    return getattr(unit, "_inter_node_pg", None)
