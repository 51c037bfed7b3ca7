"""Blind faults in state dicts and checkpointing: DCP's load planning and byte items, the
distributed state-dict API's FQNs, param groups and full state dicts, FSDP2's state-dict
hooks.

Written blind, as a held-out set: by a contributor who read upstream's bug reports and
torch's source but not distconf's suites, strategies or specs, each fault standing for a
real upstream bug or bug class (the comment above it). Run against the suites as they then
were, 4 of 9 survived; each survivor pointed at a weak property, strengthened in
general rather than aimed at the fault:
- later_param_group_hparams_not_loaded: a fresh optimizer differed from the saved one in its
  first group only; now in every group's lr and weight decay.
- init_optim_state_lrs_reversed: hidden by the known deviation of
  state_dict.optim.get_has_no_side_effect (state_dict.optim.get_keeps_hyperparameters).
- dcp_load_missing_keys_silently_skipped: no checkpoint ever lacked a key
  (state_dict.dcp.missing_key_refused).
- ddp_prefix_kept_in_fqns: the state-dict properties drew fully_shard layouts only
  (state_dict.ddp.canonical_fqns).

Each patch was written for torch 2.13: a target that is gone raises FaultError when applied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._patch import Fault, Patch, forcing_argument

_STATE_DICT = "torch.distributed.checkpoint.state_dict"
_DEFAULT_PLANNER = "torch.distributed.checkpoint.default_planner"
_PLANNER_HELPERS = "torch.distributed.checkpoint.planner_helpers"
_FSDP_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"


# --- DCP: non-tensor values read back into the flattened copy only -------------------------


def _bytes_into_flat_copy(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_bytes(self: Any, read_item: Any, value: Any) -> None:
        if not self.flatten_state_dict:
            original(self, read_item, value)
            return None
        import torch

        # The flattened dict is a planner-private copy: the caller's (nested) state dict,
        # where lr / param_groups / python scalars live, never sees the loaded value.
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=False)
        return None

    return load_bytes


# --- DSD: hyperparameters of param groups after the first are not loaded ------------------


def _later_groups_keep_live_hparams(original: Callable[..., Any]) -> Callable[..., Any]:
    def _split_optim_state_dict(model: Any, optim: Any, optim_state_dict: Any, info: Any) -> Any:
        ret = original(model, optim, optim_state_dict, info)
        if ret is optim_state_dict:  # already keyed by param ids: not split
            return ret
        for group, live in list(zip(ret["param_groups"], optim.param_groups, strict=True))[1:]:
            for key, value in live.items():
                if key != "params":
                    group[key] = value
        return ret

    return _split_optim_state_dict


# --- DSD: _init_optim_state restores the lrs in the wrong group order ---------------------


def _lrs_restored_reversed(original: Callable[..., Any]) -> Callable[..., Any]:
    def _init_optim_state(optim: Any) -> None:
        import torch

        if optim.state:
            return
        for group in optim.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    return
        for group in optim.param_groups:
            for param in group["params"]:
                if param.requires_grad:
                    param.grad = torch.zeros_like(param)
        lrs = []
        for group in optim.param_groups:
            if "lr" in group:
                lrs.append(group["lr"])
                group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        optim.step(closure=None)
        for group in optim.param_groups:
            if "lr" in group:
                group["lr"] = lrs.pop()  # upstream: lrs.pop(0)
        optim.zero_grad(set_to_none=True)

    return _init_optim_state


# --- DCP resharding: destination offset dropped when a saved chunk starts inside ours -----


def _dest_offset_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    def _shards_get_overlap_region_wrt_saved_tensor(saved_shard: Any, current_shard: Any) -> Any:
        return [
            (dim, saved_offset, 0, length)
            for dim, saved_offset, _current_offset, length in original(saved_shard, current_shard)
        ]

    return _shards_get_overlap_region_wrt_saved_tensor


# --- DSD full_state_dict load: 0-dim tensors skipped when distributing ---------------------


def _scalars_not_distributed(original: Callable[..., Any]) -> Callable[..., Any]:
    def _distribute_state_dict(
        full_state_dict: dict[str, Any],
        local_state_dict: dict[str, Any],
        device: Any,
        pg: Any = None,
    ) -> None:
        import torch

        kept = {
            key: value
            for key, value in full_state_dict.items()
            if not (torch.is_tensor(value) and value.dim() == 0)
        }
        original(kept, local_state_dict, device, pg)

    return _distribute_state_dict


# --- DSD full_state_dict: DTensors gathered over the first mesh dimension only -------------


def _first_mesh_dim_only(original: Callable[..., Any]) -> Callable[..., Any]:
    def _gather_state_dict(state_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor, Replicate
        from torch.utils._pytree import tree_map_only

        def gather_dim0(value: DTensor) -> Any:
            placements = [Replicate(), *value.placements[1:]]
            local = value.redistribute(value.device_mesh, placements).to_local()
            wait = getattr(local, "wait", None)
            return wait() if callable(wait) else local

        gathered: dict[str, Any] = original(
            tree_map_only(DTensor, gather_dim0, state_dict), **kwargs
        )
        return gathered

    return _gather_state_dict


# --- FSDP2: no reshard before state_dict() ------------------------------------------------


def _no_pre_save_reshard(original: Callable[..., Any]) -> Callable[..., Any]:
    def _register_state_dict_hooks(self: Any) -> None:
        if self._module_to_pre_load_state_dict_hook_handle:
            return  # already registered
        modules = {fsdp_param._module_info.module for fsdp_param in self.fsdp_params}

        def to_sharded_hook(*args: Any, **kwargs: Any) -> None:
            self._to_sharded()

        def noop_hook(*args: Any, **kwargs: Any) -> None:
            return None

        for module in modules:
            self._module_to_pre_save_state_dict_hook_handle[module] = (
                module.register_state_dict_pre_hook(noop_hook)
            )
            self._module_to_pre_load_state_dict_hook_handle[module] = (
                module._register_load_state_dict_pre_hook(to_sharded_hook)
            )

    return _register_state_dict_hooks


FAULTS = (
    # https://github.com/pytorch/pytorch/issues/129079 (fixed by PR #129398): after a 2.3
    # regression, dcp.load restored tensors in place but non-tensor values such as the
    # optimizer's learning rate were no longer written back into the caller's state dict.
    Fault(
        id="state_dict.dcp_non_tensor_values_not_loaded",
        area="state_dict",
        bug_class="loaded values written into a private copy instead of the caller's object",
        summary="dcp.load (DefaultLoadPlanner with flatten_state_dict) puts every non-tensor "
        "value it reads (param_groups lr/betas, python ints/floats, strings) into the "
        "planner's flattened copy only; the caller's state dict keeps its old values",
        patches=(
            Patch(f"{_DEFAULT_PLANNER}:DefaultLoadPlanner.load_bytes", _bytes_into_flat_copy),
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/143828: after set_optimizer_state_dict only
    # the first param group received the checkpoint's hyperparameters (lr, betas, ...); the
    # other groups lost them.
    Fault(
        id="state_dict.later_param_group_hparams_not_loaded",
        area="state_dict",
        bug_class="per-group hyperparameters restored for the first param group only",
        summary="set_optimizer_state_dict / set_state_dict (FQN-keyed optimizer state dict) "
        "load the state and the first param group's hyperparameters, but every later param "
        "group keeps the live optimizer's lr/weight_decay/... instead of the checkpoint's",
        patches=(Patch(f"{_STATE_DICT}:_split_optim_state_dict", _later_groups_keep_live_hparams),),
    ),
    # Bug class, no single issue (the code is the lr save/restore of _init_optim_state that
    # https://github.com/pytorch/pytorch/issues/139575 touched): the dummy zero-lr step saves
    # each group's lr and restores them afterwards; restoring in LIFO order hands every
    # group another group's lr.
    Fault(
        id="state_dict.init_optim_state_lrs_reversed",
        area="state_dict",
        bug_class="saved values restored in the wrong order (a hyperparameter on the wrong "
        "param group)",
        summary="the first get_optimizer_state_dict / get_state_dict on an optimizer with no "
        "state restores the param groups' lrs in reverse group order after the zero-lr "
        "initialisation step: with two or more groups of different lr, the live optimizer "
        "and the returned state dict have the groups' lrs permuted",
        patches=(Patch(f"{_STATE_DICT}:_init_optim_state", _lrs_restored_reversed),),
    ),
    # https://github.com/pytorch/xla/pull/7155 (same DCP read-item contract; cf. the
    # resharding failures in https://github.com/pytorch/torchtitan/issues/811): ReadItem
    # destination offsets were computed wrongly, so checkpoints loaded at another topology
    # landed at the wrong place in the local shard.
    Fault(
        id="state_dict.dcp_reshard_dest_offset_dropped",
        area="state_dict",
        bug_class="resharding overlap computed with a wrong destination offset",
        summary="dcp.load's overlap computation reports destination offset 0 even when the "
        "saved chunk starts inside the local chunk: loading into bigger local chunks than were "
        "saved (fewer ranks, or a full tensor) stacks every saved chunk at the start of the "
        "local tensor and leaves the rest unloaded",
        patches=(
            Patch(
                f"{_PLANNER_HELPERS}:_shards_get_overlap_region_wrt_saved_tensor",
                _dest_offset_dropped,
            ),
        ),
    ),
    # Bug class; the 0-dim special case it breaks was reworked in
    # https://github.com/pytorch/pytorch/pull/128004: scalar tensors take their own branch in
    # _distribute_state_dict and, when that branch misses, the local value silently wins.
    Fault(
        id="state_dict.full_sd_scalars_not_loaded",
        area="state_dict",
        bug_class="scalar (0-dim) tensors skipped by a special-cased path (step counter not "
        "restored)",
        summary="set_model_state_dict / set_optimizer_state_dict with full_state_dict=True "
        "(no broadcast) skip 0-dim tensors when distributing the full state dict: the "
        "optimizer 'step' and scalar buffers (e.g. num_batches_tracked) keep their current "
        "local values instead of the checkpoint's",
        patches=(Patch(f"{_STATE_DICT}:_distribute_state_dict", _scalars_not_distributed),),
    ),
    # https://github.com/pytorch/pytorch/issues/120722 and
    # https://github.com/pytorch/pytorch/issues/121062: FSDP1's FULL_STATE_DICT for 2D
    # (FSDP + TP) was only full along the data-parallel mesh dimension.
    Fault(
        id="state_dict.full_sd_gathers_first_mesh_dim_only",
        area="state_dict",
        bug_class="full state dict gathered over one mesh dimension only",
        summary="get_model_state_dict / get_optimizer_state_dict / get_state_dict with "
        "full_state_dict=True all-gather DTensors along mesh dim 0 only: on 2D meshes (HSDP "
        "[Replicate, Shard], FSDP+TP) the 'full' tensors are still the local shards of the "
        "other mesh dims; 1D meshes are unaffected",
        patches=(Patch(f"{_STATE_DICT}:_gather_state_dict", _first_mesh_dim_only),),
    ),
    # https://github.com/pytorch/pytorch/issues/144289 (and #131965): after forward an FSDP2
    # module may keep its unsharded parameters registered; only the pre-state_dict hook
    # switches back to the sharded DTensors before state_dict() reads them.
    Fault(
        id="state_dict.fsdp2_state_dict_while_unsharded",
        area="state_dict",
        bug_class="state dict taken without first resharding (reshard_after_forward=False / "
        "root kept unsharded)",
        summary="FSDP2 registers no pre-state_dict reshard hook: state_dict() / "
        "get_model_state_dict of a module still unsharded after forward (reshard_after_forward="
        "False, or the root by default) returns the unsharded plain tensors instead of sharded "
        "DTensors",
        patches=(
            Patch(
                f"{_FSDP_PARAM_GROUP}:FSDPParamGroup._register_state_dict_hooks",
                _no_pre_save_reshard,
            ),
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/148252 (strict behaviour of DCP loading;
    # PR #123869 added allow_partial_load): a key of the state dict that the checkpoint does
    # not hold must raise unless partial loading was asked for.
    Fault(
        id="state_dict.dcp_load_missing_keys_silently_skipped",
        area="state_dict",
        bug_class="strict loading silently downgraded (keys silently dropped)",
        summary="dcp.load with the default planner (allow_partial_load=False) silently skips "
        "state-dict keys missing from the checkpoint instead of raising; those entries keep "
        "their pre-load values",
        patches=(
            Patch(
                f"{_DEFAULT_PLANNER}:create_default_local_load_plan",
                forcing_argument("strict", False),
            ),
        ),
    ),
    # Bug class (DSD's canonical-FQN contract; the DDP 'module.' prefix problem of
    # https://github.com/pytorch/pytorch/issues/41048): _get_fqns must strip wrapper
    # prefixes so that state dicts of wrapped and unwrapped models share keys.
    Fault(
        id="state_dict.ddp_prefix_kept_in_fqns",
        area="state_dict",
        bug_class="FQN mapping keeps a wrapper prefix (non-canonical keys)",
        summary="_get_fqns keeps DDP's 'module.' prefix: get_model_state_dict / "
        "get_optimizer_state_dict of a DDP-wrapped model key everything as 'module.<fqn>', "
        "and set_*_state_dict expect those keys (a canonical state dict no longer loads)",
        patches=(Patch(f"{_STATE_DICT}:_get_fqns", forcing_argument("skip_ddp_prefix", False)),),
    ),
)
