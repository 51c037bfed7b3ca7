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

    Three caches hold rank-dependent values under mesh keys: the planner cache
    (``get_redistribute_planner``, whose planner keeps its mesh alive, so an entry never dies),
    ``_gen_transform_infos`` (the logical shapes of uneven shards) and sharding propagation's
    (output specs that hold the mesh they were computed on; a Python and a C++ cache). A
    mesh compares equal to an older one with the same layout (and, on the threaded backend,
    the same thread ident, which the OS reuses), so without this a new mesh can be served a
    plan that belongs to another rank, or an output spec whose mesh names process groups that
    were destroyed ("Could not resolve the process group registered under the name ...").
    """
    from torch.distributed.tensor import _redistribute, debug

    clears: list[Any] = [
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        # the Python cache (this thread's) and the C++ dispatch fast path's
        getattr(debug, "_clear_sharding_prop_cache", None),
    ]
    for clear in clears:
        if not callable(clear):
            raise RuntimeError(
                "torch.distributed.tensor no longer has _redistribute._gen_transform_infos."
                "cache_clear, _redistribute.clear_redistribute_planner_cache and "
                "debug._clear_sharding_prop_cache: review harness.torchkit.internals for this "
                "torch version"
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


# --- FSDP2 (fully_shard) private helpers ------------------------------------------------------
# The FSDP init suite reads what fully_shard decided: managed modules and states, each
# parameter's ParamModuleInfo, the lazy-init root flag, state order and FQNs. Known to match
# these torch versions; on any other, a missing name fails here, naming this file.
FSDP_KNOWN_TORCH = ("2.13",)


def _fsdp_missing(what: str) -> RuntimeError:
    import torch

    return RuntimeError(
        f"{what} is gone in torch {torch.__version__} (distconf knows FSDP internals of torch "
        f"{', '.join(FSDP_KNOWN_TORCH)}): review harness.torchkit.internals for this version"
    )


def _fsdp_module(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(f"torch.distributed.fsdp._fully_shard.{name}")
    except ImportError:
        raise _fsdp_missing(f"torch.distributed.fsdp._fully_shard.{name}") from None


def _attr(obj: Any, name: str, where: str) -> Any:
    if not hasattr(obj, name):
        raise _fsdp_missing(f"{where}.{name}")
    return getattr(obj, name)


def fsdp_comm_interfaces() -> tuple[Any, Any]:
    """``AllGather`` and ``ReduceScatter``: the interfaces ``FSDPModule.set_custom_all_gather``
    and ``set_custom_reduce_scatter`` document, which torch.distributed.fsdp does not export."""
    api = _fsdp_module("_fsdp_api")
    where = "torch.distributed.fsdp._fully_shard._fsdp_api"
    return _attr(api, "AllGather", where), _attr(api, "ReduceScatter", where)


def fsdp_managed_modules(roots: tuple[Any, ...]) -> list[Any]:
    """``_get_managed_modules(roots)``: the modules a ``fully_shard(roots)`` would manage."""
    return list(_attr(_fsdp_module("_fsdp_init"), "_get_managed_modules", "_fsdp_init")(roots))


def fsdp_managed_states(modules: list[Any]) -> tuple[list[Any], list[Any]]:
    """``_get_managed_states(modules)``: their parameters and buffers, each object once."""
    params, buffers = _attr(_fsdp_module("_fsdp_init"), "_get_managed_states", "_fsdp_init")(
        modules
    )
    return list(params), list(buffers)


def fsdp_state(module: Any) -> Any:
    """The FSDP state of a module ``fully_shard`` was applied to, or None."""
    getter = _attr(_fsdp_module("_fsdp_state"), "_get_module_fsdp_state", "_fsdp_state")
    return getter(module)


def fsdp_param_groups(state: Any) -> list[Any]:
    """The state's ``FSDPParamGroup``s (none when it manages no parameter)."""
    return list(_attr(state, "_fsdp_param_groups", "FSDPState"))


def fsdp_params(group: Any) -> list[Any]:
    return list(_attr(group, "fsdp_params", "FSDPParamGroup"))


def fsdp_param_module_info(fsdp_param: Any) -> tuple[Any, str, list[Any], list[str]]:
    """``FSDPParam._module_info``: (module, name, shared modules, shared names)."""
    info = _attr(fsdp_param, "_module_info", "FSDPParam")
    return (
        _attr(info, "module", "ParamModuleInfo"),
        _attr(info, "param_name", "ParamModuleInfo"),
        list(_attr(info, "shared_modules", "ParamModuleInfo")),
        list(_attr(info, "shared_param_names", "ParamModuleInfo")),
    )


def fsdp_lazy_init(state: Any) -> None:
    _attr(state, "_lazy_init", "FSDPState")()


def fsdp_is_root(state: Any) -> bool | None:
    is_root: bool | None = _attr(state, "_is_root", "FSDPState")
    return is_root


def fsdp_all_states(state: Any) -> list[Any]:
    return list(_attr(_attr(state, "_state_ctx", "FSDPState"), "all_states", "FSDPStateContext"))


def fsdp_module_fqn(group: Any) -> str | None:
    fqn: str | None = _attr(group, "_module_fqn", "FSDPParamGroup")
    return fqn


def fsdp_param_fqn(fsdp_param: Any) -> str | None:
    fqn: str | None = _attr(fsdp_param, "_param_fqn", "FSDPParam")
    return fqn


def group_ranks_of_name(group_name: str) -> tuple[int, ...]:
    """Global ranks of the process group a functional collective names by its group name."""
    from torch.distributed import distributed_c10d

    resolve = getattr(distributed_c10d, "_resolve_process_group", None)
    if not callable(resolve):
        raise RuntimeError(
            "torch.distributed.distributed_c10d no longer has _resolve_process_group: "
            "review harness.torchkit.internals for this torch version"
        )
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(resolve(group_name)))


def fsdp1_replicate_group(unit: Any) -> Any:
    """The replicate group FSDP1 all-reduces a hybrid unit's gradients over: the private
    ``_inter_node_pg`` (None when the unit is not hybrid)."""
    return getattr(unit, "_inter_node_pg", None)


def dtensor_rng_tracker_active() -> bool:
    """Whether DTensor's random-number tracker is in use in this process
    (``torch.distributed.tensor._random._rng_tracker``: made on the first random op on a
    mesh whose device supports it; None on CPU meshes, where each rank draws from its own
    generator)."""
    from torch.distributed.tensor import _random

    if not hasattr(_random, "_rng_tracker"):
        raise RuntimeError(
            "torch.distributed.tensor._random._rng_tracker is gone from this torch: "
            "harness.torchkit.internals.dtensor_rng_tracker_active must be updated"
        )
    return _random._rng_tracker is not None


def key_plan_cache(planner: Any, suffix: str) -> None:
    """Give a ``DefaultSavePlanner``'s plan cache (a class attribute, keyed by
    ``_cached_plans_key``, its class's name) a key of its own ending in ``suffix``."""
    import torch

    if not hasattr(planner, "_cached_plans_key"):
        raise RuntimeError(
            f"DefaultSavePlanner._cached_plans_key is gone in torch {torch.__version__}: "
            "review harness.torchkit.internals.key_plan_cache for this version"
        )
    planner._cached_plans_key = f"{planner._cached_plans_key}:{suffix}"
