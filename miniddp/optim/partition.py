"""Who owns which parameter: torch's two partitions, written out.

ZeRO stage 1 gives every parameter exactly one owner rank. The owner keeps that parameter's
optimizer state, steps it, and sends the new values to everyone else. Which rank owns what must
be decided the same way on every rank, from nothing but the parameters, and it must be torch's
decision for the bits (and the consolidated state) to be torch's.

* :func:`greedy_by_size` (the ordinary step): group by group, the group's parameters from the
  largest to the smallest (ties keep their order), each to the rank with the fewest elements so
  far (the lowest such rank). The totals carry over from one group to the next.
* :func:`assign_ddp_buckets` (``overlap_with_ddp``): the step runs inside DDP's communication
  hook, one DDP gradient bucket at a time, so a rank owns whole buckets (bucket ``i`` to rank
  ``i % world_size``), or with ``shard_buckets`` consecutive slices of buckets, filled up to
  ``total / world_size`` elements each.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


def lightest(sizes: list[int], excluded: set[int] = frozenset()) -> int:
    """The index of the smallest size (the first of equals), skipping ``excluded``."""
    best, best_size = -1, float("inf")
    for index, size in enumerate(sizes):
        if index not in excluded and size < best_size:
            best, best_size = index, size
    if best < 0:
        raise AssertionError("every rank is excluded")
    return best


def greedy_by_size(param_groups: list[dict], world_size: int) -> list[list[dict]]:
    """Each rank's parameter groups: ``result[rank][g]`` is group ``g`` with only the parameters
    that ``rank`` owns (possibly none; the other keys are the group's own)."""
    per_rank: list[list[dict]] = [[] for _ in range(world_size)]
    sizes = [0] * world_size
    for group in param_groups:
        owned: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        for param in sorted(group["params"], key=lambda p: p.numel(), reverse=True):
            rank = lightest(sizes)
            owned[rank].append(param)
            sizes[rank] += param.numel()
        for rank in range(world_size):
            per_rank[rank].append(with_params(group, owned[rank]))
    return per_rank


def with_params(group: dict, params: list[torch.Tensor]) -> dict:
    """A shallow copy of ``group`` holding ``params``: the hyperparameters stay shared values."""
    copied = copy.copy(group)
    copied["params"] = params
    return copied


@dataclass
class BucketShare:
    """The consecutive slice ``parameters`` of DDP bucket ``bucket_index`` that one rank steps,
    starting at position ``offset`` of the bucket's parameters (and of its gradients). After the
    first initialisation, ``tensor`` is one flat tensor the slice's ``param.data`` are views of,
    so that one broadcast sends the whole slice."""

    bucket_index: int
    parameters: list[torch.Tensor]
    offset: int
    tensor: torch.Tensor | None = None

    def __post_init__(self):
        if not self.parameters:
            raise ValueError("Empty bucket assignment")

    @property
    def device(self) -> torch.device:
        return self.parameters[0].device


def assign_ddp_buckets(params_per_bucket: list[list[torch.Tensor]], world_size: int,
                       shard_buckets: bool) -> list[dict[int, BucketShare]]:
    """``result[rank]`` maps bucket index to the :class:`BucketShare` that ``rank`` steps, in
    the order torch makes them (which decides the order of each rank's parameters)."""
    shares: list[dict[int, BucketShare]] = [{} for _ in range(world_size)]
    if not shard_buckets:
        for index, params in enumerate(params_per_bucket):
            shares[index % world_size][index] = BucketShare(index, params, 0)
        return shares
    threshold = sum(p.numel() for ps in params_per_bucket for p in ps) / world_size
    assigned = [0] * world_size
    by_size = sorted(enumerate(params_per_bucket), key=lambda ib: sum(p.numel() for p in ib[1]))
    for index, params in by_size:
        taken: set[int] = set()  # a rank gets at most one slice of a bucket
        start, size = 0, 0
        for position, param in enumerate(params):
            if size + param.numel() >= threshold and position > start:
                rank = lightest(assigned, taken)
                shares[rank][index] = BucketShare(index, params[start:position], start)
                taken.add(rank)
                assigned[rank] += size
                start, size = position, 0
            size += param.numel()
        rank = lightest(assigned, taken)
        shares[rank][index] = BucketShare(index, params[start:], start)
        assigned[rank] += size
    return shares


def owners_per_bucket(shares: list[dict[int, BucketShare]], buckets: int) -> list[set[int]]:
    """For each bucket, the ranks that step a slice of it."""
    owners: list[set[int]] = [set() for _ in range(buckets)]
    for rank, mine in enumerate(shares):
        for index in mine:
            owners[index].add(rank)
    return owners


def flatten_into_views(params: list[torch.Tensor]) -> torch.Tensor:
    """One flat tensor holding ``params`` one after the other (one dtype and device); each
    ``param.data`` becomes a view of its slice, so one broadcast sends them all."""
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype,
                       device=params[0].device)
    offset = 0
    for p in params:
        flat[offset:offset + p.numel()].copy_(p.data.flatten())
        p.data = flat[offset:offset + p.numel()].view_as(p.data)
        offset += p.numel()
    return flat
