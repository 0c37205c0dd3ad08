"""What one ``fully_shard`` call takes charge of (torch's ``_fsdp_init``): its arguments checked,
then its modules and their parameters, in torch's order.

The order of a unit's parameters is the order of its reduce-scatter buffer, and on gloo from 3
ranks on an element's bits depend on where it sits in that buffer. torch walks the modules
depth-first, children before their parent, and does not enter a module that is already a unit of
its own; each module contributes the parameters it holds itself. So a root's own parameter (a
``pos_embed``, a layer-scale ``gamma``) comes after its children's, not first as in
``module.parameters()``.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from miniddp.fsdp.mesh import MeshInfo, mesh_device_type
from miniddp.fsdp.shard import DTensor


def check_arguments(module, offload_policy) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("miniddp.fully_shard shards over process groups: call "
                           "torch.distributed.init_process_group first.")
    if not isinstance(module, nn.Module):
        raise NotImplementedError(
            f"miniddp.fully_shard takes one nn.Module, not {type(module).__name__} (torch's "
            "also takes a list of modules as one unit; miniddp does not).")
    if hasattr(module, "_fsdp_state"):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}: "
                         "apply it once per module.")
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise NotImplementedError(
            f"offload_policy={offload_policy!r}: miniddp does not offload parameters to the "
            "CPU. Leave offload_policy=None.")


def device_type(module: nn.Module) -> str:
    """The device of ``module``'s parameters, the one its default mesh is for; on the meta
    device, where the default group's backend communicates (the model is materialized there)."""
    for param in module.parameters():
        if not param.is_meta:
            return torch.device(param.device).type
    return mesh_device_type()


def reshard_choice(reshard_after_forward, mesh: MeshInfo) -> bool | None:
    """torch's reading of ``reshard_after_forward``: ``None`` and booleans as they are; an int
    is the size of a smaller group to reshard to after forward, a divisor of the shard group's
    size: 1 means ``False`` (kept whole, torch warns so) and the whole size ``True``. Resharding
    to a group in between is torch's only; miniddp says what to use instead."""
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward
    size = mesh.shard_size
    if (not isinstance(reshard_after_forward, int) or not 1 <= reshard_after_forward <= size
            or size % reshard_after_forward):
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r}: as an int, it is the "
                         f"size of the group to reshard to after forward, a factor of the shard "
                         f"group's {size} ranks (or a bool).")
    if reshard_after_forward == 1:
        warnings.warn("reshard_after_forward=1 (int) reshards the parameters to 1 rank after "
                      "forward: they stay gathered, as with reshard_after_forward=False (bool).",
                      stacklevel=3)
        return False
    if reshard_after_forward == size:
        return True
    raise NotImplementedError(
        f"reshard_after_forward={reshard_after_forward}: miniddp does not reshard to a group of "
        f"{reshard_after_forward} of the shard group's {size} ranks after forward (torch's "
        "FSDP2 does). Use True (reshard over all of them: the same bits, its backward gathers "
        f"from {size} ranks instead of {reshard_after_forward}) or False (keep the parameters "
        "gathered until backward, ZeRO-2), or a 2-D mesh whose shard dim has "
        f"{reshard_after_forward} ranks (HSDP: gathers stay inside that group).")


def managed_modules(root: nn.Module) -> list[nn.Module]:
    """``root`` and the modules below it that no inner ``fully_shard`` took, children first
    (torch's ``_get_managed_modules``); a module reached twice counts once."""
    found: list[nn.Module] = []
    visited: set[int] = set()

    def visit(module: nn.Module) -> None:
        if module is not root and hasattr(module, "_fsdp_state"):
            return  # a unit of its own
        visited.add(id(module))
        for child in module.children():
            if id(child) not in visited:
                visit(child)
        found.append(module)

    visit(root)
    return found


def managed_params(root: nn.Module, ignored: set[int]) -> list[tuple[nn.Parameter, str]]:
    """The parameters a unit at ``root`` shards, in torch's order, each with its name below
    ``root``; refuses what cannot be cut along dim 0."""
    names: dict[int, str] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    params, seen = [], set()
    for module in managed_modules(root):
        for param in module.parameters(recurse=False):
            if id(param) in ignored or id(param) in seen or isinstance(param, DTensor):
                continue  # (a sharded one: a module shared with an inner unit)
            seen.add(id(param))
            _check_shardable(param, names[id(param)])
            params.append((param, names[id(param)]))
    return params


def _check_shardable(param: nn.Parameter, name: str) -> None:
    if param.dim() == 0:  # torch refuses it too, with a ValueError
        raise ValueError(f"parameter {name!r} is a 0-d scalar: fully_shard cuts parameters "
                         "along dim 0. Give it a dimension (shape [1]) or pass it in "
                         "ignored_params.")


def owners(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (module, attribute name) below ``root`` holding each parameter (tied ones too)."""
    found: dict[int, list] = {}
    for _, sub in root.named_modules(remove_duplicate=False):
        for name, param in sub._parameters.items():
            if param is not None:
                found.setdefault(id(param), []).append((sub, name))
    return found
