"""Faults in the distributed state-dict API (torch.distributed.checkpoint.state_dict) and what
FSDP2 hands it: FQNs, the optimizer state and its initialisation, param groups, full state
dicts, tied parameters, FSDP2's state-dict hooks and lazy re-padding."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._origin import WITH_THE_PROPERTY, blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import forcing_argument, rewritten
from harness.faults.held_out import FIRST, TRAINING_KNOBS

_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param"
_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
_STATE_DICT = "torch.distributed.checkpoint.state_dict"


def _last_entry_dropped(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_optim_state_dict(*args: Any, **kwargs: Any) -> Any:
        optim_state_dict = original(*args, **kwargs)
        state = optim_state_dict.get("state")
        if state:
            state.pop(next(reversed(state)))
        return optim_state_dict

    return get_optim_state_dict


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


# FSDPParam.reset_sharded_param without its idempotency check: lazy init re-pads an unevenly
# sharded parameter into a new tensor although it is already padded.
_REPAD_ALWAYS_EDIT = (
    "    if local_tensor.size() != padded_sharded_size and not same_local_tensor:\n",
    "    same_local_tensor = False\n"
    "    if local_tensor.size() != padded_sharded_size and not same_local_tensor:\n",
)


def _optimizer_state_untouched(optim: Any) -> bool:
    """``_init_optim_state``'s precondition: no optimizer state and no gradients yet."""
    if optim.state:
        return False
    return all(p.grad is None for group in optim.param_groups for p in group["params"])


def _tensor_lr_zeroed_in_place(original: Callable[..., Any]) -> Callable[..., Any]:
    def _init_optim_state(optim: Any) -> None:
        import torch

        if _optimizer_state_untouched(optim):
            for group in optim.param_groups:
                lr = group.get("lr")
                if isinstance(lr, torch.Tensor):
                    # Zeroed in place for the dummy step, so the saved reference that is
                    # "restored" afterwards is the zeroed tensor itself.
                    lr.zero_()
        original(optim)

    return _init_optim_state


def _grads_wiped_mid_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def _init_optim_state(optim: Any) -> None:
        if not optim.state:
            # The "gradients already exist, leave them alone" early return is gone: the dummy
            # zero-gradient step runs between backward and step and clears the real gradients.
            for group in optim.param_groups:
                for param in group["params"]:
                    param.grad = None
        original(optim)

    return _init_optim_state


def _every_alias_loaded(original: Callable[..., Any]) -> Callable[..., Any]:
    def _split_optim_state_dict(model: Any, optim: Any, optim_state_dict: Any, info: Any) -> Any:
        shared = info.shared_params_mapping
        info.shared_params_mapping = {}  # every FQN of a shared parameter counts as its own
        try:
            return original(model, optim, optim_state_dict, info)
        finally:
            info.shared_params_mapping = shared

    return _split_optim_state_dict


FAULTS: tuple[Fault, ...] = (
    Fault(
        id="state_dict.optim_state_entry_dropped",
        area="state_dict",
        bug_class="one optimizer-state entry skipped in a state dict",
        summary="get_state_dict / get_optimizer_state_dict leave out the last parameter's "
        "optimizer state",
        patches=(Patch(f"{_STATE_DICT}:_get_optim_state_dict", _last_entry_dropped),),
        origin=WITH_THE_PROPERTY,
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
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/issues/143828", survived_before=True
        ),
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
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/issues/139575", survived_before=True
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
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/pull/128004", survived_before=False
        ),
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
        origin=blind(
            FIRST,
            "https://github.com/pytorch/pytorch/issues/120722",
            "https://github.com/pytorch/pytorch/issues/121062",
            survived_before=False,
        ),
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
                f"{_PARAM_GROUP}:FSDPParamGroup._register_state_dict_hooks",
                _no_pre_save_reshard,
            ),
        ),
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/issues/144289", survived_before=False
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
        origin=blind(
            FIRST, "https://github.com/pytorch/pytorch/issues/41048", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/163130 and
    # https://github.com/pytorch/torchtitan/issues/1136 (a state dict taken before the first
    # forward went stale: lazy init re-padded the local tensors).
    Fault(
        id="fsdp.lazy_init_repads_cached_params",
        area="state_dict",
        bug_class="stale reference: an idempotent re-initialisation that reallocates",
        summary="FSDP2's lazy init re-pads every unevenly sharded parameter into a new local "
        "tensor even when it is already padded, so a state_dict() (or any reference to the "
        "local shards) taken before the first forward stops tracking training",
        patches=(Patch(f"{_PARAM}:FSDPParam.reset_sharded_param", rewritten(_REPAD_ALWAYS_EDIT)),),
        origin=blind(
            TRAINING_KNOBS,
            "https://github.com/pytorch/pytorch/pull/163130",
            "https://github.com/pytorch/torchtitan/issues/1136",
            survived_before=False,
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/139575 ("_init_optim_state() should respect
    # tensor-ness of lr").
    Fault(
        id="state_dict.init_optim_state_zeroes_tensor_lr",
        area="state_dict",
        bug_class="aliasing: a value saved by reference and mutated in place",
        summary="the first get_optimizer_state_dict / get_state_dict / set_*_state_dict on an "
        "optimizer with a tensor lr and no state zeroes the lr tensor in place for the dummy "
        "step and restores that same tensor, so training continues with lr 0",
        patches=(Patch(f"{_STATE_DICT}:_init_optim_state", _tensor_lr_zeroed_in_place),),
        origin=blind(
            TRAINING_KNOBS, "https://github.com/pytorch/pytorch/issues/139575", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/164929 ("get_optimizer_state_dict modifies
    # optimizer state": the dummy initialisation step's side effects on a live optimizer).
    Fault(
        id="state_dict.init_optim_state_wipes_grads",
        area="state_dict",
        bug_class="a state-dict read with side effects: gradients cleared mid-step",
        summary="get_optimizer_state_dict / get_state_dict called between backward and step on "
        "an optimizer without state (first step, or a stateless SGD) runs its zero-gradient "
        "initialisation step anyway and clears the real gradients, so the step does nothing",
        patches=(Patch(f"{_STATE_DICT}:_init_optim_state", _grads_wiped_mid_step),),
        origin=blind(
            TRAINING_KNOBS, "https://github.com/pytorch/pytorch/issues/164929", survived_before=True
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/128011, fixed by
    # https://github.com/pytorch/pytorch/pull/128685 (set_optimizer_state_dict assumed every FQN
    # of a shared parameter is in the optimizer state dict).
    Fault(
        id="state_dict.shared_param_loaded_per_alias",
        area="state_dict",
        bug_class="tied parameters: one parameter counted once per name",
        summary="set_optimizer_state_dict / set_state_dict treat each FQN of a tied parameter "
        "as a parameter of its own when splitting the state dict, so loading the optimizer of "
        "a model with tied weights fails (missing state, or a param group one entry too long)",
        patches=(Patch(f"{_STATE_DICT}:_split_optim_state_dict", _every_alias_loaded),),
        origin=blind(
            TRAINING_KNOBS,
            "https://github.com/pytorch/pytorch/issues/128011",
            "https://github.com/pytorch/pytorch/pull/128685",
            survived_before=True,
        ),
    ),
)
