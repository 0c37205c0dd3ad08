"""What a reducer is built with: its settings, the options attached, and its buckets' layout.

:class:`ReducerLayout` is the base of ``miniddp.reducer.Reducer``, which runs the step; this
part runs when a reducer is built, at the one rebuild and when an option comes in, never in a
plain step. **Settings** come to the constructor, as torch's reducer takes its flags (the
bucket caps, ``batched_copy``: torch's ``batched_grad_copy``). **Options** (the objects of
``miniddp.options``) come in one way, :meth:`~ReducerLayout.attach`, and act only through the
reducer's public methods, at the step lines that name them. **The layout** follows torch's
rules (``miniddp.buckets``); each ``Bucket`` is told how its gradients come in
(:meth:`~ReducerLayout.copy_buckets_at_end`) and sets its own fields from that.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from miniddp.buckets import (
    UNLIMITED_BYTES,
    AllReduceSum,
    Bucket,
    BucketInfo,
    assign_buckets,
    bucket_limits,
)
from miniddp.events import EventStream
from miniddp.sync import held

#: On a CPU, a bucket of gradients of at most this many bytes each has them copied in with
#: its last one (``ReducerLayout.copy_buckets_at_end``).
COPY_AT_END_BYTES_CPU = 64 * 1024

#: What :meth:`ReducerLayout.attach` takes: the options of ``miniddp.options``.
OPTIONS = ("views", "comm_hook", "unused", "static_graph", "graph_gradients")


class ReducerLayout(EventStream):
    """A reducer's settings, options and buckets. See the module docstring."""

    def __init__(self, params: list[torch.Tensor], names: list[str], process_group,
                 bucket_cap_mb: float | None, bucket_caps: list[int] | None,
                 batched_copy: bool):
        super().__init__()
        self.params, self.names = params, names
        self.group = held(process_group)  # None for the default group (see held)
        self.world_size = dist.get_world_size(process_group)
        self.divisor = self.world_size  # what gradients are divided by
        #: Byte limits of the buckets after the rebuild: the first bucket's, then the rest's
        #: (the last repeats); ``bucket_caps`` (torch's ``bucket_cap_mb_list``) when given.
        self.bucket_limits = bucket_caps or list(bucket_limits(bucket_cap_mb))
        self.bucket_caps = bucket_caps  # given as a list: it applies from iteration 0 too
        self.batched_copy = batched_copy
        self.views = self.unused = self.static_graph = self.graph_gradients = None  # (attach)
        self.comm_hook = AllReduceSum(self.group)  # what reduces a bucket
        self.has_rebuilt = False
        # A bucket of gradients of at most this many bytes each waits for its last one.
        on_gpu = bool(params) and params[0].device.type != "cpu"
        self.copy_at_end_bytes = float("inf") if on_gpu else COPY_AT_END_BYTES_CPU

    def initial_assignment(self, find_unused: bool = False) -> list[list[int]]:
        """Iteration 0: one bucket per dtype/device, unless unused parameters are expected."""
        limits = self.bucket_limits if find_unused else [UNLIMITED_BYTES]
        limits = self.bucket_caps or limits  # bucket_cap_mb_list applies from iteration 0
        return list(reversed(assign_buckets(self.params, limits)))

    def lay_out_buckets(self, assignment: list[list[int]]) -> None:
        """New buckets, one per list of parameter indices (at construction, the rebuild, or
        an option that changes the layout: ``options/static_graph.py``)."""
        # Free the old buffers before allocating the new ones (as torch does), or a rebuild holds
        # two copies of every bucket at once; a gradient that is a view keeps its buffer alive.
        self.buckets, self.slot_of = [], {}
        self.buckets = [Bucket(b, indices, self.params, self.copy_at_end_bytes, self.batched_copy,
                               self.views is not None) for b, indices in enumerate(assignment)]
        self.slot_of = {i: (b, k) for b in self.buckets for k, i in enumerate(b.param_indices)}
        if self.views is not None:  # options/gradient_views.py: .grad moves with its bucket
            self.views.move_into(self.buckets, self.params)

    def copy_buckets_at_end(self, max_bytes: float) -> None:
        """A bucket whose gradients are all of at most ``max_bytes`` copies them in with its
        last one (``Bucket.choose_copy`` says why); ``float("inf")``: every bucket (a GPU's);
        -1: none."""
        self.copy_at_end_bytes = max_bytes
        for bucket in self.buckets:  # (options/gradient_views.py: a view waits for nothing)
            bucket.choose_copy(max_bytes, self.batched_copy, self.views is not None)

    def attach(self, **options) -> None:
        """The one way an option joins: ``attach(unused=UnusedParameters(...))``; ``None``
        detaches one (``comm_hook=None``: the plain all_reduce)."""
        for name, option in options.items():
            if name not in OPTIONS:
                raise TypeError(f"the reducer has no option {name!r}; its options: {OPTIONS}")
            setattr(self, name, option)
        if options.get("comm_hook", self.comm_hook) is None:
            self.comm_hook = AllReduceSum(self.group)
        if options.get("views") is not None:  # options/gradient_views.py
            self.views.move_into(self.buckets, self.params)
        if "views" in options:
            self.copy_buckets_at_end(self.copy_at_end_bytes)

    def bucket_info(self) -> list[BucketInfo]:
        return [bucket.info(self.names) for bucket in self.buckets]
