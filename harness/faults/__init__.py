"""Injectable faults: small, reversible patches of torch's distributed stack, each standing for
a class of bug that ships in distributed training code. ``python -m harness mutate`` runs the
suites once clean and once per fault, and scores how many faults the properties catch.

The faults live in one module per area of the spec catalogue they break, split by sub-area
where one module would be too long: ``placements_rules`` (placement transforms, redistribute
plans, op and view sharding rules), ``placements_api`` (from_local / to_local, their
gradients, result metadata, factories), ``placements_meshes``, ``uneven``,
``optim_data_parallel`` (FSDP2, HSDP and DDP around forward and backward),
``optim_kernels`` (optimizer kernels, clip_grad_norm_), ``optim_training_surface``
(activation checkpointing, DDP hooks, clipping, lr schedulers, more optimizers), ``zero``,
``fsdp_init``,
``state_dict_dcp`` (distributed checkpoints), ``state_dict_checkpoints`` (DCP's planner,
storage and async_save options), ``state_dict_api`` (the distributed state-dict API),
``state_dict_options`` (its StateDictOptions), ``hsdp``, ``tp``, ``ops_rules`` (the sharding
rules of DTensor's ops: reductions, norms, losses, pointwise, foreach, random and matmul ops),
``ops_rules_views`` (views and indexing ops) and ``compile_paths`` (the compiled paths of
DTensor programs and collectives); ``_wraps`` holds the wraps faults of several
areas share.
How each fault was written is data on it (``Fault.origin``): with the property, or blind in a
held-out set from upstream reports (``held_out`` records what each set found). Each patch was
written for torch 2.13: a target that is gone raises ``FaultError`` when applied.

A fault is active for a whole pytest session: ``--distconf-faults=ID,...`` applies it in the
driver (and so in thread-runner ranks) and, through ``$DISTCONF_FAULTS``, in every rank
process of the process runner before its first call. Nothing here imports torch until a
fault is applied.

Faults of one's own (a vendor's known bugs, a held-out set) live in a Python file defining
``FAULTS = (Fault(...), ...)``: ``--distconf-fault-files=PATH,...`` (or
``$DISTCONF_FAULT_FILES``) adds them to the catalogue for that session and its rank processes.
Such a fault needs no ``origin``: without one, it is counted as "origin not stated".
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

from harness.errors import FaultError
from harness.faults import (
    compile_paths,
    fsdp_init,
    hsdp,
    ops_rules,
    ops_rules_views,
    optim_data_parallel,
    optim_kernels,
    optim_training_options,
    optim_training_surface,
    placements_api,
    placements_meshes,
    placements_rules,
    state_dict_api,
    state_dict_checkpoints,
    state_dict_dcp,
    state_dict_options,
    tp,
    tp_options,
    uneven,
    zero,
)
from harness.faults._origin import WITH_THE_PROPERTY, WRITTEN, Origin, blind
from harness.faults._patch import Fault, Patch, Undo

ENV_VAR = "DISTCONF_FAULTS"
FILES_ENV_VAR = "DISTCONF_FAULT_FILES"

# The areas in the catalogue's order (specs/catalogue.toml).
_ALL = (
    *placements_rules.FAULTS,
    *placements_api.FAULTS,
    *placements_meshes.FAULTS,
    *uneven.FAULTS,
    *optim_data_parallel.FAULTS,
    *optim_kernels.FAULTS,
    *optim_training_surface.FAULTS,
    *optim_training_options.FAULTS,
    *zero.FAULTS,
    *fsdp_init.FAULTS,
    *state_dict_dcp.FAULTS,
    *state_dict_api.FAULTS,
    *state_dict_checkpoints.FAULTS,
    *state_dict_options.FAULTS,
    *hsdp.FAULTS,
    *tp.FAULTS,
    *tp_options.FAULTS,
    *ops_rules.FAULTS,
    *ops_rules_views.FAULTS,
    *compile_paths.FAULTS,
)
FAULTS: dict[str, Fault] = {fault.id: fault for fault in _ALL}
BUILTIN = frozenset(FAULTS)
_loaded_files: dict[Path, tuple[str, ...]] = {}


def load_files(paths: Sequence[str | Path]) -> list[Fault]:
    """Add the faults each file's ``FAULTS`` tuple defines to the catalogue; return them.

    Loading a file again is a no-op; an ID that is already taken is a ``FaultError``."""
    added: list[Fault] = []
    for path in (Path(p).resolve() for p in paths):
        if path in _loaded_files:
            added += [FAULTS[i] for i in _loaded_files[path]]
            continue
        found = _faults_of_file(path)
        taken = sorted(f.id for f in found if f.id in FAULTS)
        if taken:
            raise FaultError(
                f"fault file {str(path)!r}: ids={taken!r} are already in the catalogue"
            )
        FAULTS.update((f.id, f) for f in found)
        _loaded_files[path] = tuple(f.id for f in found)
        added += found
    return added


def _faults_of_file(path: Path) -> list[Fault]:
    if not path.is_file():
        raise FaultError(f"fault file {str(path)!r} does not exist")
    name = "distconf_fault_file_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except KeyboardInterrupt:
        raise  # Ctrl-C while it imports: the command is interrupted, the file not judged
    # A file ending the process on import (sys.exit(0)) would end mutate as if it passed.
    except BaseException as exc:
        raise FaultError(f"fault file {str(path)!r} failed to import: {exc!r}") from exc
    found = getattr(module, "FAULTS", None)
    if not isinstance(found, tuple | list) or not all(isinstance(f, Fault) for f in found):
        raise FaultError(
            f"fault file {str(path)!r} must define FAULTS as a tuple of harness.faults.Fault; "
            f"got {type(found).__name__}"
        )
    ids = [f.id for f in found]
    if len(set(ids)) != len(ids):
        raise FaultError(f"fault file {str(path)!r}: ids={ids!r} repeat an id")
    return list(found)


def select(ids: Sequence[str]) -> list[Fault]:
    """The faults named by ``ids``, in that order; an unknown ID is a ``FaultError``."""
    unknown = [i for i in ids if i not in FAULTS]
    if unknown:
        raise FaultError(
            f"faults={unknown!r} are not in the fault catalogue; known: {sorted(FAULTS)}"
        )
    return [FAULTS[i] for i in dict.fromkeys(ids)]


def parse(text: str | None) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``; empty or ``None`` -> ``[]``."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def activate(ids: Sequence[str], files: Sequence[str] = ()) -> Undo:
    """Apply the faults (from the catalogue and ``files``) in this process and export them to
    rank processes started later."""
    load_files(files)
    undos: list[Undo] = []
    try:
        for fault in select(ids):
            undos.append(fault.apply())
    except BaseException:
        for undo in reversed(undos):
            undo()
        raise
    previous = {name: os.environ.get(name) for name in (ENV_VAR, FILES_ENV_VAR)}
    os.environ[ENV_VAR] = ",".join(ids)
    os.environ[FILES_ENV_VAR] = ",".join(str(Path(f).resolve()) for f in files)

    def undo_all() -> None:
        for undo in reversed(undos):
            undo()
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    return undo_all


def exported() -> list[str]:
    """The faults this process exports to rank processes (what ``activate`` set)."""
    return parse(os.environ.get(ENV_VAR))


def exported_files() -> list[str]:
    """The fault files this process exports to rank processes (what ``activate`` set)."""
    return parse(os.environ.get(FILES_ENV_VAR))


def apply_in_rank(ids: Sequence[str], files: Sequence[str] = ()) -> None:
    """In a rank process: apply the driver's faults for the process's lifetime."""
    load_files(files)
    for fault in select(ids):
        fault.apply()


__all__ = [
    "BUILTIN",
    "ENV_VAR",
    "FAULTS",
    "FILES_ENV_VAR",
    "WITH_THE_PROPERTY",
    "WRITTEN",
    "Fault",
    "FaultError",
    "Origin",
    "Patch",
    "activate",
    "apply_in_rank",
    "blind",
    "exported",
    "exported_files",
    "load_files",
    "parse",
    "select",
]
