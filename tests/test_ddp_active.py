"""DDP's active module is each rank thread's own while a thread World is open.

Dynamo splits a graph it compiles at the gradient buckets of the DDP module whose forward is
running (``DistributedDataParallel._get_active_ddp_module``); torch keeps that module in one
class attribute for the process, so rank threads interleaving forwards left one behind and
every later compile in the process split its graphs by it.
"""

from __future__ import annotations

import threading
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from harness import open_world

STEPS = ("a in", "b enters", "b in", "a exits", "a out", "b exits", "b out")
"""b enters while a is inside, a leaves first: torch's saved-and-restored attribute ends
holding a's module."""


def _interleaved_forwards() -> dict[str, Any]:
    """Two threads in DDP's forward marking, in the order ``STEPS``; what each saw as the
    active module inside it, and what the driver sees after."""
    turn = threading.Condition()
    order = list(STEPS)
    seen: dict[str, Any] = {}

    def take(step: str) -> None:
        with turn:
            turn.wait_for(lambda: order[0] == step, timeout=10)
            order.pop(0)
            turn.notify_all()

    def forward(name: str) -> None:
        if name == "b":
            take("b enters")
        with DistributedDataParallel._inside_ddp_forward(f"module {name}"):  # type: ignore[arg-type]
            take(f"{name} in")
            seen[name] = DistributedDataParallel._get_active_ddp_module()  # type: ignore[no-untyped-call]
            take(f"{name} exits")
        take(f"{name} out")

    threads = [threading.Thread(target=forward, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    seen["after"] = DistributedDataParallel._get_active_ddp_module()  # type: ignore[no-untyped-call]
    return seen


def test_interleaved_ddp_forwards_leave_no_active_module_under_a_thread_world() -> None:
    with open_world("threads", world_size=2):
        seen = _interleaved_forwards()
    assert seen == {"a": "module a", "b": "module b", "after": None}


def test_ddp_gets_its_own_marking_back_when_the_last_thread_world_closes() -> None:
    with open_world("threads", world_size=1):
        pass
    assert "_thread_forward" not in repr(DistributedDataParallel.__dict__["_inside_ddp_forward"])
