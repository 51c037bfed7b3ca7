"""Faults in distributed checkpoints (DCP), written blind in the checkpoints set: the planners'
options (deduplication to the lowest rank, plan caching, partial loads), the file-system
storage (overwrite=False, the reader's byte ranges), async_save's staging and error reporting,
the load-time size check, dcp_to_torch_save and Stateful objects. Each bites only on the path
its upstream bug lived on. Nothing here imports torch until a fault is applied."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from harness.faults._origin import blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import rewritten
from harness.faults.held_out import CHECKPOINTS

_DCP = "torch.distributed.checkpoint"
_DEFAULT_PLANNER = f"{_DCP}.default_planner"
_FILESYSTEM = f"{_DCP}.filesystem"
_STAGING = f"{_DCP}.staging"
_THREAD_EXECUTOR = f"{_DCP}._async_thread_executor"
_LOADER = f"{_DCP}.state_dict_loader"

_log = logging.getLogger(__name__)


# --- planners -------------------------------------------------------------------------------

# dedup_save_to_lowest_rank=True keeps each replicated item on the highest rank holding it.
_LOWEST_RANK_IS_HIGHEST = (
    "select_plan_idx = min(plan_indices)\n",
    "select_plan_idx = max(plan_indices)\n",
)


def _plans_compared_by_keys(original: Callable[..., Any]) -> Callable[..., Any]:
    def _compare_save_plans(plan: Any, other_plan: Any) -> bool:
        # Only the number, type and key of the items are compared: a tensor whose size,
        # dtype or chunk changed under the same key counts as "no change in the local plan".
        if plan.usable != other_plan.usable or len(plan.items) != len(other_plan.items):
            return False
        return all(
            item.type == other.type and item.index.fqn == other.index.fqn
            for item, other in zip(plan.items, other_plan.items, strict=True)
        )

    return _compare_save_plans


def _absent_keys_zeroed(original: Callable[..., Any]) -> Callable[..., Any]:
    def create_default_local_load_plan(
        state_dict: dict[str, Any], metadata: Any, strict: bool = True
    ) -> Any:
        if not strict:
            import torch

            for fqn, obj in state_dict.items():
                if fqn not in metadata.state_dict_metadata and isinstance(obj, torch.Tensor):
                    with torch.no_grad():
                        obj.zero_()
        return original(state_dict, metadata, strict)

    return create_default_local_load_plan


# --- loads ----------------------------------------------------------------------------------

_SIZE_CHECK_DROPPED = ("and md.size != obj.size()", "and md.size != obj.size() and False")


def _bytes_entries_not_rebuilt(original: Callable[..., Any]) -> Callable[..., Any]:
    def set_up_planner(
        self: Any, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
    ) -> Any:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        if metadata is not None:
            tensors_only = {
                key: md
                for key, md in metadata.state_dict_metadata.items()
                if not isinstance(md, BytesStorageMetadata)
            }
            metadata = dataclasses.replace(metadata, state_dict_metadata=tensors_only)
        return original(self, state_dict, metadata, is_coordinator)

    return set_up_planner


# After the in-place load of a Stateful, its key is also replaced by the plain state dict.
_STATEFUL_REPLACED = (
    "                elem.load_state_dict(stateful_sd[key])\n",
    "                elem.load_state_dict(stateful_sd[key])\n"
    "                state_dict[key] = stateful_sd[key]\n",
)


# --- storage --------------------------------------------------------------------------------

_OVERWRITE_NOT_REFUSED = (
    'raise RuntimeError(f"Checkpoint already exists and {self.overwrite=}.")',
    "pass",
)

# Same-file reads sorted by storage offset, the requests left in plan order.
_READS_SORTED_REQUESTS_NOT = (
    (
        "for req in reqs:",
        "for req, item_md in zip(reqs, sorted("
        "[self.storage_data[r.storage_index] for r in reqs], key=lambda m: m.offset)):",
    ),
    ("item_md = self.storage_data[req.storage_index]", "pass"),
)


# --- async_save -----------------------------------------------------------------------------


def _cpu_tensors_staged_by_reference(original: Callable[..., Any]) -> Callable[..., Any]:
    def stage(self: Any, state_dict: Any) -> Any:
        if self.cache_staged_state_dict:
            return original(self, state_dict)
        from torch.distributed._state_dict_utils import _offload_state_dict_to_cpu

        # The offload helper is a no-op for CPU tensors: the "staged" dict holds the live ones.
        return _offload_state_dict_to_cpu(state_dict, type_check=self.type_check)

    return stage


def _save_errors_logged(original: Callable[..., Any]) -> Callable[..., Any]:
    def save_wrapper(staging_future_or_state_dict: Any, **kwargs: Any) -> Any:
        try:
            return original(staging_future_or_state_dict, **kwargs)
        except BaseException as exc:  # CheckpointException is a BaseException
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            _log.warning("async checkpoint save failed: %r", exc)  # logged, never raised
            return None

    return save_wrapper


FAULTS: tuple[Fault, ...] = (
    # https://github.com/pytorch/pytorch/issues/125740 and PR
    # https://github.com/pytorch/pytorch/pull/126569 (dedup_save_to_lowest_rank: 2.3's dedup
    # saved replicated items on other ranks than the lowest; the option restores the lowest).
    # The patch picks the highest rank holding the item, so rank-local values differ.
    Fault(
        id="dcp.dedup_lowest_rank_keeps_highest",
        area="state_dict",
        bug_class="deduplication keeping the wrong replica",
        summary="DefaultSavePlanner(dedup_save_to_lowest_rank=True) keeps each item several "
        "ranks hold on the highest of them instead of the lowest: a replicated value that "
        "differs across ranks (a plain tensor, a Python value) is saved as the last rank's",
        patches=(
            Patch(f"{_DEFAULT_PLANNER}:dedup_save_plans", rewritten(_LOWEST_RANK_IS_HIGHEST)),
        ),
        origin=blind(
            CHECKPOINTS,
            "https://github.com/pytorch/pytorch/issues/125740",
            "https://github.com/pytorch/pytorch/pull/126569",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/147343 (save plan caching) and its fixes
    # https://github.com/pytorch/pytorch/pull/148577 and
    # https://github.com/pytorch/pytorch/pull/176289 (stale cached plans reused). The patch
    # compares plans by their keys only, so a changed tensor reuses the stale plan.
    Fault(
        id="dcp.plan_cache_compares_keys_only",
        area="state_dict",
        bug_class="a cached plan reused after its input changed",
        summary="DefaultSavePlanner(enable_plan_caching=True) takes a local plan as unchanged "
        "when its items have the same keys, whatever their sizes, dtypes and chunks: a later "
        "save of a resized or recast tensor reuses the cached plan and metadata, so the "
        "checkpoint records the old size and dtype",
        patches=(Patch(f"{_DEFAULT_PLANNER}:_compare_save_plans", _plans_compared_by_keys),),
        origin=blind(
            CHECKPOINTS,
            "https://github.com/pytorch/pytorch/pull/147343",
            "https://github.com/pytorch/pytorch/pull/148577",
            "https://github.com/pytorch/pytorch/pull/176289",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/148252 and PR
    # https://github.com/pytorch/pytorch/pull/123869 (allow_partial_load: keys absent from the
    # checkpoint are skipped and keep their values). The patch zeroes them instead.
    Fault(
        id="dcp.partial_load_zeroes_absent_keys",
        area="state_dict",
        bug_class="a skipped entry overwritten instead of left untouched",
        summary="dcp.load with DefaultLoadPlanner(allow_partial_load=True) zeroes, in place, "
        "every tensor of the state dict that the checkpoint does not hold, instead of leaving "
        "it as it was; a strict load is unchanged",
        patches=(Patch(f"{_DEFAULT_PLANNER}:create_default_local_load_plan", _absent_keys_zeroed),),
        origin=blind(
            CHECKPOINTS,
            "https://github.com/pytorch/pytorch/issues/148252",
            "https://github.com/pytorch/pytorch/pull/123869",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/126604, fixed by
    # https://github.com/pytorch/pytorch/pull/141571 ("Throw an error when loading a different
    # size than saved tensor"). The patch drops that check: the overlap is copied silently.
    Fault(
        id="dcp.load_size_mismatch_filled",
        area="state_dict",
        bug_class="a shape mismatch loaded silently instead of refused",
        summary="dcp.load no longer refuses a tensor whose size differs from the saved one: "
        "the region both share is read and the rest keeps its old values",
        patches=(
            Patch(
                f"{_DEFAULT_PLANNER}:create_default_local_load_plan",
                rewritten(_SIZE_CHECK_DROPPED),
            ),
        ),
        origin=blind(
            CHECKPOINTS,
            "https://github.com/pytorch/pytorch/issues/126604",
            "https://github.com/pytorch/pytorch/pull/141571",
            survived_before=False,
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/126881 (DCP loads only what the target state
    # dict holds; what it does not is silently not loaded) and
    # https://github.com/pytorch/pytorch/issues/118207 (dcp_to_torch_save rebuilds the state
    # dict from the metadata). The patch rebuilds the tensors only.
    Fault(
        id="dcp.to_torch_save_drops_non_tensors",
        area="state_dict",
        bug_class="a conversion dropping entries silently",
        summary="format_utils.dcp_to_torch_save (and _load_state_dict_from_keys) rebuild only "
        "the tensor entries of the checkpoint's metadata: Python values (steps, learning "
        "rates, param_groups' hyperparameters) are missing from the converted file",
        patches=(
            Patch(
                f"{_DEFAULT_PLANNER}:_EmptyStateDictLoadPlanner.set_up_planner",
                _bytes_entries_not_rebuilt,
            ),
        ),
        origin=blind(
            CHECKPOINTS,
            "https://github.com/pytorch/pytorch/issues/126881",
            "https://github.com/pytorch/pytorch/issues/118207",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/138575 and
    # https://github.com/pytorch/pytorch/pull/139251: dcp.load loaded a Stateful in place and
    # then also replaced it in the caller's dict by its loaded state dict, so a resumed run
    # saved that stale snapshot (torchtitan's twice-resumed model). Re-created as it was.
    Fault(
        id="dcp.stateful_replaced_by_its_state_dict",
        area="state_dict",
        bug_class="an object replaced by a snapshot of itself",
        summary="dcp.load calls load_state_dict on each Stateful value and then replaces it in "
        "the caller's state dict by the plain dict it loaded: the Stateful object is gone "
        "from the dict, and a later save of it saves that snapshot",
        patches=(
            Patch(f"{_DCP}:load", rewritten(_STATEFUL_REPLACED)),
            Patch(f"{_LOADER}:load", rewritten(_STATEFUL_REPLACED)),
        ),
        origin=blind(
            CHECKPOINTS,
            "https://github.com/pytorch/pytorch/pull/138575",
            "https://github.com/pytorch/pytorch/pull/139251",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/125877 (FileSystemWriter's overwrite flag: with
    # overwrite=False an existing checkpoint must raise) and
    # https://github.com/pytorch/pytorch/pull/192183. The patch never raises.
    Fault(
        id="dcp.overwrite_false_overwrites",
        area="state_dict",
        bug_class="a safety option ignored (data silently overwritten)",
        summary="FileSystemWriter(overwrite=False) writes over an existing checkpoint instead "
        "of raising RuntimeError",
        patches=(
            Patch(
                f"{_FILESYSTEM}:_FileSystemWriter.prepare_local_plan",
                rewritten(_OVERWRITE_NOT_REFUSED),
            ),
        ),
        origin=blind(
            CHECKPOINTS,
            "https://github.com/pytorch/pytorch/pull/125877",
            "https://github.com/pytorch/pytorch/pull/192183",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/192982 and
    # https://github.com/pytorch/pytorch/pull/193022 (sort each file's reads by storage
    # offset). The patch sorts the byte ranges but not the requests they belong to.
    Fault(
        id="dcp.reader_byte_ranges_misaligned",
        area="state_dict",
        bug_class="reads paired with the wrong byte range",
        summary="FileSystemReader reads the items of one file in storage-offset order but "
        "hands them to the requests in plan order: when a file holds several items saved in "
        "another order than the load asks for them (single_file_per_rank), values land in the "
        "wrong entries, or a size mismatch is raised",
        patches=(
            Patch(
                f"{_FILESYSTEM}:FileSystemReader.read_data",
                rewritten(*_READS_SORTED_REQUESTS_NOT),
            ),
        ),
        origin=blind(
            CHECKPOINTS,
            "https://github.com/pytorch/pytorch/pull/192982",
            "https://github.com/pytorch/pytorch/pull/193022",
            survived_before=False,
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/144657, fixed by
    # https://github.com/pytorch/pytorch/pull/145408: async_save's staging used the CPU
    # offload helper, a no-op for CPU tensors, so training after the call leaked into the
    # checkpoint. Re-created in the storage writer's (BlockingAsyncStager) staging.
    Fault(
        id="dcp.async_stage_cpu_by_reference",
        area="state_dict",
        bug_class="a snapshot that aliases live data",
        summary="dcp.async_save with a FileSystemWriter as stager (cache_staged_state_dict="
        "False) stages CPU tensors by reference: in-place updates made after async_save "
        "returns and before the background write are saved",
        patches=(Patch(f"{_STAGING}:BlockingAsyncStager.stage", _cpu_tensors_staged_by_reference),),
        origin=blind(
            CHECKPOINTS,
            "https://github.com/pytorch/pytorch/issues/144657",
            "https://github.com/pytorch/pytorch/pull/145408",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/159374 ("[DCP] Improve error handling for process
    # based async checkpointing": a failed save is logged and its error returned, the serving
    # loop going on). The patch does so in the thread executor: the future resolves to None.
    Fault(
        id="dcp.async_save_errors_swallowed",
        area="state_dict",
        bug_class="an error swallowed in the background",
        summary="dcp.async_save (thread executor) logs an exception raised by the background "
        "save and resolves its future with None: a failed checkpoint (an existing directory "
        "with overwrite=False, a failing writer) looks successful",
        patches=(Patch(f"{_THREAD_EXECUTOR}:save_wrapper", _save_errors_logged),),
        origin=blind(
            CHECKPOINTS, "https://github.com/pytorch/pytorch/pull/159374", survived_before=True
        ),
    ),
)
