"""The checks behind lessons/grade.py for exercise 06, the reducer.

Root causes first: whether ``_finish`` ran after every backward, and whether it left the state
reset for the next one. Only then the bits against torch's DDP, and what a spy standing in for
``dist.all_reduce`` saw of how the collectives were launched and waited for.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from grading_checks import flat_grads, many_layers, on_ranks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp.buckets import bucket_limits
from miniddp.torch_versions import EXPLICIT_CAP_COVERS_FIRST_BUCKET
from miniddp.train.data import make_dataset

CAP_MB_06 = 0.02


class AllReduceSpy:
    """Stands in for dist.all_reduce during the learner's backward; records how it is used."""

    def __init__(self, reducer):
        self.reducer, self.calls, self.waits = reducer, [], []
        self.original = dist.all_reduce

    def ready_so_far(self) -> int:
        return sum(event == "ready" for event, _, _ in self.reducer.timeline)

    def __call__(self, tensor, *args, async_op=False, **kwargs):
        work = self.original(tensor, *args, async_op=async_op, **kwargs)
        self.calls.append((async_op, tensor.data_ptr(), self.ready_so_far()))
        if async_op:
            spy = self

            class Work:
                def wait(self, *a, **k):
                    spy.waits.append(spy.ready_so_far())
                    return work.wait(*a, **k)

            return Work()
        return work


def reducer_task(steps: int = 3):
    Reducer = sys.modules["exercise_06"].Reducer
    rank = dist.get_rank()
    mine = many_layers()
    saved_first = dist._DEFAULT_FIRST_BUCKET_BYTES
    if not EXPLICIT_CAP_COVERS_FIRST_BUCKET:  # torch < 2.4: a 1 MiB first bucket would hold all
        dist._DEFAULT_FIRST_BUCKET_BYTES = bucket_limits(CAP_MB_06, True)[0]
    try:
        theirs = TorchDDP(many_layers(), bucket_cap_mb=CAP_MB_06)
        ours = miniddp.DistributedDataParallel(many_layers(), bucket_cap_mb=CAP_MB_06)
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = saved_first
    n = len(list(mine.parameters()))
    reducer = Reducer(mine, [list(range(n))])  # step 0: one bucket, as torch
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
                  for m in (mine, theirs, ours)]
    x_all, y_all = make_dataset(n=16 * steps, seed=rank).tensors
    report = {"mismatch": None, "sync": [], "order": [], "late": [], "early_wait": [],
              "no_finish": [], "not_reset": []}
    for s in range(steps):
        x, y = x_all[16 * s:16 * (s + 1)], y_all[16 * s:16 * (s + 1)]
        losses = [F.mse_loss(m(x), y) for m in (mine, theirs, ours)]
        if s == 1:  # torch and miniddp rebuilt their buckets in this forward: take theirs
            reducer.set_buckets([b.param_indices for b in ours.buckets])
        for optimizer in optimizers:
            optimizer.zero_grad()
        reducer.timeline = []
        spy = AllReduceSpy(reducer)
        dist.all_reduce = spy
        try:
            losses[0].backward()
        except Exception as error:
            if any(not async_op for async_op, _, _ in spy.calls):
                raise RuntimeError(f"{type(error).__name__}: {error} (and all_reduce ran "
                                   "without async_op=True, so it returned no work to wait "
                                   "for)") from error
            raise
        finally:
            dist.all_reduce = spy.original
        if "backward_end" not in [event for event, _, _ in reducer.timeline]:
            report["no_finish"].append(s)
        elif reducer.in_flight or reducer.missing != [len(m) for m in reducer.buckets]:
            report["not_reset"].append((s, len(reducer.in_flight), list(reducer.missing)))
        for loss in losses[1:]:
            loss.backward()
        if report["mismatch"] is None and not torch.equal(flat_grads(mine), flat_grads(theirs)):
            diff = (flat_grads(mine) - flat_grads(theirs)).abs().max().item()
            report["mismatch"] = f"step {s}, rank {rank}: largest difference {diff:.3g}"
        report["sync"] += [ptr for async_op, ptr, _ in spy.calls if not async_op]
        if [ptr for _, ptr, _ in spy.calls] != [f.data_ptr() for f in reducer.flat]:
            report["order"].append(s)
        if s > 0 and (not spy.calls or spy.calls[0][2] >= n):
            report["late"].append(s)
        report["early_wait"] += [k for k in spy.waits if k < n]
        for optimizer in optimizers:
            optimizer.step()
    return report


def grade_06(steps: int = 3):
    by_world = {world: on_ranks(world, reducer_task, steps) for world in (2, 3)}
    reports = [r for results in by_world.values() for r in results]
    not_reset = min((r["not_reset"][0] for r in reports if r["not_reset"]), default=None)
    first_unreset = not_reset[0] if not_reset else steps  # what follows it is its consequence
    no_finish = sorted({s for r in reports for s in r["no_finish"] if s < first_unreset})
    yield (not no_finish, "_finish runs at the end of every backward",
           f"at steps {no_finish} no 'backward_end' was recorded. _finish never ran: no "
           "bucket was waited for or copied back. Queue it on the autograd engine with "
           "torch.autograd.Variable._execution_engine.queue_callback once the last bucket "
           "is launched")
    if no_finish:
        return
    yield (not_reset is None, "every backward starts from a reset state (no work in flight, "
           "every bucket missing all its gradients)",
           "" if not_reset is None else f"after the backward of step {not_reset[0]}, in_flight "
           f"held {not_reset[1]} works and missing was {not_reset[2]}: reset the state at the "
           "end of _finish, or the next backward launches nothing")
    if not_reset is not None:
        return
    mismatch = {}
    for world, results in by_world.items():
        mismatch[world] = next((r["mismatch"] for r in results if r["mismatch"]), None)
        why = f"{mismatch[world]}. Each gradient times the reciprocal of world_size into its " \
              "view, and every bucket's average copied back into .grad in _finish"
        if world == 3 and mismatch[3] and not mismatch[2]:
            why = f"{mismatch[3]}. 2 ranks matched, so this points at the scaling arithmetic: " \
                  "x / 2 and x * (1 / 2) are the same bits, x / 3 and x * (1 / 3) are not. " \
                  "Multiply by the reciprocal 1.0 / world_size, as torch does (lesson 03)"
        yield (mismatch[world] is None, f"{world} ranks: .grad equals torch's DDP's bit for bit "
               "after every backward (one bucket, then torch's rebuilt buckets)", why)
    r = by_world[3][0]
    yield (not r["sync"], "every all_reduce is asynchronous (async_op=True)",
           f"{len(r['sync'])} all_reduce calls ran synchronously: backward stopped for each")
    yield (not r["early_wait"], "no all_reduce is waited for before backward has computed every "
           "gradient", "a .wait() ran while gradients were still to come: wait only in _finish")
    yield (not r["late"], "with several buckets, the first all_reduce starts while gradients "
           "are still arriving", f"at steps {r['late']} nothing was launched before the last "
           "gradient: launch a bucket as soon as it is complete")
    yield (not r["order"], "buckets are launched in order, each once",
           f"at steps {r['order']} the all_reduces did not follow self.flat's order")
