"""One parameter's dim-0 shard: torch.chunk's cut, padded to chunk 0's size.

Every rank keeps rows ``[rank * c, (rank + 1) * c)`` of the full parameter, where
``c = ceil(dim0 / W)`` is the size of ``torch.chunk``'s first chunk; the last ranks may hold fewer
rows, or none. Each rank's rows sit at the top of a zero-padded buffer of ``c`` rows, so that every
rank sends the same number of elements to the all-gather and receives the same number from the
reduce-scatter (a collective needs equal sizes). The optimizer sees only the unpadded rows: a
:class:`ShardedParameter` is a view of the buffer's top, so its in-place updates land in the buffer
and the padding stays zero.

Code written for torch's FSDP2 calls ``p.full_tensor()`` and ``p.to_local()`` on the sharded
parameters (torch's are DTensors); :class:`ShardedParameter` and :class:`ShardedTensor` (its
gradients) offer those two over a plain tensor. Gradient clipping needs the norm of the whole
gradient, so the norms of a :class:`ShardedTensor` are taken over every rank (``norms``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from miniddp.fsdp import collectives, norms


@dataclass(frozen=True)
class ShardSpec:
    """Where one rank's shard sits in the full tensor, and the group it was cut over (its shard
    group: ``None``, the default group)."""

    full_shape: torch.Size
    world_size: int
    rank: int
    group: object = field(default=None, compare=False)

    @property
    def chunk_rows(self) -> int:
        """Rows in ``torch.chunk``'s first chunk: every rank's shard is padded to this."""
        return math.ceil(self.full_shape[0] / self.world_size)

    @property
    def start(self) -> int:
        return min(self.rank * self.chunk_rows, self.full_shape[0])

    @property
    def rows(self) -> int:
        """Rows this rank really holds (fewer than ``chunk_rows`` on the last ranks, maybe 0)."""
        return min(self.start + self.chunk_rows, self.full_shape[0]) - self.start

    @property
    def padded_shape(self) -> torch.Size:
        return torch.Size((self.chunk_rows, *self.full_shape[1:]))

    @property
    def local_shape(self) -> torch.Size:
        return torch.Size((self.rows, *self.full_shape[1:]))

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``full`` (a view)."""
        return full.narrow(0, self.start, self.rows)


def padded_shard(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """A fresh ``chunk_rows``-row buffer holding this rank's rows of ``full``, zeros below."""
    padded = full.new_zeros(spec.padded_shape)
    padded[: spec.rows].copy_(spec.cut(full))
    return padded


def gather_full(local: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The full tensor from every rank's ``local`` rows (a collective of the shard group: every
    rank calls it)."""
    padded = local.new_zeros(spec.padded_shape)
    padded[: spec.rows].copy_(local)
    out = local.new_empty((spec.world_size * padded.numel(),))
    collectives.all_gather_flat(out, padded.reshape(-1), spec.group)
    rows = out.view(spec.world_size * spec.chunk_rows, *spec.full_shape[1:])
    return rows[: spec.full_shape[0]].clone()


class _ShardMethods:
    """``to_local`` and ``full_tensor``, the two DTensor methods FSDP2 code calls most."""

    _spec: ShardSpec

    def to_local(self) -> torch.Tensor:
        """This rank's rows as a plain tensor (sharing memory, and autograd, with the shard)."""
        return self.as_subclass(torch.Tensor)

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor, all-gathered from every rank's shard: every rank must call it."""
        with torch.no_grad():
            return gather_full(self.as_subclass(torch.Tensor), self._spec)


class ShardedParameter(_ShardMethods, nn.Parameter):
    """The parameter a rank's optimizer steps: its unpadded rows, a view of the padded buffer."""

    def __new__(cls, local: torch.Tensor, requires_grad: bool, spec: ShardSpec):
        param = torch.Tensor._make_subclass(cls, local, requires_grad)
        param._spec = spec
        return param

    def __deepcopy__(self, memo):
        raise NotImplementedError(
            "A parameter sharded by miniddp.fully_shard cannot be deep-copied (neither can "
            "torch's). Deep-copy the model before fully_shard, or save its full state dict "
            "(miniddp.fsdp.full_state_dict) and load it into a new model.")

    def __reduce_ex__(self, protocol):
        raise NotImplementedError(
            "A parameter sharded by miniddp.fully_shard cannot be pickled: save "
            "miniddp.fsdp.full_state_dict(model) (full tensors) or model.state_dict() (this "
            "rank's shards) instead.")

    def __repr__(self) -> str:
        return (f"ShardedParameter(rows {self._spec.start}:{self._spec.start + self._spec.rows} "
                f"of {list(self._spec.full_shape)} on rank {self._spec.rank}, "
                f"{self.as_subclass(torch.Tensor)!r})")


class ShardedTensor(_ShardMethods, torch.Tensor):
    """A sharded parameter's gradient: its rows of the reduce-scattered average.

    Every operation on it gives a plain tensor, except the norms that
    ``torch.nn.utils.clip_grad_norm_`` takes (``torch.linalg.vector_norm``,
    ``torch._foreach_norm``): those are the norms of the whole gradient, over every rank, as a
    DTensor's are, so that every rank clips by the same factor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.linalg.vector_norm or func is torch._foreach_norm:
                return norms.partial_norms(func, args, kwargs, ShardedTensor)
            return func(*args, **kwargs)

    @staticmethod
    def wrap(local: torch.Tensor, spec: ShardSpec) -> ShardedTensor:
        tensor = local.as_subclass(ShardedTensor)
        tensor._spec = spec
        return tensor


def count_as_plain_tensors_for_foreach() -> None:
    """torch's optimizers and ``clip_grad_norm_`` choose their multi-tensor (foreach) kernels
    only for tensor types on a list, and torch puts DTensor on it: without this, an optimizer of
    sharded parameters on a GPU would take the one-tensor-at-a-time path that torch's FSDP2 does
    not, and round differently (seen with Adam in bf16 on CUDA). Done at the first
    ``fully_shard``, not when miniddp is imported: a program that never shards keeps torch's
    lists as torch made them."""
    import importlib

    for module, types in (("torch.optim.optimizer", (ShardedParameter,)),
                          ("torch.utils._foreach_utils", (ShardedParameter, ShardedTensor))):
        try:
            owner = importlib.import_module(module)
        except ImportError:
            continue
        supported = getattr(owner, "_foreach_supported_types", None)
        for kind in types if isinstance(supported, list) else ():
            if kind not in supported:
                supported.append(kind)
