"""The optimizer state of a sharded optimizer, whole again: for checkpoints.

Each rank's local optimizer numbers only its own parameters (0, 1, ... in the order it holds
them). A checkpoint wants torch's usual ``state_dict``: every parameter of every group,
numbered in the order the groups list them, as one un-sharded optimizer would have it. So:

* :func:`gather_local_states` sends every rank's local ``state_dict()`` to one rank (on the CPU);
* :func:`merge` renumbers each of them into the global numbering, over the base
  ``Optimizer.state_dict()`` (which has the groups' hyperparameters);
* :func:`load_into` does the reverse on every rank: the states of the parameters it owns go
  into its local optimizer, the others are dropped.

The result is key for key and bit for bit torch's ``ZeroRedundancyOptimizer.state_dict()``.
"""

from __future__ import annotations

import collections.abc
from typing import Any

import torch
import torch.distributed as dist


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor inside (dicts, lists, tuples) moved to ``device`` (a tensor
    already there is not copied)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        moved = [to_device(v, device) for v in value]
        return moved if isinstance(value, list) else tuple(moved)
    if isinstance(value, collections.abc.Mapping):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def local_state_dict(optimizer) -> dict:
    """``optimizer.state_dict()``; for torch's functional optimizers (``overlap_with_ddp``),
    which have none, the same layout built from their ``state`` and ``param_group``."""
    if hasattr(optimizer, "state_dict"):
        return optimizer.state_dict()
    params = optimizer.param_groups[0]["params"]
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return {"state": {i: dict(optimizer.state[p]) for i, p in enumerate(params)
                      if p in optimizer.state},
            "param_groups": [{**group, "params": list(range(len(params)))}]}


def gather_local_states(local_state: dict, to: int, rank: int, world_size: int,
                        group) -> list[dict]:
    """Every rank's local state dict, in rank order, on rank ``to`` (``to`` is a rank of
    ``group``); an empty list elsewhere. Every rank must call it."""
    cpu = torch.device("cpu")
    if world_size == 1:
        return [to_device(local_state, cpu)]
    gathered = [None] * world_size if rank == to else None
    dst = dist.get_global_rank(group, to) if group is not dist.group.WORLD else to
    dist.gather_object(to_device(local_state, cpu) if rank != to else None, gathered,
                       dst=dst, group=group)
    if rank != to:
        return []
    gathered[to] = to_device(local_state, cpu)  # this rank's own: no round trip through pickle
    return gathered


def merge(base: dict, local_states: list[dict], param_groups_per_rank: list[list[dict]],
          index_of: dict) -> dict:
    """``base`` (``Optimizer.state_dict()`` of the sharded optimizer itself) with each rank's
    local states renumbered into it: ``index_of`` maps a parameter to its global number."""
    for rank, local in enumerate(local_states):
        owned_groups = param_groups_per_rank[rank]
        if len(local["param_groups"]) != len(owned_groups):
            raise AssertionError(
                f"rank {rank} sent {len(local['param_groups'])} parameter groups, and "
                f"owns parameters in {len(owned_groups)}: the partition changed since the "
                "state was consolidated")
        for local_group, owned in zip(local["param_groups"], owned_groups):
            if len(local_group["params"]) != len(owned["params"]):
                raise AssertionError(
                    f"rank {rank} sent the state of {len(local_group['params'])} parameters "
                    f"of a group in which it owns {len(owned['params'])}")
            for local_index, param in zip(local_group["params"], owned["params"]):
                if local_index in local["state"]:
                    base["state"][index_of[param]] = local["state"][local_index]
    base["state"] = dict(sorted(base["state"].items()))
    return base


def load_into(local_optimizer, state_dict: dict, params: list[torch.Tensor],
              owner: dict, rank: int) -> dict:
    """Put the states of this rank's parameters into ``local_optimizer``; return a copy of
    ``state_dict`` whose other states are ``None`` (what torch passes on to the base class).
    ``params`` lists the parameters in global numbering; ``owner`` maps a parameter to its
    rank. Zero-dimensional state tensors (Adam's ``step``) stay on the CPU, as torch keeps
    them."""
    kept = dict(state_dict)
    kept["state"] = dict(state_dict["state"])
    for index, value in state_dict["state"].items():
        param = params[index]
        if owner[param] != rank:
            kept["state"][index] = None
            continue
        local = to_device(value, param.device)
        for key, item in local.items():
            if torch.is_tensor(item) and item.dim() == 0:
                local[key] = item.cpu()
        local_optimizer.state[param] = local
    return kept
