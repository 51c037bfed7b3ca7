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


def local_shape_and_global_offset(dtensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where this rank's shard of ``dtensor`` sits in the global tensor, as DCP and FSDP's
    state dicts compute it (``torch.distributed.tensor._utils``, private in torch 2.13)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        dtensor.shape, dtensor.device_mesh, dtensor.placements
    )
    return tuple(map(int, shape)), tuple(map(int, offset))
