"""torch's OpInfo database (``op_db``): the only module of ours that imports it.

The op-conformance suite runs every OpInfo on DTensors. A case names an OpInfo by its key
(``name`` or ``name.variant``), a dtype and the index of one of the OpInfo's own sample
inputs; the driver and every rank regenerate the same samples here (under a process-wide
lock and a fixed seed: rank threads share torch's global generator, which the samples draw
from) and describe their tensor arguments torch-free for the strategies.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import cache
from typing import Any
from unittest import mock

import torch

from harness.cases.ops import TensorArgument
from harness.errors import check_one_of

DTYPES = {"float32": torch.float32, "float64": torch.float64}
"""The dtypes the ops run in: the ones every floating kernel has on every device."""
_SAMPLE_SEED = 0
_lock = threading.Lock()


@cache
def _database() -> dict[str, Any]:
    # The import builds ~700 OpInfos (seconds): it waits for the first case that needs it.
    from torch.testing._internal import common_methods_invocations as database

    ops: dict[str, Any] = {}
    for op in (*database.op_db, *_foreach_ops(database)):
        supported = op.supported_dtypes("cpu")
        if any(dtype in supported for dtype in DTYPES.values()):
            key = f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name
            ops[key] = op
    return ops


def _foreach_ops(database: Any) -> list[Any]:
    """The ``_foreach_*`` OpInfos (optimizers' kernels), kept in tables of their own."""
    tables = ("unary", "binary", "pointwise", "reduce", "other")
    return [op for table in tables for op in getattr(database, f"foreach_{table}_op_db")]


def _sample_options(op: Any) -> dict[str, Any]:
    # a foreach sample is a list of 20 tensors by default: 3 lay out every kind of list
    return {"num_input_tensors": [3]} if op.name.startswith("_foreach_") else {}


def op_keys() -> tuple[str, ...]:
    """Every OpInfo (the ``_foreach_*`` ones included) with a float32 or float64 kernel on
    the CPU, by key, sorted."""
    return tuple(sorted(_database()))


def op_info(key: str) -> Any:
    check_one_of("op", key, _database())
    return _database()[key]


def dtypes_of(key: str) -> tuple[str, ...]:
    """The dtypes of ``DTYPES`` the OpInfo supports on the CPU."""
    supported = op_info(key).supported_dtypes("cpu")
    return tuple(name for name, dtype in DTYPES.items() if dtype in supported)


def differentiable(key: str, dtype: str) -> bool:
    return bool(op_info(key).supports_autograd) and dtype in DTYPES


_samples: dict[tuple[str, str], tuple[Any, ...]] = {}


def samples(key: str, dtype: str) -> tuple[Any, ...]:
    """The OpInfo's sample inputs in ``dtype`` on the CPU, the same in every process (shared:
    callers copy the tensors they change). Leaves require grad where the op has autograd.

    Made once per process, under the lock: a second maker would draw from the global
    generator while the first's caller, a rank thread gone on, may already draw from it."""
    check_one_of("dtype", dtype, DTYPES)
    with _lock:
        made = _samples.get((key, dtype))
        if made is None:
            made = _samples[key, dtype] = _made(key, dtype)
        return made


def forget_samples() -> None:
    """Make every OpInfo's samples again at their next use."""
    with _lock:
        _samples.clear()


def _made(key: str, dtype: str) -> tuple[Any, ...]:
    from torch.testing._internal.opinfo import core

    op = op_info(key)
    # sample_inputs looks for the unittest method calling it, to apply its per-sample skips,
    # by reading the source of every frame on the stack: a tenth of the ops suite's time
    # under pytest and Hypothesis, and never found, since no suite is a unittest.TestCase.
    no_test_method = mock.patch.object(core, "extract_test_fn", return_value=None)
    with no_test_method, torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SAMPLE_SEED)
        return tuple(
            op.sample_inputs(
                "cpu",
                DTYPES[dtype],
                requires_grad=differentiable(key, dtype),
                **_sample_options(op),
            )
        )


def tensors_of(sample: Any) -> Iterator[torch.Tensor]:
    """The sample's tensor arguments in a fixed order: its input, its positional arguments,
    then its keyword arguments, each one level into lists and tuples."""
    for value in (sample.input, *sample.args, *sample.kwargs.values()):
        if isinstance(value, list | tuple):
            yield from (v for v in value if isinstance(v, torch.Tensor))
        elif isinstance(value, torch.Tensor):
            yield value


def replaced(sample: Any, substitute: list[Any]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The sample's input, args and kwargs with its tensors replaced, in ``tensors_of``'s
    order, by ``substitute``."""
    pending = iter(substitute)

    def swap(value: Any) -> Any:
        if isinstance(value, list | tuple):
            swapped = [next(pending) if isinstance(v, torch.Tensor) else v for v in value]
            return type(value)(swapped)
        return next(pending) if isinstance(value, torch.Tensor) else value

    first = swap(sample.input)
    args = tuple(swap(a) for a in sample.args)
    kwargs = {name: swap(v) for name, v in sample.kwargs.items()}
    return first, args, kwargs


@cache
def arguments(key: str, dtype: str) -> tuple[tuple[TensorArgument, ...], ...]:
    """Per sample, its tensor arguments described for the strategies (shape, kind, finite)."""
    return tuple(tuple(map(_described, tensors_of(s))) for s in samples(key, dtype))


def _described(tensor: torch.Tensor) -> TensorArgument:
    if tensor.is_floating_point():
        kind = "float"
    elif tensor.is_complex():
        kind = "complex"
    else:
        kind = "bool" if tensor.dtype == torch.bool else "int"
    plain = tensor.layout == torch.strided and not tensor.is_quantized
    finite = bool(torch.isfinite(tensor).all()) if plain and kind == "float" else kind != "complex"
    return TensorArgument(shape=tuple(tensor.shape), kind=kind, finite=finite, strided=plain)


@cache
def is_random(key: str, dtype: str, index: int) -> bool:
    """Whether the op's values on sample ``index`` are not a function of its inputs: the op
    says so (uninitialized memory), or the sample gives other values under another seed (a
    random op, or dropout a sample asks for)."""
    op = op_info(key)
    # torch 2.11's OpInfo has no such field
    if getattr(op, "has_nondeterministic_output", False) or _reseeds(op.op):
        return True
    sample = samples(key, dtype)[index]
    runs = []
    for seed in (1, 2):
        fresh = [t.detach().clone() for t in tensors_of(sample)]
        first, args, kwargs = replaced(sample, fresh)
        with _lock, torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                out = op.op(first, *args, **kwargs)
            except Exception:
                return False
        runs.append([t.detach() for t in _tensor_leaves(out)])
    return any(not _same(a, b) for a, b in zip(*runs, strict=True))


def _reseeds(function: Any) -> bool:
    """Whether the OpInfo's function seeds torch's generator itself before each call (how
    the database makes a random op repeatable on one device; DTensor draws its random
    values from offsets of its own, so they are other values)."""
    code = getattr(function, "__code__", None)
    return code is not None and "wrapper_set_seed" in code.co_names


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    from torch.utils import _pytree as pytree

    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.layout != torch.strided or b.layout != torch.strided:
        return True
    return a.shape == b.shape and bool(torch.equal(a.nan_to_num(), b.nan_to_num()))
