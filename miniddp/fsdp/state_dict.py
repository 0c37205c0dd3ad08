"""Checkpoints of a sharded model as full tensors: gathered on save, cut again on load.

``model.state_dict()`` of a sharded model holds each rank's shards (plain tensors, this rank's
rows), which only a job with the same world size can load. A full state dict is the unsharded
model's, loadable anywhere, at the price of one all-gather per parameter on save.
"""

from __future__ import annotations

import torch
from torch import nn

from miniddp.fsdp.shard import ShardedParameter, gather_full


def _at_rest(model: nn.Module) -> None:
    for module in model.modules():
        state = getattr(module, "_fsdp_state", None)
        if state is not None and state.group is not None:
            state.group.reshard()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model's ``state_dict`` on every rank (a collective: every rank calls it)."""
    _at_rest(model)
    sharded = {name: p for name, p in model.named_parameters(remove_duplicate=False)
               if isinstance(p, ShardedParameter)}  # a tied weight is in the state under each name
    state = model.state_dict()
    with torch.no_grad():
        for name, param in sharded.items():
            state[name] = gather_full(param.to_local(), param._spec)
    return state


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor],
                         strict: bool = True):
    """Load an unsharded ``state`` (from :func:`full_state_dict` or an unsharded model): each
    rank keeps its own rows of every sharded parameter. Returns ``load_state_dict``'s result."""
    _at_rest(model)
    local = dict(state)
    for name, param in model.named_parameters():
        if isinstance(param, ShardedParameter) and name in state:
            full = state[name]
            if tuple(full.shape) != tuple(param._spec.full_shape):
                raise ValueError(
                    f"{name!r}: the state dict holds shape {list(full.shape)}, the model "
                    f"{list(param._spec.full_shape)}: is this a checkpoint of another model?")
            local[name] = param._spec.cut(full)
    return model.load_state_dict(local, strict=strict)
