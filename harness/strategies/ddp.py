"""Strategies for DistributedDataParallel's constructor options (a training case's
``wrapper_options`` under the ddp and zero layouts)."""

from __future__ import annotations

from functools import cache
from typing import Any

from hypothesis import strategies as st

from harness.cases.ddp import CPU_DEVICE, CpuDeviceCase
from harness.cases.training import DDP_GROUPS, delayable_parameters
from harness.errors import check_one_of, require
from harness.strategies._common import sampled, seeds, takes_world_size
from harness.torchkit.surface.inventory import callable_of, options_of, resolve

BUCKET_PER_PARAMETER = 1e-5
"""A DDP ``bucket_cap_mb`` that puts every parameter in a bucket of its own."""
_BUCKET_CAP_LISTS = ((1,), (1, 25))
"""``bucket_cap_mb_list``s: whole MiB, as its type says (each bucket's cap, the first
bucket's first)."""
_BUFFER_SYNC_NAMES = ("forward_sync_buffers", "broadcast_buffers")

_Options = tuple[tuple[str, Any], ...]


@cache
def _buffer_syncs() -> st.SearchStrategy[_Options]:
    """DDP's buffer syncs: the defaults, ``forward_sync_buffers``, or its deprecated spelling
    ``broadcast_buffers``, whose False also skips the sync at construction; of those, the
    ones the running torch's DDP takes (torch 2.11 has no ``forward_sync_buffers``)."""
    found = resolve("torch.nn.parallel:DistributedDataParallel")
    assert found is not None, "torch without DistributedDataParallel"
    taken = {option.name for option in options_of(callable_of(found[1]))}
    names = [name for name in _BUFFER_SYNC_NAMES if name in taken]
    return sampled(((), *(((name, on),) for name in names for on in (True, False))))


def ddp_options(draw: st.DrawFn, *, accumulates: bool, controls: bool) -> _Options:
    """The DDP constructor's keyword arguments: bucketing, ``static_graph`` only where no
    micro-batch skips the sync (``accumulates``; torch 2.13 fails that, spec
    optim.ddp.static_graph_no_sync checks it on its own), ``find_unused_parameters``, the
    buffer syncs. ``controls=True`` also draws how DDP starts and synchronises."""
    find_unused = draw(st.booleans())
    options: list[tuple[str, Any]] = [
        ("gradient_as_bucket_view", draw(st.booleans())),
        ("bucket_cap_mb", draw(sampled((25.0, BUCKET_PER_PARAMETER)))),
        ("static_graph", not accumulates and draw(st.booleans())),
        ("find_unused_parameters", find_unused),
        *draw(_buffer_syncs()),
    ]
    if controls:
        options += _controls(draw, find_unused=find_unused)
    return tuple(options)


def _controls(draw: st.DrawFn, *, find_unused: bool) -> list[tuple[str, Any]]:
    """``init_sync`` (False: the seeded model starts equal on every rank), the group (the
    default, an explicit one, or a 1-D mesh: one of them), the deprecated
    ``check_reduction`` and ``dim`` (DDP scatters inputs by it over ``device_ids`` only,
    never given here), ``batched_grad_copy``, ``bucket_cap_mb_list``,
    ``skip_all_reduce_unused_params`` with ``find_unused_parameters``. Not the late
    all-reduce (``delayed_all_reduces``), which torch 2.13 races with the next backward
    on gloo: spec ddp.delay_all_reduce.parity draws it on its own."""
    options = [
        ("init_sync", draw(st.booleans())),
        ("check_reduction", draw(st.booleans())),
        ("dim", draw(sampled((0, 1)))),
        ("batched_grad_copy", draw(st.booleans())),
    ]
    group = draw(sampled((None, *DDP_GROUPS)))
    if group is not None:
        options.append((group, DDP_GROUPS[group]))
    if find_unused:
        options.append(("skip_all_reduce_unused_params", draw(st.booleans())))
    caps = draw(st.none() | sampled(_BUCKET_CAP_LISTS))
    if caps is not None:
        options.append(("bucket_cap_mb_list", caps))
    return options


@st.composite
def delayed_all_reduces(draw: st.DrawFn, dims: tuple[int, ...], bias: bool) -> _Options:
    """``delay_all_reduce_named_params``: the parameters of an MLP of ``dims`` (two Linears
    or more) from a drawn Linear after the first on (their gradients are ready before the
    first Linear's), hooked to the first Linear's weight."""
    require(len(dims) > 2, "dims", dims, "the feature sizes of two Linears or more")
    first = draw(st.integers(1, len(dims) - 2))
    return (
        ("delay_all_reduce_named_params", delayable_parameters(dims, bias, first)),
        ("param_to_hook_all_reduce", "0.weight"),
    )


@takes_world_size
@st.composite
def cpu_device_cases(draw: st.DrawFn, world_size: int, *, option: str) -> CpuDeviceCase:
    """A CPU MLP wrapped with ``option`` (``device_ids``: a list of one device index or the
    CPU device; ``output_device``: an index or the CPU device), the other left None."""
    check_one_of("option", option, ("device_ids", "output_device"))
    device = draw(sampled((0, 1, world_size - 1, CPU_DEVICE)))
    dims = tuple(draw(st.integers(1, 5)) for _ in range(draw(st.integers(2, 3))))
    device_ids = (device,) if option == "device_ids" else None
    output_device = device if option == "output_device" else None
    return CpuDeviceCase(dims, draw(seeds()), device_ids, output_device)
