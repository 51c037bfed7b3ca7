"""What this machine can hold: the plugins that import, the devices present, the backend
registered for them, and the largest World of each runner, checked before a run starts
anything (a World too large for the host would start, then hang or thrash long before any
test could say so).

- ``threads``: every rank is a thread of one interpreter, so a collective's rendezvous grows
  with the world size: 1,024 ranks measured 0.5 s per trivial all-reduce on the 2-core CI
  machine (256: 27 ms), so larger thread Worlds cannot finish a property; a quarter of the
  user's process limit (``RLIMIT_NPROC``) bounds it further where that is lower.
- ``processes``: every rank is a process with its own torch: on CPU at most
  ``PROCESSES_PER_CORE`` per usable core and one per ``MEMORY_PER_RANK`` of available
  memory; on an accelerator one device per rank, the devices visible.
- ``local``: one thread simulates every rank (torch's ``LocalTensorMode``), so every op runs
  once per rank in turn and one process holds every rank's tensors: ``LOCAL_WORLD_LIMIT``
  ranks, on CPU, on torch's fake process group, within ``LOCAL_MEMORY_SHARE``.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable
from typing import TYPE_CHECKING

from harness.errors import invalid

if TYPE_CHECKING:
    from harness.torchkit.devices import Machine

THREAD_WORLD_LIMIT = 1024
PROCESSES_PER_CORE = 8
MEMORY_PER_RANK = 512 * 2**20
"""A CPU rank process with torch and a suite's models: about 300 MB resident, measured."""


THREADED_BACKEND = "threaded"
"""What the thread runner's ranks always use: torch's threaded process group."""

LOCAL_BACKEND = "fake"
"""What the local runner's simulation always uses: torch's fake process group (rank 0 of
the World's size; LocalTensorMode computes every collective from the ranks' tensors)."""
LOCAL_WORLD_LIMIT = 256
"""The local runner's largest World: every op of a check runs once per simulated rank, and
every rank's tensors live in the one process. Measured on the 2-core CI machine: the
placements and uneven suites' dev examples take under 2 minutes at world sizes 8, 16 and
64 together, and several minutes at 256, where some drawn tensors (sides around twice the
world size) grow past the memory budget below."""
LOCAL_MEMORY_SHARE = 0.25
"""A simulation may grow the process by this share of the memory available when it starts
(a call that grows it further fails, naming the budget, instead of the host running out):
it holds every rank's tensors, and rank threads or processes would hold them too, spread
over a World's worth of ranks."""
LOCAL_DEVICES = ("cpu",)


def resolve_backend(runner: str, device: str, backend: str | None, machine: Machine) -> str:
    """The process-group backend a World of ``runner`` on ``device`` uses: the thread
    runner's is always torch's threaded group, the local runner's torch's fake group; the
    process and torchrun runners' the one ``machine`` resolved (``backend``, or the one torch
    pairs with the device: gloo on CPU)."""
    if runner == "threads":
        if backend not in (None, THREADED_BACKEND):
            raise invalid("backend", backend, _THREADS_BACKEND)
        return THREADED_BACKEND
    if runner == "local":
        if device not in LOCAL_DEVICES:
            raise invalid("device", device, _LOCAL_DEVICE)
        if backend not in (None, LOCAL_BACKEND):
            raise invalid("backend", backend, _LOCAL_BACKEND_WHY)
        return LOCAL_BACKEND
    assert machine.backend is not None, f"the {runner} runner's backend was not resolved"
    return machine.backend


_THREADS_BACKEND = (
    "unset on the thread runner: its ranks always use torch's threaded process group "
    "(--runner processes runs a backend)"
)
_LOCAL_BACKEND_WHY = (
    "unset on the local runner: one thread simulates every rank on torch's fake process "
    "group, and no collective reaches a backend (--runner processes runs a backend)"
)
_LOCAL_DEVICE = (
    "'cpu' on the local runner: its simulation of every rank in one thread is checked on "
    "CPU only (--runner threads or processes runs on an accelerator)"
)


def largest_world(runner: str, machine: Machine) -> tuple[int, str]:
    """The largest world size ``runner`` can hold on ``machine`` here, and why."""
    if runner == "threads":
        limit, why = THREAD_WORLD_LIMIT, "the thread runner's limit (THREAD_WORLD_LIMIT)"
        processes = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        if processes != resource.RLIM_INFINITY and processes // 4 < limit:
            limit, why = processes // 4, f"a quarter of this user's process limit ({processes})"
        return limit, why
    if runner == "torchrun":
        return 2**31, "ranks on the nodes torchrun starts (the driver cannot count them)"
    if runner == "local":
        return LOCAL_WORLD_LIMIT, "one thread runs every op once per rank (LOCAL_WORLD_LIMIT)"
    if machine.device != "cpu":
        count, device = machine.count, machine.device
        return count, f"one {device} device per rank process, and {count} are visible"
    cores = len(os.sched_getaffinity(0))
    by_cores = PROCESSES_PER_CORE * cores
    by_memory = available_memory() // MEMORY_PER_RANK
    if by_memory < by_cores:
        return by_memory, f"one rank process per {MEMORY_PER_RANK >> 20} MB of available memory"
    return by_cores, f"{PROCESSES_PER_CORE} rank processes per usable core ({cores} cores)"


def check_capacity(
    runner: str,
    device: str,
    world_sizes: Iterable[int],
    name: str = "world_sizes",
    *,
    backend: str | None = None,
    backend_plugins: tuple[str, ...] = (),
    started: int | None = None,
) -> str:
    """Refuse, before anything starts, a plugin that does not import, a device that is
    absent, a backend that is not registered for it, or a World too large (``name``: the
    argument the sizes came in); the backend the Worlds will use. ``started``: the rank
    processes torchrun starts on this machine for the torchrun runner (``--nnodes`` x
    ``--nproc-per-node``), held here as the process runner's would be.

    One pass down: this machine's facts are gathered once (``devices.survey``), then every
    size is decided from them."""
    from harness.torchkit import devices

    machine = devices.survey(
        device,
        backend_plugins,
        # torchrun's agents use the devices of their nodes, not this one's, unless it starts
        # them here; the local runner refuses any device but cpu itself (resolve_backend)
        present=runner in _RANKS_HERE or started is not None,
        resolve=runner in _BACKEND_RUNNERS,
        backend=backend,
    )
    chosen = resolve_backend(runner, device, backend, machine)
    if started is not None:
        _check_sizes("processes", machine, (started,), "nproc_per_node")
    _check_sizes(runner, machine, tuple(world_sizes), name)
    return chosen


_RANKS_HERE = ("threads", "processes")
"""The runners whose ranks run on this machine's devices."""
_BACKEND_RUNNERS = ("processes", "torchrun")
"""The runners whose ranks use a backend torch has registered (``--backend``)."""


def _check_sizes(runner: str, machine: Machine, sizes: tuple[int, ...], name: str) -> None:
    if not sizes:
        return
    limit, why = largest_world(runner, machine)
    too_large = [size for size in sizes if size > limit]
    if too_large:
        shown = too_large[0] if len(too_large) == 1 else tuple(too_large)
        raise invalid(name, shown, f"at most {limit} on the {runner} runner ({why})")


def available_memory() -> int:
    """Bytes of memory available to new allocations on this host (``MemAvailable``)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(pages) * os.sysconf("SC_PAGE_SIZE") if pages else 2**40
