"""What ``ZeroRedundancyOptimizer`` refuses, and why, with torch's words where torch has them.

* ``params``: an iterable of tensors or of group dicts, not empty, all of one dense type
  (torch's type names include the device: ``torch.FloatTensor`` and ``torch.cuda.FloatTensor``
  differ, so parameters on a CPU and a GPU are refused, as are two dtypes and sparse tensors);
* ``optimizer_class``: a class that builds an optimizer, not an optimizer already built, nor a
  class of something else; with ``overlap_with_ddp`` one that torch has a functional version of
  (the step takes the gradients as arguments: ``torch.distributed.optim.utils``);
* every rank must hold the same parameter groups (shapes, dtypes, hyperparameters: by value,
  objects whose repr is their address by type): a rank that disagrees would own other parameters,
  and the broadcasts would pair up wrong tensors or hang.
  torch does not check this; here it costs one ``all_gather_object`` at construction and at
  each ``add_param_group``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer


def parameters(params: Any) -> tuple[list, list[torch.Tensor]]:
    """``params`` as a list (for ``Optimizer.__init__``), and every parameter in it."""
    if isinstance(params, torch.Tensor):
        raise TypeError("`params` argument should be an iterable of Tensors, but got "
                        f"{torch.typename(params)}")
    try:
        given = list(params)
    except TypeError as error:
        raise TypeError("`params` argument should be an iterable of Tensors or dicts, but got "
                        f"{torch.typename(params)}") from error
    if not given:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if all(isinstance(p, torch.Tensor) for p in given):
        all_params = given
    elif all(isinstance(g, dict) for g in given):
        if any("params" not in g for g in given):
            raise ValueError("Each parameter group passed-in via `params` must have a 'params' "
                             "key mapping to the parameters in the group")
        all_params = [p for g in given for p in _as_list(g["params"])]
    else:
        raise TypeError("`params` argument should be an iterable of Tensors or dicts")
    same_dense_type(all_params)
    return given, all_params


def _as_list(params) -> list:
    return [params] if isinstance(params, torch.Tensor) else list(params)


def same_dense_type(params: list[torch.Tensor]) -> None:
    """One dense type (dtype and kind of device) for all: the shares are sent as flat tensors."""
    first = torch.typename(params[0])
    if params[0].is_sparse:
        raise ValueError("ZeroRedundancyOptimizer only supports using the same dense type for "
                         f"all parameters but got {first}: make the parameter dense.")
    for param in params[1:]:
        other = torch.typename(param)
        if other != first or param.is_sparse:
            raise ValueError(
                "ZeroRedundancyOptimizer only supports using the same dense type for all "
                f"parameters but got both {first} and {other} (on {params[0].device} and "
                f"{param.device}, in {params[0].dtype} and {param.dtype}): move the model to "
                "one device and one dtype first.")


def optimizer_class(cls: Any, overlap_with_ddp: bool):
    """What builds the local optimizer: ``cls``, or with ``overlap_with_ddp`` its functional
    version."""
    # imported here: torch.distributed.optim costs ~0.6 s, paid by every process importing
    # miniddp otherwise (torch's functional optimizers matter only with overlap_with_ddp)
    from torch.distributed.optim.utils import functional_optim_map

    functional = set(functional_optim_map.values())
    if isinstance(cls, Optimizer) or not callable(cls):
        raise TypeError(
            f"optimizer_class must be an optimizer class such as torch.optim.Adam, got "
            f"{'an optimizer already built' if isinstance(cls, Optimizer) else 'a'} "
            f"{type(cls).__module__}.{type(cls).__qualname__}: pass the class and its "
            "arguments, e.g. ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=1e-3); each "
            "rank builds its own local optimizer from them.")
    if inspect.isclass(cls) and not callable(getattr(cls, "step", None)):
        # (torch builds whatever it is given; a class of an optimizer that does not subclass
        # torch.optim.Optimizer still works, as long as it has param_groups and a step)
        raise TypeError(
            f"optimizer_class must be an optimizer class, a subclass of torch.optim.Optimizer "
            f"or one with a step(), got the class {cls.__module__}.{cls.__qualname__}: pass an "
            "optimizer class such as torch.optim.SGD or torch.optim.Adam.")
    if not overlap_with_ddp:
        if cls in functional:
            raise ValueError(f"Passing in a functional optimizer {cls} when "
                             "`overlap_with_ddp=False`: pass the ordinary optimizer class.")
        return cls
    if cls in functional:
        return cls
    if cls in functional_optim_map:
        return functional_optim_map[cls]
    raise ValueError(
        "Using `ddp_with_overlap=True` requires using a functional optimizer, but there is no "
        f"supported functional optimizer equivalent for {cls} (there is one for "
        f"{', '.join(sorted(c.__name__ for c in functional_optim_map))}).")


def _describe(value: Any) -> Any:
    """A value as the ranks compare it: by its repr, unless that holds an address (a function's
    or an object's default repr, which differs between processes): then by its type only."""
    if isinstance(value, torch.Tensor):
        shown = value.tolist() if value.numel() <= 16 else "..."
        return ("tensor", tuple(value.shape), str(value.dtype), shown)
    if isinstance(value, (tuple, list)):
        return type(value).__name__, [_describe(v) for v in value]
    shown = repr(value)
    if " at 0x" in shown:
        return f"a {type(value).__module__}.{type(value).__qualname__}"
    return shown


def describe_groups(param_groups: list[dict]) -> list:
    """What every rank must agree on, group by group: shapes, dtypes, hyperparameters."""
    return [{"params": [(tuple(p.shape), str(p.dtype)) for p in group["params"]],
             **{key: _describe(v) for key, v in sorted(group.items()) if key != "params"}}
            for group in param_groups]


def ranks_agree(param_groups: list[dict], group, when: str) -> None:
    """Raise on every rank if some rank's groups differ (the same collective on all ranks, so
    all raise together rather than hang later)."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return
    mine = describe_groups(param_groups)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in enumerate(everyone):
        if theirs == everyone[0]:
            continue
        if len(theirs) != len(everyone[0]):
            detail = f"rank 0 has {len(everyone[0])} parameter groups, rank {rank} {len(theirs)}"
        else:
            index = next(i for i, (a, b) in enumerate(zip(everyone[0], theirs)) if a != b)
            keys = sorted(k for k in set(theirs[index]) | set(everyone[0][index])
                          if theirs[index].get(k) != everyone[0][index].get(k))
            detail = (f"parameter group {index} differs in {', '.join(keys)}: rank 0 has "
                      f"{_show(everyone[0][index], keys, theirs[index])}, rank {rank} has "
                      f"{_show(theirs[index], keys, everyone[0][index])}")
        raise ValueError(
            f"ZeroRedundancyOptimizer has different parameter groups on different ranks {when} "
            f"({detail}). Each rank owns a share of the parameters and sends it to the "
            "others, so every rank must pass the same parameters, in the same order, with the "
            "same options; add_param_group needs to be called on all ranks alike.")


def _show(group: dict, keys: list[str], other: dict) -> str:
    return ", ".join(_param_summary(group["params"], other["params"]) if k == "params"
                     else f"{k}={group.get(k, '(none)')}" for k in keys)


def _param_summary(params: list, other: list) -> str:
    """How many parameters, and the first that differs from ``other`` (shape, dtype)."""
    first = next((i for i, (a, b) in enumerate(zip(params, other)) if a != b),
                 min(len(params), len(other)))
    at = (f"parameter {first} is {params[first][0]} {params[first][1]}" if first < len(params)
          else f"no parameter {first}")
    return f"{len(params)} parameters ({at})"
