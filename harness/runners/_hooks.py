"""The process-wide exception hooks torch replaces, and putting them back.

``dist.init_process_group`` wraps ``sys.excepthook`` on every call (to prefix each line with
``[rankN]: ``). A runner that makes groups inside the driver's process (a thread World's
ranks, a local World's fake group) calls it once per group it makes: after a few hundred the
driver's own traceback would recurse through a thousand wrappers, and every line of it would
carry a rank prefix. Such a runner takes the hooks as found before it makes a group and puts
them back after.
"""

from __future__ import annotations

import sys
import threading

_PROCESS_HOOKS = ((sys, "excepthook"), (threading, "excepthook"), (sys, "unraisablehook"))

hooks_lock = threading.Lock()
"""Held while groups are made, so that no other World takes the hooks they wrap for the ones
it found."""


class ProcessHooks:
    """The process-wide hooks as found, and putting back those torch replaced since."""

    def __init__(self) -> None:
        self.found = [getattr(owner, name) for owner, name in _PROCESS_HOOKS]

    def restore(self) -> None:
        for (owner, name), found in zip(_PROCESS_HOOKS, self.found, strict=True):
            current = getattr(owner, name)
            # A hook someone other than torch set meanwhile is theirs to keep.
            if current is not found and _set_by_torch(current):
                setattr(owner, name, found)


def _set_by_torch(hook: object) -> bool:
    module = getattr(hook, "__module__", None) or ""
    return module == "torch" or module.startswith("torch.")
