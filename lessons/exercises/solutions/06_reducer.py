"""Exercise 06 (lesson 06): the reducer: hooks, buckets, async all_reduce, a callback.

``Reducer(model, buckets)`` puts a hook on every parameter
(``register_post_accumulate_grad_hook``); ``buckets`` lists parameter indices per bucket, in
launch order, and ``set_buckets`` gives each parameter a view into its bucket's flat buffer.
Write the two pieces that make DDP:

* ``_on_ready`` (the hook, when ``param.grad`` is final): copy ``grad * (1 / world_size)`` into
  the parameter's view; when the next bucket to launch is complete, launch its all_reduce with
  ``async_op=True`` and keep the work; buckets strictly in order (a later bucket that fills
  first waits for its predecessors), so every rank issues the same collectives in the same
  order; after the last launch, queue ``_finish`` on the autograd engine.
* ``_finish`` (after backward computed every gradient): wait for every bucket in order and copy
  the averages back into ``.grad``; reset for the next backward.

Try it before re-reading lesson 06's ``SmallReducer``: the reference solution is close to it.
``python lessons/grade.py --hint 06`` gives the idea if you are stuck; ``--step 2`` adds the
shape of the code, ``--step 3`` its lines.

Graded by ``python lessons/grade.py 06``: ``_finish`` run by the autograd engine once after
every backward, every launched all_reduce waited for before its bucket is read, the state reset;
gradients equal torch's DDP's bit for bit at every step at 2 and 3 ranks (one bucket at step 0,
torch's rebuilt buckets after, then buckets that complete out of order); every all_reduce
asynchronous and launched during backward, in bucket order.
"""

import functools
import time

import torch
import torch.distributed as dist
from torch import nn


class Reducer:
    """Average gradients over the ranks during backward, bucket by bucket."""

    def __init__(self, model: nn.Module, buckets: list[list[int]]):
        self.params = list(model.parameters())
        self.world_size = dist.get_world_size()
        self.timeline: list[tuple[str, int, float]] = []
        self.set_buckets(buckets)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._on_ready, i))

    def set_buckets(self, buckets: list[list[int]]) -> None:
        """One flat buffer per bucket; ``views[i] = (bucket, parameter i's slice of it)``."""
        self.buckets, self.flat, self.views = buckets, [], {}
        for b, members in enumerate(buckets):
            first = self.params[members[0]]
            flat = torch.empty(sum(self.params[i].numel() for i in members),
                               dtype=first.dtype, device=first.device)
            offset = 0
            for i in members:
                n = self.params[i].numel()
                self.views[i] = (b, flat[offset:offset + n].view_as(self.params[i]))
                offset += n
            self.flat.append(flat)
        self.missing = [len(members) for members in buckets]  # gradients each bucket awaits
        self.in_flight = []  # the launched all_reduces' works, in bucket order

    def _on_ready(self, i: int, param: torch.Tensor) -> None:
        self._record("ready", i)
        b, view = self.views[i]
        torch.mul(param.grad, 1.0 / self.world_size, out=view)
        self.missing[b] -= 1
        while len(self.in_flight) < len(self.buckets) and self.missing[len(self.in_flight)] == 0:
            k = len(self.in_flight)
            self._record("launch", k)
            self.in_flight.append(dist.all_reduce(self.flat[k], async_op=True))
            if k == len(self.buckets) - 1:
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        self._record("backward_end", -1)
        for b, work in enumerate(self.in_flight):
            work.wait()
            for i in self.buckets[b]:
                self.params[i].grad.copy_(self.views[i][1])
        self.missing = [len(members) for members in self.buckets]
        self.in_flight = []

    def _record(self, event: str, ident: int) -> None:
        self.timeline.append((event, ident, time.perf_counter()))
