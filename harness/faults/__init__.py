"""Injectable faults: small, reversible patches of torch's distributed stack, each standing for
a class of bug that ships in distributed training code. ``python -m harness mutate`` runs the
suites once clean and once per fault, and scores how many faults the properties catch.

A fault is active for a whole pytest session: ``--distconf-faults=ID,...`` applies it in the
driver (and so in thread-runner ranks) and, through ``$DISTCONF_FAULTS``, in every rank
process of the process runner before its first call. Nothing here imports torch until a
fault is applied.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from harness.faults import dtensor, modules, parallel, state_dict, training
from harness.faults._patch import Fault, FaultError, Patch, Undo

ENV_VAR = "DISTCONF_FAULTS"

_ALL = (
    *dtensor.FAULTS,
    *modules.FAULTS,
    *training.FAULTS,
    *state_dict.FAULTS,
    *parallel.FAULTS,
)
FAULTS: dict[str, Fault] = {fault.id: fault for fault in _ALL}


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


def activate(ids: Sequence[str]) -> Undo:
    """Apply the faults in this process and export them to rank processes started later."""
    undos: list[Undo] = []
    try:
        for fault in select(ids):
            undos.append(fault.apply())
    except BaseException:
        for undo in reversed(undos):
            undo()
        raise
    previous = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = ",".join(ids)

    def undo_all() -> None:
        for undo in reversed(undos):
            undo()
        if previous is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = previous

    return undo_all


def exported() -> list[str]:
    """The faults this process exports to rank processes (what ``activate`` set)."""
    return parse(os.environ.get(ENV_VAR))


def apply_in_rank(ids: Sequence[str]) -> None:
    """In a rank process: apply the driver's faults for the process's lifetime."""
    for fault in select(ids):
        fault.apply()


__all__ = [
    "ENV_VAR",
    "FAULTS",
    "Fault",
    "FaultError",
    "Patch",
    "activate",
    "apply_in_rank",
    "exported",
    "parse",
    "select",
]
