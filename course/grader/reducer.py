"""The checks behind lessons/grade.py for exercise 06, the reducer.

Root causes first: whether ``_finish`` ran after every backward, and whether it left the state
reset for the next one. Only then the bits against torch's DDP, and what a spy standing in for
``dist.all_reduce`` saw of how the collectives were launched and waited for. Each all_reduce
the learner's reducer launches is first compared across the ranks (``SameCalls``), so a rank
that skips one is named at once instead of timing out.
"""

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from course.data import make_dataset
from course.grader.checks import (
    OutOfStep,
    SameCalls,
    Waited,
    flat_grads,
    many_layers,
    on_ranks,
    what_grad_holds,
)
from miniddp.buckets import bucket_limits
from miniddp.torch_versions import EXPLICIT_CAP_COVERS_FIRST_BUCKET

CAP_MB_06 = 0.02


class Delivered(Waited):
    """An asynchronous all_reduce's work whose result reaches the learner's buffer when it is
    waited for (``deliver``), not before."""

    def __init__(self, inner, record: dict, on_wait, deliver):
        super().__init__(inner, record, on_wait)
        self.deliver = deliver

    def wait(self, *args, **kwargs):
        done = super().wait(*args, **kwargs)
        self.deliver()
        return done

    def value(self, *args, **kwargs):
        done = super().value(*args, **kwargs)
        self.deliver()
        return done

    def get_future(self):
        return Delivered(self.inner.get_future(), self.record, self.on_wait, self.deliver)


class AllReduceSpy:
    """Stands in for dist.all_reduce during the learner's backward; records how it is used:
    each call (async or not, which buffer, how many gradients were ready), and for each
    asynchronous one whether its work was waited for (``wait()``, or its future's).

    An asynchronous all_reduce reduces a private copy of the buffer, written into the buffer
    when its work is waited for: a bucket read before its ``wait()`` then holds what it held at
    launch every time, not only when gloo happens to be slow. ``sent`` and ``result`` keep both,
    to tell such a read from the gradients afterwards."""

    def __init__(self, reducer):
        self.reducer, self.calls, self.waits, self.works = reducer, [], [], []
        self.original = dist.all_reduce
        self.incomplete: list[tuple[int, list[int]]] = []  # launched before all were ready

    def _note_incomplete(self, tensor) -> None:
        flats = [f.data_ptr() for f in self.reducer.flat]
        if tensor.data_ptr() in flats:
            b = flats.index(tensor.data_ptr())
            ready = {i for event, i, _ in self.reducer.timeline if event == "ready"}
            missing = [i for i in self.reducer.buckets[b] if i not in ready]
            if missing:
                self.incomplete.append((b, missing))

    def ready_so_far(self) -> int:
        return sum(event == "ready" for event, _, _ in self.reducer.timeline)

    def __call__(self, tensor, *args, async_op=False, **kwargs):
        self._note_incomplete(tensor)
        if not async_op:
            work = self.original(tensor, *args, **kwargs)
            self.calls.append((False, tensor.data_ptr(), self.ready_so_far()))
            return work
        private = tensor.detach().clone()
        work = self.original(private, *args, async_op=True, **kwargs)
        self.calls.append((True, tensor.data_ptr(), self.ready_so_far()))
        record = {"waited": False, "delivered": False, "ptr": tensor.data_ptr(),
                  "sent": private.clone(), "result": private}
        self.works.append(record)

        def deliver():
            if not record["delivered"]:
                record["delivered"] = True
                with torch.no_grad():
                    tensor.copy_(private)

        return Delivered(work, record, lambda: self.waits.append(self.ready_so_far()), deliver)

    def read_early(self, reducer) -> list[int]:
        """The buckets whose gradients hold what was launched, not its all_reduce's result:
        copied into .grad before their work was waited for."""
        flats, early = [f.data_ptr() for f in reducer.flat], []
        for record in self.works:
            if not record["waited"] or record["ptr"] not in flats:
                continue  # never waited for: another check says so
            b = flats.index(record["ptr"])
            offset = 0
            for i in reducer.buckets[b]:
                grad, n = reducer.params[i].grad, reducer.params[i].numel()
                sent, result = (record[key][offset:offset + n] for key in ("sent", "result"))
                offset += n
                if (grad is not None and torch.equal(grad.reshape(-1), sent)
                        and not torch.equal(sent, result)):
                    early.append(b)
                    break
        return early

    def unwaited(self) -> int:
        return sum(not record["waited"] for record in self.works)


def watch_finish(reducer, report: dict, step: int) -> None:
    """Wrap this reducer's ``_finish``: note a call made from inside the hook (``_on_ready`` on
    the stack) rather than by the autograd engine once backward is over."""
    finish, hook = reducer._finish, type(reducer)._on_ready.__code__
    report["finish_calls"][step] = 0

    def watched(*args, **kwargs):
        report["finish_calls"][step] += 1
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code is hook:
                report["finish_in_hook"].append(step)
                break
            frame = frame.f_back
        return finish(*args, **kwargs)

    reducer._finish = watched


def swapped(layout: list[list[int]]) -> list[list[int]]:
    """The first two buckets swapped: bucket 1 now holds the gradients that come first."""
    return [layout[1], layout[0], *layout[2:]] if len(layout) > 1 else layout


def reversed_layout(layout: list[list[int]]) -> list[list[int]]:
    """Every bucket's gradients arrive after the next one's: the last bucket completes first."""
    return list(reversed(layout))


def averaged_by_buckets(model, layout, world) -> torch.Tensor:
    """The gradients ``model`` would get from one all_reduce of ``grad * (1 / world)`` per
    bucket of ``layout``, in order: what the learner's reducer must give with that layout."""
    params, out = list(model.parameters()), {}
    for members in layout:
        flat = torch.cat([params[i].grad.reshape(-1) for i in members]) * (1.0 / world)
        dist.all_reduce(flat)
        offset = 0
        for i in members:
            out[i] = flat[offset:offset + params[i].numel()]
            offset += params[i].numel()
    return torch.cat([out[i] for i in range(len(params))])


# Steps after the ones compared with torch: layouts whose buckets complete out of launch order
OUT_OF_ORDER = {"the first two buckets swapped": swapped, "the buckets reversed": reversed_layout}


def reducer_task(steps: int = 3):
    Reducer = sys.modules["exercise_06"].Reducer
    rank, world = dist.get_rank(), dist.get_world_size()
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
    extra = list(OUT_OF_ORDER)
    x_all, y_all = make_dataset(n=16 * (steps + len(extra)), seed=rank).tensors
    report = {"mismatch": None, "sync": [], "order": [], "late": [], "early_wait": [],
              "no_finish": [], "not_reset": [], "unwaited": [], "finish_in_hook": [],
              "layouts": {}, "steps": steps, "finish_calls": {}, "read_early": [],
              "unlaunched": {}, "incomplete": None, "holds": None}
    for s in range(steps + len(extra)):
        torch_step = s < steps  # then: out-of-order layouts, checked against the grader's sums
        x, y = x_all[16 * s:16 * (s + 1)], y_all[16 * s:16 * (s + 1)]
        models = (mine, theirs, ours) if torch_step else (mine,)
        losses = [F.mse_loss(m(x), y) for m in models]
        if s == 1:  # torch and miniddp rebuilt their buckets in this forward: take theirs
            reducer.set_buckets([b.param_indices for b in ours.buckets])
        if not torch_step:
            layout = OUT_OF_ORDER[extra[s - steps]]([b.param_indices for b in ours.buckets])
            reducer.set_buckets(layout)
            report["layouts"][s] = extra[s - steps]
            plain = copy.deepcopy(mine)
            F.mse_loss(plain(x), y).backward()
            expected = averaged_by_buckets(plain, layout, world)
        for optimizer in optimizers:
            optimizer.zero_grad()
        reducer.timeline = []
        watch_finish(reducer, report, s)
        spy = AllReduceSpy(reducer)
        same = SameCalls(f"backward of step {s}", {"all_reduce": spy})
        try:
            with same:
                losses[0].backward()
        except OutOfStep:
            raise
        except Exception as error:
            if any(not async_op for async_op, _, _ in spy.calls):
                raise RuntimeError(f"{type(error).__name__}: {error} (and all_reduce ran "
                                   "without async_op=True, so it returned no work to wait "
                                   "for)") from error
            raise
        finally:
            reducer.__dict__.pop("_finish", None)
        same.finish()  # a rank that launched more all_reduces than the others is named here
        if spy.incomplete and report["incomplete"] is None:
            report["incomplete"] = (s, *spy.incomplete[0])
        if spy.unwaited():
            report["unwaited"].append((s, spy.unwaited(), len(spy.works)))
        if spy.read_early(reducer):
            report["read_early"].append((s, spy.read_early(reducer)))
        if "backward_end" not in [event for event, _, _ in reducer.timeline]:
            report["no_finish"].append(s)
        elif reducer.in_flight or reducer.missing != [len(m) for m in reducer.buckets]:
            report["not_reset"].append((s, len(reducer.in_flight), list(reducer.missing)))
        for loss in losses[1:]:
            loss.backward()
        if report["mismatch"] is None:
            if torch_step and not torch.equal(flat_grads(mine), flat_grads(theirs)):
                diff = (flat_grads(mine) - flat_grads(theirs)).abs().max().item()
                report["mismatch"] = f"step {s}, rank {rank}: largest difference {diff:.3g}"
                got, mean = flat_grads(mine), flat_grads(theirs)
                holds = what_grad_holds(got, mean, got * torch.nan, world)
                report["holds"] = holds if holds.startswith("it equals") else None
            elif not torch_step and not torch.equal(flat_grads(mine), expected):
                diff = (flat_grads(mine) - expected).abs().max().item()
                report["mismatch"] = (f"step {s} (buckets set to {extra[s - steps]}), rank "
                                      f"{rank}: largest difference {diff:.3g} from one "
                                      "all_reduce per bucket")
        report["sync"] += [ptr for async_op, ptr, _ in spy.calls if not async_op]
        flats = [f.data_ptr() for f in reducer.flat]
        launched = [flats.index(ptr) if ptr in flats else -1 for _, ptr, _ in spy.calls]
        if launched != list(range(len(flats))):
            report["order"].append((s, launched))
        never = sorted(set(range(len(flats))) - set(launched))
        if never:  # with the gradients each bucket still missed at the end of backward
            report["unlaunched"][s] = (never, list(reducer.missing))
        if torch_step and s > 0 and (not spy.calls or spy.calls[0][2] >= n):
            report["late"].append(s)
        report["early_wait"] += [k for k in spy.waits if k < n]
        for optimizer in optimizers[:len(models)]:
            optimizer.step()
    return report


def why_no_finish(reports: list[dict], first: list[int]) -> str:
    """Why the first backward without _finish (``first``: its step, or nothing) had none: its
    buckets were all launched (then _finish was never queued), or some never were. Later
    backwards start from the state it left, so they say nothing more."""
    unlaunched = next(((s, r["layouts"].get(s), *r["unlaunched"][s]) for r in reports
                       for s in first if s in r["unlaunched"]), None)
    if unlaunched is None:
        return ("_finish never ran: no bucket was waited for or copied back. Queue it on the "
                "autograd engine with torch.autograd.Variable._execution_engine.queue_callback "
                "once the last bucket is launched")
    step, layout, never, missing = unlaunched
    at = f"At step {step}" + (f" (buckets set to {layout})" if layout else "")
    if 0 not in never and not any(missing):  # every bucket complete, a later one not launched
        return (f"{at} buckets {never} were never launched, and _finish, queued at the last "
                "bucket's launch, never ran: a bucket that completes before the ones ahead of "
                "it must wait for them, and be launched with them. When a bucket completes, "
                "launch every complete bucket from the next unlaunched one on, in a loop, not "
                "just the one that completed")
    return (f"{at} buckets {never} were never launched (gradients each bucket still missed at "
            f"the end of backward: {missing}), and _finish, queued at the last bucket's launch, "
            "never ran: count each gradient into its bucket, and launch a bucket once it "
            "misses none")


def grade_06(steps: int = 3):
    by_world = {world: on_ranks(world, reducer_task, steps) for world in (2, 3)}
    reports = [r for results in by_world.values() for r in results]
    not_reset = min((r["not_reset"][0] for r in reports if r["not_reset"]), default=None)
    first_unreset = not_reset[0] if not_reset else 99  # what follows it is its consequence
    no_finish = sorted({s for r in reports for s in r["no_finish"] if s < first_unreset})
    yield (not no_finish, "_finish runs at the end of every backward",
           f"at steps {no_finish} no 'backward_end' was recorded. "
           + why_no_finish(reports, no_finish[:1]))
    if no_finish:
        return
    again = min(((s, n) for r in reports for s, n in r["finish_calls"].items()
                 if n > 1 and s < first_unreset), default=None)
    yield (again is None, "_finish runs exactly once per backward",
           "" if again is None else f"in the backward of step {again[0]}, _finish ran "
           f"{again[1]} times: queue it once per backward, when the last bucket is launched "
           "(each queue_callback adds one more run)")
    unwaited = min((r["unwaited"][0] for r in reports if r["unwaited"]), default=None)
    yield (unwaited is None, "every launched all_reduce is waited for before backward returns",
           "" if unwaited is None else f"at step {unwaited[0]}, {unwaited[1]} of the "
           f"{unwaited[2]} works that all_reduce(async_op=True) returned were never waited "
           "for: their result may not be in the bucket yet when it is copied into .grad. "
           "Call wait() on each, in bucket order, in _finish")
    in_hook = sorted({s for r in reports for s in r["finish_in_hook"]})
    yield (not in_hook, "_finish is run by the autograd engine once backward is over, not "
           "from a hook", f"at steps {in_hook} _finish was called from inside the hook "
           "(_on_ready), while backward was still running: the last hook is not the end of "
           "backward (other gradients, of inputs or of a later use, may still be computed). "
           "Queue it instead: torch.autograd.Variable._execution_engine.queue_callback")
    yield (not_reset is None, "every backward starts from a reset state (no work in flight, "
           "every bucket missing all its gradients)",
           "" if not_reset is None else f"after the backward of step {not_reset[0]}, in_flight "
           f"held {not_reset[1]} works and missing was {not_reset[2]}: reset the state at the "
           "end of _finish, or the next backward launches nothing")
    if not_reset is not None:
        return
    r = by_world[3][0]
    order = r["order"][0] if r["order"] else None
    yield (order is None, "buckets are launched in bucket order, each once, also when a later "
           "bucket is complete first", "" if order is None else
           f"at step {order[0]}" + (f" (buckets set to {r['layouts'][order[0]]})"
                                    if order[0] in r["layouts"] else "")
           + f" the all_reduces went to buckets {order[1]}"
           + (" (-1: not a bucket's buffer)" if order and -1 in order[1] else "")
           + ", expected 0, 1, 2, ... once each: a complete bucket waits for the ones before "
           "it, so that every rank issues the same collectives in the same order")
    incomplete = r["incomplete"]
    yield (incomplete is None, "every bucket is launched once all its gradients are in it",
           "" if incomplete is None else f"at step {incomplete[0]} bucket {incomplete[1]} was "
           f"launched while the gradients of parameters {incomplete[2]} were not yet in it: its "
           "all_reduce summed whatever its buffer held. Count each gradient in as it arrives "
           "and launch a bucket only when its count of missing gradients reaches 0")
    early = min((e for rep in reports for e in rep["read_early"]), default=None)
    yield (early is None, "every bucket is read after its all_reduce finished (its work waited "
           "for before its gradients are copied into .grad)",
           "" if early is None else f"at step {early[0]}, the .grad of bucket {early[1][0]} "
           "held what the bucket held at launch: you read the bucket before its all_reduce "
           "finished. In _finish, wait() for a bucket's work first, then copy its views into "
           ".grad")
    mismatch = {}
    for world, results in by_world.items():
        wrong = next((r for r in results if r["mismatch"]), None)
        mismatch[world] = wrong and wrong["mismatch"]
        why = f"{mismatch[world]}. Each gradient times the reciprocal of world_size into its " \
              "view, and every bucket's average copied back into .grad in _finish"
        if wrong and wrong["holds"]:
            why = f"{mismatch[world]}: .grad is not the mean; {wrong['holds']}"
        above = next((said for value, said in (
            (order, "buckets launched out of order"),
            (incomplete, "a bucket launched before its gradients were in it"),
            (early, "buckets read before their all_reduce finished"),
            (unwaited, "all_reduces never waited for")) if value is not None), None)
        if above:
            why = f"{mismatch[world]}: follows from the failure above ({above}): fix that first"
        elif world == 3 and mismatch[3] and not mismatch[2]:
            why = f"{mismatch[3]}. 2 ranks matched, so this points at the scaling arithmetic: " \
                  "x / 2 and x * (1 / 2) are the same bits, x / 3 and x * (1 / 3) are not. " \
                  "Multiply each gradient by the reciprocal 1.0 / world_size in the hook, " \
                  "before the all_reduce, as torch does: dividing, or scaling after the " \
                  "all_reduce, rounds otherwise at 3 ranks (lesson 08, 'Why 3 ranks are the " \
                  "harder test')"
        yield (mismatch[world] is None, f"{world} ranks: .grad equals torch's DDP's bit for bit "
               "after every backward (one bucket, then torch's rebuilt buckets; then buckets "
               "that complete out of order, against one all_reduce per bucket)", why)
    yield (not r["sync"], "every all_reduce is asynchronous (async_op=True)",
           f"{len(r['sync'])} all_reduce calls ran synchronously: backward stopped for each")
    yield (not r["early_wait"], "no all_reduce is waited for before backward has computed every "
           "gradient", "a .wait() ran while gradients were still to come: wait only in _finish")
    yield (not r["late"], "with several buckets, the first all_reduce starts while gradients "
           "are still arriving", f"at steps {r['late']} nothing was launched before the last "
           "gradient: launch a bucket as soon as it is complete")
