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

import torch
import torch.distributed as dist
from torch import nn

from miniddp.fsdp.shard import ShardedParameter


def check_arguments(module, mesh, reshard_after_forward, offload_policy) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("miniddp.fully_shard shards over the default process group: call "
                           "torch.distributed.init_process_group first.")
    if not isinstance(module, nn.Module):
        raise NotImplementedError(
            f"miniddp.fully_shard takes one nn.Module, not {type(module).__name__} (torch's "
            "also takes a list of modules as one unit; miniddp does not).")
    if hasattr(module, "_fsdp_state"):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}: "
                         "apply it once per module.")
    if mesh is not None and not _is_the_whole_world(mesh):
        raise NotImplementedError(
            f"miniddp.fully_shard shards over the default process group only, not over {mesh}: "
            "leave mesh=None, or pass a 1-D mesh of every rank in order (2-D meshes, HSDP, and "
            "subgroups are not supported).")
    if not (reshard_after_forward is None or isinstance(reshard_after_forward, bool)):
        raise NotImplementedError(
            f"reshard_after_forward={reshard_after_forward!r}: miniddp supports True (ZeRO-3), "
            "False (ZeRO-2) or None; resharding to a smaller group after forward (an int) is "
            "not supported.")
    if offload_policy is not None and type(offload_policy).__name__ != "OffloadPolicy":
        raise NotImplementedError(
            f"offload_policy={offload_policy!r}: miniddp does not offload parameters to the "
            "CPU. Leave offload_policy=None.")


def _is_the_whole_world(mesh) -> bool:
    """A 1-D device mesh of ranks 0..W-1: the default group, which is torch's default mesh."""
    ranks = getattr(mesh, "mesh", None)
    return (getattr(mesh, "ndim", None) == 1 and isinstance(ranks, torch.Tensor)
            and ranks.tolist() == list(range(dist.get_world_size())))


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
            if id(param) in ignored or id(param) in seen or isinstance(param, ShardedParameter):
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
    if param.is_meta:
        raise NotImplementedError(
            f"parameter {name!r} is on the meta device: miniddp's fully_shard shards "
            "materialized parameters (torch's also takes meta parameters, to be materialized "
            "after sharding). Materialize the model first, or pass it in ignored_params.")


def owners(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (module, attribute name) below ``root`` holding each parameter (tied ones too)."""
    found: dict[int, list] = {}
    for _, sub in root.named_modules(remove_duplicate=False):
        for name, param in sub._parameters.items():
            if param is not None:
                found.setdefault(id(param), []).append((sub, name))
    return found
