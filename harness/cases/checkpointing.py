"""How a model's layers are activation-checkpointed: which API wraps them, reentrant or not,
and what the recomputation saves (selective checkpointing)."""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import check_one_of, require

CHECKPOINT_APIS = ("wrapper", "apply", "function", "composable")
"""``wrapper``: ``checkpoint_wrapper`` around each chosen layer; ``apply``:
``apply_activation_checkpointing`` over the model (an ``auto_wrap_policy`` where every layer
is chosen, else a ``check_fn``); ``function``: a module of distconf's whose forward calls
``torch.utils.checkpoint.checkpoint`` on the layer; ``composable``: the composable
``torch.distributed._composable.checkpoint`` applied to the layer in place."""
SAVE_POLICIES = ("save_matmuls", "recompute_all", "save_all")
"""Selective checkpointing's policies, by name (``torchkit.checkpointing``): save the
outputs of the matrix products and recompute the rest, recompute everything, save
everything. A case holds no callable, so it pickles to rank processes."""
LISTABLE_POLICIES = ("save_matmuls", "recompute_all")
"""The save policies a list of ops can state (those listed saved, the rest recomputed)."""
REENTRANT_APIS = ("wrapper", "apply", "function")
"""The APIs that take the reentrant implementation (the composable one has none)."""


@dataclass(frozen=True, kw_only=True)
class Checkpointing:
    """Activation checkpointing of the layers at ``layers`` (positions among the layers
    with parameters) through ``api``.

    ``reentrant``: the reentrant implementation, never on the first layer: torch documents
    that a reentrant checkpoint whose inputs do not require grad leaves its parameters
    without gradients, and the model's input does not. ``save``: selective checkpointing
    (``context_fn`` of ``create_selective_checkpoint_contexts``), the non-reentrant
    implementation only, as torch requires; ``policy_as_list``: its policy is the list of
    ops to save rather than a function; ``allow_cache_entry_mutation`` is handed to it.
    ``preserve_rng_state=False`` only where nothing random runs in the layers (dropout's
    masks would differ on recomputation, as documented).
    ``determinism_check`` and ``early_stop`` are options of the non-reentrant
    implementation, left at their defaults when reentrant. ``debug`` is left off: torch's
    debug mode logs every op through a process-wide logger that rank threads share (a
    rank's records reach another's handler: TypeError in logging), torch 2.13 refuses it
    beside any ``context_fn``, and the composable ``checkpoint`` always passes one."""

    api: str = "wrapper"
    layers: tuple[int, ...] = (0,)
    reentrant: bool = False
    save: str | None = None
    policy_as_list: bool = False
    allow_cache_entry_mutation: bool = False
    preserve_rng_state: bool = True
    determinism_check: str = "default"
    early_stop: bool = True

    def __post_init__(self) -> None:
        check_one_of("api", self.api, CHECKPOINT_APIS)
        require(bool(self.layers), "layers", self.layers, "at least one layer position")
        require(
            list(self.layers) == sorted(set(self.layers)) and self.layers[0] >= 0,
            "layers",
            self.layers,
            "distinct layer positions in increasing order",
        )
        if self.reentrant:
            require(self.api in REENTRANT_APIS, "api", self.api, f"one of {REENTRANT_APIS}")
            require(0 not in self.layers, "layers", self.layers, "no layer 0 when reentrant")
            require(self.save is None, "save", self.save, "None when reentrant")
            require(self.early_stop, "early_stop", self.early_stop, "True when reentrant")
            check_one_of("determinism_check", self.determinism_check, ("default",))
        if self.save is not None:
            check_one_of("save", self.save, SAVE_POLICIES)
        require(
            self.save in LISTABLE_POLICIES or not self.policy_as_list,
            "policy_as_list",
            self.policy_as_list,
            f"False unless save is one of {LISTABLE_POLICIES} (a list names what to save)",
        )
        check_one_of("determinism_check", self.determinism_check, ("default", "none"))
        require(
            self.save is not None or not self.allow_cache_entry_mutation,
            "allow_cache_entry_mutation",
            self.allow_cache_entry_mutation,
            "False without a save policy",
        )

    def describe(self) -> str:
        options = [f"layers {list(self.layers)}", "reentrant" if self.reentrant else ""]
        if self.save is not None:
            options.append(f"selective {self.save}{' (list)' if self.policy_as_list else ''}")
        if not self.preserve_rng_state:
            options.append("preserve_rng_state=False")
        if self.determinism_check != "default" or not self.early_stop:
            options.append(
                f"determinism_check={self.determinism_check!r}, early_stop={self.early_stop}"
            )
        return f"checkpoint via {self.api}: {', '.join(o for o in options if o)}"
