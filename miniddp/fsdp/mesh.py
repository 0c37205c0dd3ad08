"""Which ranks a unit shards over, and which hold replicas of its shards (torch's ``FSDPMeshInfo``
and ``HSDPMeshInfo``).

FSDP cuts every parameter over one group of ranks. HSDP (hybrid sharding) cuts it over a
smaller group, a *shard group* (the GPUs of one machine, where links are fast), and repeats that
cut on every other shard group: ranks at the same place in each shard group hold the same rows,
and form a *replicate group* (one rank per machine, across the slow links). Gathers stay inside
the shard group; a gradient is reduce-scattered there, then all-reduced across the replicate
group, so each replica's shards stay equal (``collectives.average``).

``fully_shard(mesh=...)`` takes, as torch's does, a 1-D ``DeviceMesh`` (FSDP over its ranks) or a
2-D one, replicate dim first (``init_device_mesh("cpu", (replicas, shards),
mesh_dim_names=("replicate", "shard"))``); or miniddp's :class:`HybridMesh`, the same layout
over a DeviceMesh it builds; or ``None``, every rank of the default group (a 1-D DeviceMesh over
the world, as torch's default). Every unit keeps its DeviceMesh: the sharded parameters are
DTensors on it (``shard``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # torch 2.1
    from torch.distributed._tensor import DeviceMesh


@dataclass(frozen=True)
class MeshInfo:
    """A unit's groups: ``shard_group`` (``None``: the default group) cuts the parameters;
    ``replicate_group`` (``None``: plain FSDP) holds the same cut once per shard group."""

    shard_group: object = None
    replicate_group: object = None
    #: The DeviceMesh the sharded parameters are DTensors on: its last dim is the shard group,
    #: and under HSDP its first the replicate group
    device_mesh: object = field(default=None, compare=False)

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.shard_group)

    @property
    def shard_rank(self) -> int:
        return dist.get_rank(self.shard_group)

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)

    @property
    def data_parallel_size(self) -> int:
        """The ranks that each compute a gradient: every one is in the average."""
        return self.shard_size * self.replicate_size


#: Plain FSDP over the default group (as the collectives see it)
EVERY_RANK = MeshInfo()


def mesh_device_type() -> str:
    """The device a DeviceMesh miniddp builds is for: where the default group's backend
    communicates (NCCL: the GPU; gloo: the CPU)."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


class HybridMesh:
    """HSDP's layout without a ``DeviceMesh``: ``replicas`` shard groups of ``shards`` ranks each,
    laid out as ``init_device_mesh(..., (replicas, shards))`` lays them out. Ranks
    ``[k * shards, (k + 1) * shards)`` shard together (machine ``k``, say); ranks ``s``,
    ``s + shards``, ``s + 2 * shards``, ... hold the same rows (a replicate group).

    Every rank must build it, in the same order (it creates process groups)::

        mesh = miniddp.fsdp.HybridMesh(replicas=2, shards=4)   # 2 machines of 4 GPUs
        for block in model.blocks:
            miniddp.fully_shard(block, mesh=mesh)
        miniddp.fully_shard(model, mesh=mesh)
    """

    def __init__(self, replicas: int, shards: int, device_type: str | None = None):
        world = dist.get_world_size()
        if replicas < 1 or shards < 1 or replicas * shards != world:
            raise ValueError(
                f"HybridMesh(replicas={replicas}, shards={shards}) covers {replicas * shards} "
                f"ranks, the default group has {world}: replicas x shards must be the world "
                "size.")
        self.replicas, self.shards = replicas, shards
        #: the same layout as torch's 2-D mesh, so that the sharded parameters are DTensors on it
        self.device_mesh = DeviceMesh(device_type or mesh_device_type(),
                                      torch.arange(world).view(replicas, shards),
                                      mesh_dim_names=("replicate", "shard"))
        self.shard_group = _dim_group(self.device_mesh, 1)
        self.replicate_group = _dim_group(self.device_mesh, 0)

    def __repr__(self) -> str:
        return f"HybridMesh(replicas={self.replicas}, shards={self.shards})"


def mesh_info(mesh, device_type: str) -> MeshInfo:
    """The groups ``fully_shard(mesh=mesh)`` means, or a refusal that says what to pass.
    ``None``: a 1-D DeviceMesh of every rank for ``device_type`` (its group is the default
    group itself)."""
    if mesh is None:
        return MeshInfo(device_mesh=DeviceMesh(device_type, list(range(dist.get_world_size()))))
    if isinstance(mesh, HybridMesh):
        return MeshInfo(mesh.shard_group, mesh.replicate_group, mesh.device_mesh)
    ndim = getattr(mesh, "ndim", None)
    if ndim == 1:
        return MeshInfo(_dim_group(mesh, 0), device_mesh=mesh)
    if ndim == 2:  # torch's order: (replicate, shard)
        return MeshInfo(_dim_group(mesh, 1), _dim_group(mesh, 0), mesh)
    raise NotImplementedError(
        f"fully_shard(mesh={mesh!r}): miniddp takes a 1-D DeviceMesh (FSDP over its ranks), a "
        "2-D one, replicate dim first (HSDP: init_device_mesh(device, (replicas, shards), "
        "mesh_dim_names=('replicate', 'shard'))), miniddp.fsdp.HybridMesh(replicas, shards), "
        "or None (every rank).")


def _dim_group(mesh, dim: int):
    get_group = getattr(mesh, "get_group", None)  # torch 2.2 on; get_dim_groups before
    return get_group(dim) if get_group else mesh.get_dim_groups()[dim]
