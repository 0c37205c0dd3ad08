"""One parameter's dim-0 shard: torch.chunk's cut, padded to chunk 0's size, seen as a DTensor.

Every rank keeps rows ``[rank * c, (rank + 1) * c)`` of the full parameter, where
``c = ceil(dim0 / W)`` is the size of ``torch.chunk``'s first chunk; the last ranks may hold fewer
rows, or none. Each rank's rows sit at the top of a zero-padded buffer of ``c`` rows, so that every
rank sends the same number of elements to the all-gather and receives the same number from the
reduce-scatter (a collective needs equal sizes).

The optimizer, ``state_dict`` and checkpoints see the unpadded rows as torch's FSDP2 shows them:
an ``nn.Parameter`` wrapping a DTensor, torch.distributed's own type for "this rank holds part of
a global tensor". It has the global shape (``p.shape``, ``p.numel()``), its placements
(``Shard(0)`` over the unit's mesh; ``(Replicate(), Shard(0))`` under HSDP) and its local tensor,
a view of the top of the padded buffer, so in-place updates (the optimizer's) land in the buffer
and the padding stays zero. That type is what lets ``torch.distributed.checkpoint`` write each
rank's rows with their offsets and reshard them on load, and what makes ``clip_grad_norm_`` reduce
norms over the ranks. The rows-per-rank picture (:class:`ShardSpec`) is what the course draws;
``p.to_local()`` is this rank's rows of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

try:  # torch 2.5 on
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
except ImportError:  # torch before 2.5: the same types under their old home
    from torch.distributed._tensor import DTensor, Replicate, Shard
    from torch.distributed._tensor.placement_types import DTensorSpec, TensorMeta

__all__ = ["DTensor", "ShardSpec", "as_dtensor", "dtensor_spec", "padded_shard", "spec_of"]


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


def dtensor_spec(device_mesh, hybrid: bool, full: torch.Tensor) -> DTensorSpec:
    """How a DTensor of ``full``'s shape is laid out on ``device_mesh``: cut along dim 0 over its
    last dim (the shard group), and under HSDP (``hybrid``) repeated along its first."""
    placements = (Replicate(), Shard(0)) if hybrid else (Shard(0),)
    return DTensorSpec(device_mesh, placements,
                       tensor_meta=TensorMeta(full.shape, full.stride(), full.dtype))


def as_dtensor(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """``local`` (this rank's rows) seen as the DTensor ``spec`` describes, sharing its memory
    and without an autograd edge (torch's ``_from_local_no_grad``: no checks, no collective)."""
    try:
        return DTensor(local, spec, requires_grad=False)
    except TypeError:  # torch before 2.4 builds a DTensor from its mesh and placements
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                                  shape=spec.shape, stride=spec.stride)


def spec_of(param: DTensor) -> ShardSpec:
    """The rows-per-rank picture of a sharded parameter (or gradient): its cut over the shard
    dim of its mesh (the last)."""
    mesh, dim = param.device_mesh, param.device_mesh.ndim - 1
    return ShardSpec(param.shape, mesh.size(dim), mesh.get_local_rank(dim), mesh.get_group(dim))
