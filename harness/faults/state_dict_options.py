"""Faults in the options of the distributed state-dict API
(``torch.distributed.checkpoint.state_dict.StateDictOptions``), written blind in the
checkpoints set: ignore_frozen_params, flatten_optimizer_state_dict, broadcast_from_rank0 with
strict, submodules, and strict loading of wrapped models. Each bites only on the path its
upstream bug lived on. Nothing here imports torch until a fault is applied."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harness.faults._origin import blind
from harness.faults._patch import Fault, Patch
from harness.faults._wraps import forcing_argument, rewritten
from harness.faults.held_out import CHECKPOINTS

_STATE_DICT = "torch.distributed.checkpoint.state_dict"
_UTILS = "torch.distributed._state_dict_utils"


def _buffers_dropped_with_frozen_params(original: Callable[..., Any]) -> Callable[..., Any]:
    def _get_model_state_dict(model: Any, info: Any) -> Any:
        state_dict = original(model, info)
        if info.ignore_frozen_params:
            from torch.distributed.checkpoint.state_dict import _get_fqns

            # Buffers never require grad: taken for frozen parameters, they are dropped too.
            for name, _ in model.named_buffers():
                for fqn in _get_fqns(model, name):
                    state_dict.pop(fqn, None)
        return state_dict

    return _get_model_state_dict


# Every param group's hyperparameters are read under the first group's first FQN.
_GROUPS_READ_FROM_FIRST = (
    "first_param_fqn = cast(list[str], pg_state[-1][_PARAMS])[0]",
    "first_param_fqn = cast(list[str], pg_state[0][_PARAMS])[0]",
)

# The local shard of a full tensor is sliced from offset 0 on every rank.
_SHARD_SLICED_FROM_ZERO = (
    "slice(cur_offset, cur_offset + cur_shape)",
    "slice(0, cur_shape)",
)

# The submodule filter matches an FQN against the prefix without its trailing dot.
_PREFIX_WITHOUT_SEPARATOR = (
    "if not fqn.startswith(prefix):",
    'if not fqn.startswith(prefix.rstrip(".")):',
)

# A wrapped model (DDP, torch.compile) missing a key raises whatever strict says.
_MISSING_KEY_RAISED_UNLESS_STRICT = ("if info.strict:", "if True:")


FAULTS: tuple[Fault, ...] = (
    # https://github.com/pytorch/pytorch/issues/119535, fixed by
    # https://github.com/pytorch/pytorch/pull/119573 (get_state_dict/set_state_dict mishandled
    # buffers). The patch drops the buffers, which never require grad, with the frozen params.
    Fault(
        id="state_dict.ignore_frozen_params_drops_buffers",
        area="state_dict",
        bug_class="a filter catching more than it names",
        summary="get_model_state_dict / get_state_dict with StateDictOptions("
        "ignore_frozen_params=True) also leave out every buffer (BatchNorm running stats, "
        "registered buffers), since none requires grad; without the option nothing changes",
        patches=(
            Patch(f"{_STATE_DICT}:_get_model_state_dict", _buffers_dropped_with_frozen_params),
        ),
        origin=blind(
            CHECKPOINTS,
            "https://github.com/pytorch/pytorch/issues/119535",
            "https://github.com/pytorch/pytorch/pull/119573",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/127071 (flatten_optimizer_state_dict keys
    # param_groups by FQN) and https://github.com/pytorch/pytorch/pull/148825 (the wrong FQN
    # used for a group's flattened keys). The patch reads every group under the first's FQN.
    Fault(
        id="state_dict.flattened_optim_groups_read_from_first",
        area="state_dict",
        bug_class="per-group values looked up under the wrong key",
        summary="set_optimizer_state_dict with StateDictOptions(flatten_optimizer_state_dict="
        "True) reads every param group's hyperparameters (lr, weight_decay, betas...) under "
        "the first group's first parameter: all groups load the first group's values",
        patches=(
            Patch(f"{_STATE_DICT}:_unflatten_optim_state_dict", rewritten(_GROUPS_READ_FROM_FIRST)),
        ),
        origin=blind(
            CHECKPOINTS,
            "https://github.com/pytorch/pytorch/pull/127071",
            "https://github.com/pytorch/pytorch/pull/148825",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/125338 (broadcast_from_rank0: broadcast the full
    # tensor, then each rank keeps its slice) and https://github.com/pytorch/pytorch/pull/142845
    # (the slice copied into the existing local shard). The patch slices every rank's from 0.
    Fault(
        id="state_dict.broadcast_rank0_shard_everywhere",
        area="state_dict",
        bug_class="every rank loading the first rank's shard",
        summary="set_model_state_dict / set_optimizer_state_dict with StateDictOptions("
        "full_state_dict=True, broadcast_from_rank0=True) slice each rank's local shard of a "
        "sharded DTensor from offset 0 of the broadcast full tensor: every rank loads rank "
        "0's shard",
        patches=(Patch(f"{_UTILS}:_distribute_tensors", rewritten(_SHARD_SLICED_FROM_ZERO)),),
        origin=blind(
            CHECKPOINTS,
            "https://github.com/pytorch/pytorch/pull/125338",
            "https://github.com/pytorch/pytorch/pull/142845",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/126285 ("StateDictOptions(strict=True) gets
    # ignored") and https://github.com/pytorch/pytorch/pull/150239 (strict handling of
    # broadcast_from_rank0). The patch broadcasts as if strict were False.
    Fault(
        id="state_dict.broadcast_from_rank0_strict_ignored",
        area="state_dict",
        bug_class="strict loading silently downgraded",
        summary="set_model_state_dict with StateDictOptions(full_state_dict=True, "
        "broadcast_from_rank0=True, strict=True) keeps the model's own value for a key rank "
        "0's full state dict lacks, instead of raising for the missing key",
        patches=(Patch(f"{_STATE_DICT}:_broadcast_state_dict", forcing_argument("strict", False)),),
        origin=blind(
            CHECKPOINTS,
            "https://github.com/pytorch/pytorch/issues/126285",
            "https://github.com/pytorch/pytorch/pull/150239",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/pull/189761 (the submodule prefix filter: "a prefix
    # like `1.` must not match `10.weight`") and the same bug in
    # https://github.com/meta-pytorch/torchrec/pull/961 (children sharing a name prefix).
    Fault(
        id="state_dict.submodule_prefix_matches_siblings",
        area="state_dict",
        bug_class="a name prefix matched without its separator",
        summary="get_model_state_dict(submodules=...) matches FQNs against each submodule's "
        "name without the trailing dot: a sibling whose name extends it (layers.1 and "
        "layers.10) is taken in too (and, with keep_submodule_prefixes=False, cut wrongly)",
        patches=(
            Patch(f"{_STATE_DICT}:_get_model_state_dict", rewritten(_PREFIX_WITHOUT_SEPARATOR)),
        ),
        origin=blind(
            CHECKPOINTS,
            "https://github.com/pytorch/pytorch/pull/189761",
            "https://github.com/meta-pytorch/torchrec/pull/961",
            survived_before=True,
        ),
    ),
    # https://github.com/pytorch/pytorch/issues/149516 ("StateDictOptions in combination with
    # cpu_offload=True and strict=False not working": a key error despite strict=False). The
    # patch raises for a missing key of a wrapped model whatever strict says.
    Fault(
        id="state_dict.strict_false_still_raises_for_wrapped",
        area="state_dict",
        bug_class="a non-strict load still refusing missing keys",
        summary="set_model_state_dict with StateDictOptions(strict=False) on a model whose "
        "FQNs carry a wrapper prefix (DDP's module., torch.compile's _orig_mod.) raises "
        "'Missing key' for a key the given state dict lacks",
        patches=(
            Patch(
                f"{_STATE_DICT}:_load_model_state_dict",
                rewritten(_MISSING_KEY_RAISED_UNLESS_STRICT),
            ),
        ),
        origin=blind(
            CHECKPOINTS, "https://github.com/pytorch/pytorch/issues/149516", survived_before=True
        ),
    ),
)
