"""A sharded model's checkpoints: its own ``state_dict`` (sharded, as torch's), and full ones.

``model.state_dict()`` of a sharded model holds DTensors, as under torch's FSDP2: each rank's
rows, with the global shape and where they sit in it. ``torch.distributed.checkpoint`` (DCP) saves
those rows with their offsets, one file per rank, and loads them at any world size or mesh:
each rank reads the pieces of the saved rows that overlap its own. ``get_state_dict`` and
``set_state_dict`` (model and optimizer, ``full_state_dict=True`` too) work on them as on
torch's. The hooks below keep that true around a unit's life: ``state_dict`` and
``load_state_dict`` see the shards, never the gathered parameters, and a loaded tensor that
replaced a shard (``assign=True``) is padded again (``FSDPParam.reset_sharded``).

A full state dict is the unsharded model's, loadable anywhere, at the price of one all-gather per
parameter on save: :func:`full_state_dict` and :func:`load_full_state_dict`.
"""

from __future__ import annotations

import torch
from torch import nn

from miniddp.fsdp.shard import DTensor, spec_of


def _at_rest(model: nn.Module) -> None:
    for module in model.modules():
        state = getattr(module, "_fsdp_state", None)
        if state is not None and state.group is not None:
            state.group.reshard()


def register_hooks(group) -> None:
    """On every module holding one of ``group``'s parameters: reshard before ``state_dict`` and
    ``load_state_dict``, refuse a plain tensor where a shard is loaded, and take up what
    ``load_state_dict(assign=True)`` put in place."""
    def before_save(*_) -> None:
        group.reshard()

    def after_load(*_) -> None:
        for p in group.params:
            p.reset_sharded()

    for module in {id(m): m for p in group.params for m, _ in p.owners}.values():
        names = [name for p in group.params for m, name in p.owners if m is module]

        def before_load(state, prefix, *_, names=names) -> None:
            group.reshard()
            _check_loaded(state, prefix, names)

        module.register_state_dict_pre_hook(before_save)
        module._register_load_state_dict_pre_hook(before_load)
        module.register_load_state_dict_post_hook(after_load)


def _check_loaded(state: dict, prefix: str, names: list[str]) -> None:
    for name in names:
        value = state.get(prefix + name)
        if value is not None and not isinstance(value, DTensor):
            raise RuntimeError(
                f"{prefix + name!r}: the state dict holds a plain tensor of shape "
                f"{list(value.shape)} where the model has a sharded parameter (a DTensor). "
                "A full (unsharded) state dict loads with miniddp.fsdp.load_full_state_dict, or "
                "torch's set_model_state_dict(model, sd, options=StateDictOptions("
                "full_state_dict=True)); a sharded one is a model.state_dict() of the sharded "
                "model, saved and loaded with torch.distributed.checkpoint.")


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model's ``state_dict`` on every rank (a collective: every rank calls it)."""
    with torch.no_grad():
        return {name: value.full_tensor() if isinstance(value, DTensor) else value
                for name, value in model.state_dict().items()}


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor],
                         strict: bool = True):
    """Load an unsharded ``state`` (from :func:`full_state_dict` or an unsharded model): each
    rank keeps its own rows of every sharded parameter. Returns ``load_state_dict``'s result."""
    _at_rest(model)
    local = dict(state)
    for name, param in model.named_parameters():
        if isinstance(param, DTensor) and name in state:
            full = state[name]
            if tuple(full.shape) != tuple(param.shape):
                raise ValueError(
                    f"{name!r}: the state dict holds shape {list(full.shape)}, the model "
                    f"{list(param.shape)}: is this a checkpoint of another model? Build the "
                    "model the checkpoint was saved from, or load only the names that match "
                    "(strict=False after removing the others).")
            local[name] = DTensor.from_local(spec_of(param).cut(full), param.device_mesh,
                                             param.placements, run_check=False,
                                             shape=param.shape, stride=param.stride())
    return model.load_state_dict(local, strict=strict)
