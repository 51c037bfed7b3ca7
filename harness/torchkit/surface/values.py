"""Option values as the surface records them: short, stable texts (``True``, ``0.01``,
``'max-autotune'``, ``torch.bfloat16``, ``Shard(dim=0)``, ``DeviceMesh(2, 2)``, a class's name
for any other object), so that two calls passing the same choice read the same."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

LONGEST = 60
"""Characters a value's text keeps (longer ones end in ``...``)."""
ITEMS = 4
"""Items of a sequence spelled out (the others counted)."""
_PLACEMENTS = "torch.distributed.tensor.placement_types"


def summary(value: Any) -> str:
    """``value``'s text; never raises, and never calls a repr of unknown cost."""
    try:
        text = _spelled(value, depth=0)
    except Exception:  # a value's own code failed: its type still says what was chosen
        text = type(value).__name__
    return text if len(text) <= LONGEST else text[: LONGEST - 3] + "..."


def _spelled(value: Any, depth: int) -> str:
    if value is None or isinstance(value, bool | int | str | enum.Enum):
        return repr(value) if not isinstance(value, enum.Enum) else str(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, list | tuple | set | frozenset):
        return _sequence(value, depth)
    if callable(value) and hasattr(value, "__name__") and not isinstance(value, type):
        return f"{getattr(value, '__qualname__', value.__name__)}"
    return _torch_object(value, depth)


def _sequence(value: Any, depth: int) -> str:
    if depth > 1:
        return f"{type(value).__name__}[{len(value)}]"
    items = sorted(value, key=str) if isinstance(value, set | frozenset) else list(value)
    shown = [_spelled(item, depth + 1) for item in items[:ITEMS]]
    if len(items) > ITEMS:
        shown.append(f"+{len(items) - ITEMS}")
    opening, closing = ("[", "]") if isinstance(value, list) else ("(", ")")
    return f"{opening}{', '.join(shown)}{closing}"


def _torch_object(value: Any, depth: int) -> str:
    """dtypes, devices, meshes and tensors by what tells them apart; small dataclasses
    (placements, policies) by their fields; anything else by its class."""
    import torch

    if isinstance(value, torch.dtype | torch.device | torch.layout):
        return str(value)
    if isinstance(value, torch.Tensor):
        return f"Tensor[{str(value.dtype).removeprefix('torch.')}]"
    name = type(value).__name__
    if type(value).__module__ == _PLACEMENTS:
        return repr(value)  # Shard(dim=0), Partial(sum): a placement's repr is its fields
    if name == "DeviceMesh":
        shape = ", ".join(str(size) for size in value.shape)
        names = value.mesh_dim_names
        return f"DeviceMesh({shape}{', ' + '/'.join(names) if names else ''})"
    if dataclasses.is_dataclass(value) and depth <= 1:
        return f"{name}({_changed_fields(value, depth)})"
    return name


def _changed_fields(value: Any, depth: int) -> str:
    """A dataclass's public fields that differ from their defaults: what was chosen, and
    short enough that two different choices never read alike once cut at ``LONGEST``."""
    shown = []
    for spec in dataclasses.fields(value):
        if spec.name.startswith("_"):
            continue
        text = _spelled(getattr(value, spec.name), depth + 1)
        if spec.default is dataclasses.MISSING or text != _spelled(spec.default, depth + 1):
            shown.append(f"{spec.name}={text}")
    return ", ".join(shown)
