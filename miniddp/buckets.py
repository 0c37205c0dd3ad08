"""Gradient buckets: which parameters share one flat buffer, and the buffer itself.

One all_reduce per parameter pays the collective's fixed latency hundreds of times per step;
one all_reduce for the whole model cannot start until the last gradient exists. DDP groups
gradients into buckets of about 25 MiB, and launches each bucket's all_reduce as soon as the
bucket is full.

To give the same bits as torch's DDP, the buckets must be torch's buckets exactly: for world
size 3 and up, gloo's ring sums an element in an order that depends on where the element sits
in the flat buffer and how long the buffer is. So :func:`assign_buckets` reproduces the rules of
torch's ``_compute_bucket_assignment_by_size`` (in ``torch/csrc/distributed/c10d/reducer.cpp``):

* parameters are grouped by (dtype, device), each group filling its own open bucket;
* a bucket closes when its size in bytes becomes >= the current limit (the parameter that
  crosses the limit stays in it; parameters are never split), then the next limit applies and
  the last limit repeats;
* for the first assignment (parameters in model order) buckets are sorted by their smallest
  index; the caller then reverses the list so the last layers, whose gradients are ready first,
  are reduced first. When rebuilding from the order gradients became ready, that order is
  kept as it is.

When the layout changes is part of the bits too. Iteration 0 has one bucket per dtype/device
(the order gradients arrive in is not known yet); during the first synchronized backward the
reducer records that order, and at the next forward :func:`rebuilt_assignment` groups the
parameters in it, once, with every rank adopting rank 0's grouping.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from miniddp.sync import group_rank0
from miniddp.torch_versions import EXPLICIT_CAP_COVERS_FIRST_BUCKET

MIB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25
#: torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``: a small first bucket starts communication early.
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB
#: A byte limit no bucket reaches: every parameter of a dtype/device in one bucket (iteration 0).
UNLIMITED_BYTES = sys.maxsize


def bucket_limits(bucket_cap_mb: float | None,
                  explicit_cap_covers_first: bool = EXPLICIT_CAP_COVERS_FIRST_BUCKET
                  ) -> tuple[int, int]:
    """Return ``(first_bucket_bytes, bucket_bytes)`` for a ``bucket_cap_mb`` argument.

    ``None`` means torch's defaults, 1 MiB then 25 MiB. An explicit cap applies to every bucket
    from torch 2.4 on; before, to every bucket but the first (see
    :data:`miniddp.torch_versions.EXPLICIT_CAP_COVERS_FIRST_BUCKET`). A cap of 0 is torch's too:
    every bucket is full as soon as it holds one parameter, so each parameter gets its own.
    A negative cap is refused (torch's C++ reads it as a huge unsigned size: one bucket).
    """
    # torch's first-bucket constant may be changed by its users: read it, don't copy it.
    first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", DEFAULT_FIRST_BUCKET_BYTES)
    if bucket_cap_mb is None:
        return first, DEFAULT_BUCKET_CAP_MB * MIB
    if not bucket_cap_mb >= 0:
        raise ValueError(f"bucket_cap_mb must be a number of MiB >= 0 (0: one bucket per "
                         f"parameter), got {bucket_cap_mb!r}")
    cap = int(bucket_cap_mb * MIB)
    return (cap if explicit_cap_covers_first else first), cap


def bucket_limits_list(bucket_cap_mb_list: list[float] | None) -> list[int] | None:
    """Bytes for torch's ``bucket_cap_mb_list`` (2.13): one limit per bucket, the last repeating.

    With a list, torch uses it for the first buckets as well as for the rebuild, even when
    iteration 0 would otherwise hold every parameter in one bucket. ``None`` or empty: unused.
    A limit of 0 closes its bucket after one parameter, as in torch.
    """
    if not bucket_cap_mb_list:
        return None
    if not all(cap >= 0 for cap in bucket_cap_mb_list):
        raise ValueError("bucket_cap_mb_list must hold numbers of MiB >= 0, got "
                         f"{list(bucket_cap_mb_list)!r}")
    return [int(cap * MIB) for cap in bucket_cap_mb_list]


def assign_buckets(tensors: list[torch.Tensor], limits: list[int],
                   indices: list[int] | None = None) -> list[list[int]]:
    """Group tensors into buckets by torch's rules; return each bucket's tensor indices.

    ``indices[k]`` is the index of ``tensors[k]`` (the gradient-ready order when rebuilding);
    without it, tensor k has index k and the buckets are sorted by their smallest index.
    When several dtypes or devices share a model, open buckets are closed in the order their
    (dtype, device) first appeared; torch uses a hash map there, so the order of those last
    buckets may differ from torch's for mixed-dtype models (never for a single dtype).
    """
    if not tensors:
        raise ValueError("cannot assign buckets for an empty list of tensors")
    closed: list[list[int]] = []
    open_buckets: dict[tuple, list] = {}  # (dtype, device) -> [indices, bytes, limit position]
    for k, tensor in enumerate(tensors):
        index = k if indices is None else indices[k]
        entry = open_buckets.setdefault((tensor.dtype, tensor.device), [[], 0, 0])
        entry[0].append(index)
        entry[1] += tensor.numel() * tensor.element_size()
        if entry[1] >= limits[min(entry[2], len(limits) - 1)]:
            closed.append(entry[0])
            entry[0], entry[1], entry[2] = [], 0, entry[2] + 1
    closed.extend(entry[0] for entry in open_buckets.values() if entry[0])
    if indices is None:
        closed.sort(key=min)
    return closed


def rebuilt_assignment(params: list[torch.Tensor], ready_order: list[int], limits: list[int],
                       group=None) -> list[list[int]]:
    """The buckets from iteration 1 on: ``params`` in the order their gradients became ready.

    Each rank computes a grouping from its own order, and the orders may differ across ranks
    (threads, unused parameters); the buckets must not, so every rank adopts rank 0's.
    """
    mine = assign_buckets([params[i] for i in ready_order], limits, ready_order)
    count = len(params)
    sizes = [len(b) for b in mine] + [0] * (count - len(mine))
    flat = torch.tensor([len(mine)] + sizes + [i for b in mine for i in b],
                        dtype=torch.int64, device=params[0].device)  # a GPU for NCCL
    dist.broadcast(flat, src=group_rank0(group), group=group)
    values = flat.tolist()
    buckets, sizes, indices = values[0], values[1:count + 1], values[count + 1:]
    result, start = [], 0
    for size in sizes[:buckets]:
        result.append(indices[start:start + size])
        start += size
    return result


def _is_dense(t: torch.Tensor) -> bool:
    """True when ``t`` covers its memory without gaps or overlaps (any dimension order)."""
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.size(d) == 1:
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


@dataclass
class BucketInfo:
    """What a bucket holds, for lessons, tests and benchmarks to show."""

    index: int
    names: list[str]
    param_indices: list[int]
    numel: int
    nbytes: int
    dtype: torch.dtype
    device: torch.device


class Bucket:
    """One flat gradient buffer and a view into it per member parameter.

    A view has its parameter's shape and strides (as torch's "gradient layout contract" asks),
    so copying a gradient in or out is an element-for-element copy.
    """

    def __init__(self, index: int, param_indices: list[int], params: list[torch.Tensor]):
        self.index = index
        self.param_indices = param_indices
        members = [params[i] for i in param_indices]
        self.numel = sum(p.numel() for p in members)
        self.buffer = torch.empty(self.numel, dtype=members[0].dtype, device=members[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in members:
            if p.dtype != self.buffer.dtype or p.device != self.buffer.device:
                raise ValueError("all parameters of a bucket must share dtype and device")
            if _is_dense(p):
                view = self.buffer.as_strided(p.shape, p.stride(), offset)
            else:
                view = self.buffer.narrow(0, offset, p.numel()).view(p.shape)
            self.views.append(view)
            offset += p.numel()
        # What one backward does with it, reset by the reducer after each backward:
        self.copy_at_end = False  # its gradients wait for its last one (the reducer decides)
        self.pending = len(param_indices)  # gradients still to come
        self.waiting: list[tuple] = []  # (gradient, view) pairs, copied in with the last one
        self.work = None  # the in-flight all_reduce, once launched
        self.done = None  # with a "done" listener: the future of that record

    def info(self, names: list[str]) -> BucketInfo:
        return BucketInfo(self.index, [names[i] for i in self.param_indices],
                          list(self.param_indices), self.numel,
                          self.numel * self.buffer.element_size(), self.buffer.dtype,
                          self.buffer.device)
