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
        raise NotImplementedError(
            "exercise 06, the hook: (1) write param.grad times the reciprocal of world_size "
            "into `view` with torch's own op and no temporary (look up torch.mul's out=), as "
            "in exercise 03; (2) count one gradient fewer missing from bucket b; (3) launch "
            "every bucket that is next in order and complete, never one out of order, with an "
            "all_reduce that does not block (look up async_op in torch.distributed.all_reduce) "
            "and keep its work in self.in_flight; never wait here, backward must go on; (4) "
            "after launching the last bucket, have self._finish run when backward ends (look "
            "up queue_callback on torch.autograd.Variable._execution_engine, lesson 06). Try "
            "it before re-reading lesson 06's SmallReducer: the reference is close to it. "
            "Stuck? python lessons/grade.py --hint 06")

    def _finish(self) -> None:
        self._record("backward_end", -1)
        raise NotImplementedError(
            "exercise 06, the callback: wait for each launched bucket, in bucket order, and "
            "copy every parameter's averaged slice back into its .grad; then reset `missing` "
            "and `in_flight` so that the next backward starts afresh (the grader checks it). "
            "Stuck? python lessons/grade.py --hint 06")

    def _record(self, event: str, ident: int) -> None:
        self.timeline.append((event, ident, time.perf_counter()))
