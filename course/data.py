"""The data the lessons train on: the reference job's teacher task (``miniddp.train.data``: inputs,
a hidden teacher that labels them, the student to train), and each rank's shard of it.

A lesson that has not met ``DistributedSampler`` yet cuts the dataset itself (:func:`shard`).
"""

from __future__ import annotations

from torch.utils.data import Subset

from miniddp.train.data import IN_FEATURES, OUT_FEATURES, make_dataset, make_model

__all__ = ["IN_FEATURES", "OUT_FEATURES", "make_dataset", "make_model", "shard"]


def shard(dataset, rank: int, world_size: int) -> Subset:
    """The samples ``rank, rank + world_size, rank + 2 * world_size, ...`` of ``dataset``.

    Shards are disjoint and all the same length: the last ``len(dataset) % world_size`` samples
    are dropped, because a rank with one batch more than the others would wait forever in a
    collective that its peers never join.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    per_rank = len(dataset) // world_size
    return Subset(dataset, range(rank, per_rank * world_size, world_size))
