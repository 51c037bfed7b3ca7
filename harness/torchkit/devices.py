"""Devices and collective backends by name, through torch's accelerator API.

A device is ``cpu`` or an accelerator type torch knows (``cuda``, ``xpu``, ``mps``, ``hpu``,
``mtia``, or the name a ``PrivateUse1`` extension registers, such as ``npu``). Counts,
selection, streams and synchronisation go through ``torch.accelerator`` and
``torch.get_device_module``, so a vendor's device serves every suite without distconf
naming it. A collective backend is a name ``torch.distributed`` has registered (gloo, nccl,
xccl, or one a plugin registered with ``dist.Backend.register_backend``).

A *plugin* is a module imported in the driver and in every rank before a process group is
made: it registers a backend or a device that is not built into torch.
"""

from __future__ import annotations

import importlib
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from harness.errors import invalid

CPU = "cpu"
_NOT_DEVICES = frozenset({"meta", "mkldnn", "opengl", "opencl", "ideep", "vulkan", "lazy"})


def import_plugins(modules: tuple[str, ...]) -> None:
    """Import each plugin module (a second import is a no-op): in a rank, a failure raises
    as it is, with its traceback; ``survey`` says it in the driver."""
    for module in modules:
        importlib.import_module(module)


@dataclass(frozen=True)
class Machine:
    """What this machine offers a run on one device type, its plugins imported first
    (``survey``)."""

    device: str
    count: int
    """Devices of the type this process sees (1 for ``cpu``); 0 where ``survey`` was not
    asked whether the device is here."""
    backend: str | None
    """The process-group backend for the device: the one asked for (registered, serving the
    device) or the one torch pairs with it; None where ``survey`` was not asked for one."""


def survey(
    device: str, plugins: tuple[str, ...] = (), *, present: bool, resolve: bool, backend: str | None
) -> Machine:
    """This machine's facts for a run, gathered once and in this order (a plugin may add the
    device type or the backend): the plugins imported in the driver; with ``present``, the
    device here and how many of it; with ``resolve``, the process-group backend (``backend``,
    or the device's default). A plugin that does not import, a device this machine lacks and
    a backend that does not serve the device are refused, naming the option."""
    _import_in_driver(plugins)
    count = _count_present(device) if present else 0
    chosen = _resolve_backend(backend, device) if resolve else None
    return Machine(device=device, count=count, backend=chosen)


def _import_in_driver(modules: tuple[str, ...]) -> None:
    """Import the plugins in the driver; one that fails is a usage error with its traceback."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            shown = "".join(traceback.format_exception(exc)).rstrip()
            expected = f"a module this Python can import; importing it raised:\n{shown}"
            raise invalid("backend_plugin", module, expected) from None


def _count_present(device: str) -> int:
    """How many devices of type ``device`` this process sees, refusing a device type torch
    does not know, or one this machine does not have."""
    if device == CPU:
        return 1
    known = _known_accelerators()
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise invalid("device", device, _expected_type(known)) from None
    if parsed.index is not None:
        raise invalid("device", device, "a device type without an index: each rank picks its own")
    if parsed.type in _NOT_DEVICES or parsed.type == CPU:
        raise invalid("device", device, _expected_type(known))
    count = device_count(device)
    if count == 0:
        raise invalid("device", device, f"a device this machine has: {_absence(device)}")
    return count


def device_count(device: str) -> int:
    """How many devices of type ``device`` this process sees (0 when torch has no module
    for it, or none is present)."""
    if device == CPU:
        return 1
    try:
        module = torch.get_device_module(device)
    except RuntimeError:
        return 0
    if not module.is_available():
        return 0
    count = getattr(module, "device_count", None)
    return int(count()) if count is not None else 1


def rank_device(device: str, index: int) -> torch.device:
    """Make device ``index`` of type ``device`` this thread's current one and return it."""
    if device == CPU:
        return torch.device(CPU)
    chosen = torch.device(device, index)
    if accelerator_type() == device:
        torch.accelerator.set_device_index(index)
    else:
        torch.get_device_module(device).set_device(chosen)
    return chosen


def _resolve_backend(backend: str | None, device: str) -> str:
    """``backend``, refused where ``torch.distributed`` has not registered it or it does not
    serve ``device``; None: the backend torch pairs with ``device`` (gloo on CPU)."""
    if backend is None:
        return str(dist.get_default_backend_for_device(device))
    registered = [name for name in dist.Backend.backend_list if name != "undefined"]
    if backend.lower() not in registered:
        raise invalid(
            "backend",
            backend,
            f"a backend registered with torch.distributed, one of {registered} (a "
            "--backend-plugin module can register one with dist.Backend.register_backend)",
        )
    serves = dist.Backend.backend_capability.get(backend.lower(), [])
    if device not in serves:
        raise invalid("backend", backend, f"a backend for {device}: it serves {serves}")
    return backend


def accelerator_type() -> str:
    """The accelerator this torch sees (``cuda``, ``xpu``, ...); "cpu" when it has none.

    A torch built for an accelerator names it even where no device of it is present
    (torch 2.15's CUDA wheel on a CPU-only machine): availability decides."""
    current = torch.accelerator.current_accelerator()
    if current is None or not torch.accelerator.is_available():
        return CPU
    return current.type


def current_device(device: torch.device) -> torch.device:
    """The device of ``device``'s type that this thread currently selects."""
    if device.type == CPU:
        return device
    return torch.device(device.type, torch.accelerator.current_device_index())


def synchronize(device: torch.device) -> None:
    """Wait for every kernel queued on ``device`` (nothing to wait for on CPU)."""
    if device.type != CPU:
        torch.accelerator.synchronize(device)


def current_stream(device: torch.device) -> torch.Stream:
    return torch.accelerator.current_stream(device)


def _known_accelerators() -> list[str]:
    names = ["cuda", "xpu", "mps", "hpu", "mtia"]
    private = torch._C._get_privateuse1_backend_name()
    return [*names, private]


def _expected_type(known: list[str]) -> str:
    return (
        f"{CPU} or an accelerator type torch knows ({', '.join(known)}; a --backend-plugin "
        "module may register another)"
    )


def _absence(device: str) -> str:
    try:
        module = torch.get_device_module(device)
    except RuntimeError:
        return (
            f"torch {torch.__version__} has no module torch.{device} (a --backend-plugin "
            "module can import the extension that adds it)"
        )
    return f"{module.__name__}.is_available() is False (torch {torch.__version__})"
