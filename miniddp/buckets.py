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

import itertools
import sys
import weakref
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
    chosen = [assign_buckets([params[i] for i in ready_order], limits, ready_order)]
    device = params[0].device if params[0].device.type != "cpu" else None  # a GPU for NCCL
    dist.broadcast_object_list(chosen, src=group_rank0(group), group=group, device=device)
    return chosen[0]


def _view_of(buffer: torch.Tensor, param: torch.Tensor, offset: int) -> torch.Tensor:
    """``param``'s slot in ``buffer`` at ``offset``: with its shape, and its strides if it covers
    its memory without gaps or overlaps in some order of its dimensions (as torch's "gradient
    layout contract" asks: then ``empty_like`` keeps them), so each copy is element for
    element."""
    if param.stride() == torch.empty_like(param, device="meta").stride():
        return buffer.as_strided(param.shape, param.stride(), offset)
    return buffer.narrow(0, offset, param.numel()).view(param.shape)


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


class AllReduceSum:
    """How a bucket is reduced without a communication hook: its gradients, already scaled by
    ``1 / world_size`` on the way in, summed across ranks by one asynchronous all_reduce (what
    torch's reducer runs as its default hook). A comm hook replaces this object
    (``miniddp.options.comm_hooks.CommHook``) and does its own averaging."""

    averages = False  # the reducer scales gradients into the bucket; a comm hook does not

    def __init__(self, group=None):
        self.group = group  # None: the default group, held weakly (see sync.held)
        self._world = weakref.ref(dist.group.WORLD)  # (looked up again if it was replaced)

    def launch(self, bucket: Bucket, bucket_count: int):
        """Start the sum. Through the group's own ``allreduce``: ``dist.all_reduce``'s checks
        cost about 3 us a call, and ``dist.group.WORLD`` two Python calls."""
        group = self.group or self._world() or dist.group.WORLD
        return group.allreduce([bucket.buffer])  # async, SUM

    def finish(self, bucket: Bucket) -> None:
        """Nothing to do once it is waited for: the all_reduce summed the bucket in place."""


class Bucket:
    """One flat gradient buffer, a view into it per member parameter, and the bucket's own part
    of every backward (the reducer decides when: readiness, the order of launches, the end of
    backward):

    1. :meth:`fill`: a member's gradient is ready. It is copied into its view at once, scaled
       on the way (``copy_in``), or, in a bucket that ``copies_at_end``, kept for the last one;
    2. :meth:`complete`: in a bucket that ``scales_whole``, the last one is in. The kept
       gradients are copied in with one call, and the whole bucket scaled with one more;
    3. :meth:`launch`: its reduction starts, asynchronously (an all_reduce, or a comm hook's);
    4. :meth:`wait`, then :meth:`write_back`: the averages into ``.grad``;
    5. :meth:`reset`: ready for the next backward.

    A view has its parameter's shape and strides (as torch's "gradient layout contract" asks),
    so copying a gradient in or out is an element-for-element copy. The bucket sets its own
    fields, from what it is given: when built, and in :meth:`choose_copy`.
    """

    def __init__(self, index: int, param_indices: list[int], params: list[torch.Tensor],
                 copy_at_end_bytes: float = -1, batched: bool = False,
                 grads_are_views: bool = False):
        self.index, self.param_indices = index, param_indices
        self.params = [params[i] for i in param_indices]  # (one dtype and device: assign_buckets)
        self.numel = sum(p.numel() for p in self.params)
        self.buffer = self.params[0].new_empty(self.numel)  # their dtype, on their device
        offsets = itertools.accumulate((p.numel() for p in self.params), initial=0)
        self.views = [_view_of(self.buffer, p, at) for p, at in zip(self.params, offsets)]
        self.done_notice = None  # the future of launch's on_done, until waited for
        self.choose_copy(copy_at_end_bytes, batched, grads_are_views)

    def choose_copy(self, copy_at_end_bytes: float, batched: bool, grads_are_views: bool) -> None:
        """How its gradients come in. If each is of at most ``copy_at_end_bytes``, they wait
        for the last one (``copies_at_end``): one call copies them in, one scales the whole
        bucket (``scales_whole``), by the operand each would meet on the way in: the same bits.
        That trades a call per gradient for one more pass over the bucket, which pays on a CPU
        only for small gradients (benchmarks/README.md). ``batched`` (torch's
        ``batched_grad_copy``): every bucket waits and is *divided* whole, as torch's (other
        bits at 3 ranks and more). A ``.grad`` that is its view has nothing to wait for.
        """
        small = len(self.views) > 1 and max(v.nbytes for v in self.views) <= copy_at_end_bytes
        self.scales_whole = batched or (small and not grads_are_views)
        self.copies_at_end = self.scales_whole and not grads_are_views
        self.reset()

    def reset(self) -> None:
        """What one backward does with the bucket, undone for the next."""
        self.pending = len(self.params)  # gradients still to come
        self.waiting: list[tuple] = []  # (gradient, view) pairs, copied in with the last one
        self.work = None  # the reduction in flight, once launched

    def fill(self, slot: int, copy_in) -> bool:
        """Member ``slot``'s gradient is ready: into its view now (``copy_in(param, view,
        scale)``), or kept for the last one. True when it was the last."""
        grad = self.params[slot].grad
        if self.copies_at_end and grad is not None:  # (of a gradient in a graph: its value)
            self.waiting.append((grad.detach() if grad.requires_grad else grad, self.views[slot]))
        else:  # (a bucket that scales whole does so once complete)
            copy_in(self.params[slot], self.views[slot], not self.scales_whole)
        self.pending -= 1
        return self.pending == 0

    def complete(self, scale) -> None:
        """The last gradient of a bucket that scales whole is in: copy in those that waited,
        with one call, and scale the whole bucket (``scale(buffer)``)."""
        if self.waiting:
            torch._foreach_copy_([view for _, view in self.waiting], [g for g, _ in self.waiting])
        scale(self.buffer)

    def launch(self, reduction, bucket_count: int, on_done=None) -> None:
        """Start reducing the bucket across ranks (:class:`AllReduceSum`, or a comm hook);
        ``on_done(bucket)`` when it has finished (on a communication thread)."""
        self.work = reduction.launch(self, bucket_count)
        if on_done is not None:  # waited for with the bucket: it must not outlive the process
            self.done_notice = self.work.get_future().then(lambda _future: on_done(self))

    def wait(self) -> None:
        """Block until the reduction (and any ``on_done``) has finished."""
        self.work.wait()
        if self.done_notice is not None:
            self.done_notice.wait()
            self.done_notice = None

    def write_back(self, write_one, used: list[bool] | None = None) -> None:
        """The averages into ``.grad``, with one call for all the plain ones, while later
        buckets are still in flight. ``write_one(index, view)`` takes a ``.grad`` that is
        missing or part of a graph; a parameter no rank used (``used``) keeps its ``.grad``."""
        grads, averages = [], []
        for i, param, view in zip(self.param_indices, self.params, self.views):
            if used is not None and not used[i]:
                continue
            grad = param.grad
            if grad is None or grad.requires_grad:
                write_one(i, view)
            else:
                grads.append(grad)
                averages.append(view)
        if grads:  # one dispatch for all: a private op, present from torch 2.1 on
            torch._foreach_copy_(grads, averages)

    def info(self, names: list[str]) -> BucketInfo:
        return BucketInfo(self.index, [names[i] for i in self.param_indices],
                          list(self.param_indices), self.numel,
                          self.numel * self.buffer.element_size(), self.buffer.dtype,
                          self.buffer.device)
