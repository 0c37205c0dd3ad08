"""Which ranks a unit shards over, and which hold replicas of its shards (torch's ``FSDPMeshInfo``
and ``HSDPMeshInfo``).

FSDP cuts every parameter over one group of ranks. HSDP (hybrid sharding) cuts it over a
smaller group, a *shard group* (the GPUs of one machine, where links are fast), and repeats that
cut on every other shard group: ranks at the same place in each shard group hold the same rows,
and form a *replicate group* (one rank per machine, across the slow links). Gathers stay inside
the shard group; a gradient is reduce-scattered there, then all-reduced across the replicate
group, so each replica's shards stay equal (``collectives.reduce_gradients``).

``fully_shard(mesh=...)`` takes, as torch's does, a 1-D ``DeviceMesh`` (FSDP over its ranks) or a
2-D one, replicate dim first (``init_device_mesh("cpu", (replicas, shards),
mesh_dim_names=("replicate", "shard"))``); or miniddp's :class:`HybridMesh`, the same layout
without DeviceMesh; or ``None``, every rank of the default group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class MeshInfo:
    """A unit's groups: ``shard_group`` (``None``: the default group) cuts the parameters;
    ``replicate_group`` (``None``: plain FSDP) holds the same cut once per shard group."""

    shard_group: object = None
    replicate_group: object = None

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


#: Plain FSDP over the default group: ``fully_shard``'s meaning of ``mesh=None``
EVERY_RANK = MeshInfo()


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

    def __init__(self, replicas: int, shards: int):
        world = dist.get_world_size()
        if replicas < 1 or shards < 1 or replicas * shards != world:
            raise ValueError(
                f"HybridMesh(replicas={replicas}, shards={shards}) covers {replicas * shards} "
                f"ranks, the default group has {world}: replicas x shards must be the world "
                "size.")
        self.replicas, self.shards = replicas, shards
        rows = [list(range(k * shards, (k + 1) * shards)) for k in range(replicas)]
        self.shard_group = _my_group(rows)
        self.replicate_group = _my_group([list(column) for column in zip(*rows)])

    def __repr__(self) -> str:
        return f"HybridMesh(replicas={self.replicas}, shards={self.shards})"


def _my_group(partition: list[list[int]]):
    """Every rank creates every group of ``partition`` (a collective), and keeps its own."""
    rank, mine = dist.get_rank(), None
    for ranks in partition:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def mesh_info(mesh) -> MeshInfo:
    """The groups ``fully_shard(mesh=mesh)`` means, or a refusal that says what to pass."""
    if mesh is None:
        return EVERY_RANK
    if isinstance(mesh, HybridMesh):
        return MeshInfo(mesh.shard_group, mesh.replicate_group)
    ndim = getattr(mesh, "ndim", None)
    if ndim == 1:
        return MeshInfo(_dim_group(mesh, 0))
    if ndim == 2:  # torch's order: (replicate, shard)
        return MeshInfo(_dim_group(mesh, 1), _dim_group(mesh, 0))
    raise NotImplementedError(
        f"fully_shard(mesh={mesh!r}): miniddp takes a 1-D DeviceMesh (FSDP over its ranks), a "
        "2-D one, replicate dim first (HSDP: init_device_mesh(device, (replicas, shards), "
        "mesh_dim_names=('replicate', 'shard'))), miniddp.fsdp.HybridMesh(replicas, shards), "
        "or None (every rank).")


def _dim_group(mesh, dim: int):
    get_group = getattr(mesh, "get_group", None)  # torch 2.2 on; get_dim_groups before
    return get_group(dim) if get_group else mesh.get_dim_groups()[dim]
