"""The tensors inside a unit's inputs and outputs, wherever users put them: tuples, lists,
dicts, namedtuples and dataclasses (torch's ``collect_grad_tensors``, ``replace_grad_tensors``
and ``_apply_to_tensors``). A unit hooks each one that needs a gradient (an output tensor the
hooks missed would leave the unit ungathered for its backward) and casts each floating one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


def grad_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor that needs a gradient in ``obj``, in a fixed order."""
    found: list[torch.Tensor] = []
    map_grad_tensors(obj, lambda tensor: found.append(tensor) or tensor)
    return found


def map_grad_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with every tensor that needs a gradient replaced by ``fn(tensor)``, in
    :func:`grad_tensors`' order; containers in which nothing changed are returned as they are."""
    return map_tensors(obj, lambda t: fn(t) if t.requires_grad else t)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        items = [map_tensors(item, fn) for item in obj]
        return type(obj)(*items) if _changed(items, obj) else obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn)
                   for f in dataclasses.fields(obj)}
        changes = {k: v for k, v in changes.items() if v is not getattr(obj, k)}
        return dataclasses.replace(obj, **changes) if changes else obj
    if isinstance(obj, dict):
        values = {k: map_tensors(v, fn) for k, v in obj.items()}
        if not _changed(list(values.values()), obj.values()):
            return obj
        return values if type(obj) is dict else type(obj)(values)
    if isinstance(obj, (list, tuple)):
        items = [map_tensors(item, fn) for item in obj]
        if not _changed(items, obj):
            return obj
        try:
            return type(obj)(items)
        except TypeError:  # a subclass with an __init__ of its own
            return list(items) if isinstance(obj, list) else tuple(items)
    return obj


def _changed(new, old) -> bool:
    return any(a is not b for a, b in zip(new, old))
