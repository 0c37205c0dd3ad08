"""The checks behind lessons/grade.py: each exercise's code runs on forked gloo ranks next to torch.

Each ``grade_NN`` is a generator of ``(passed, what is checked, why it failed)``. Tasks run on
``RankGroup``s kept between exercises; a rank that still raises ``NotImplementedError`` ends the
exercise with ``NotWritten`` and its instruction.
"""

import os
import sys
import sysconfig
import time
import traceback
from collections import Counter

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402

from course.data import IN_FEATURES, OUT_FEATURES, make_dataset, make_model  # noqa: E402
from course.grader.timeline import Recorder  # noqa: E402
from miniddp.launch import RankGroup  # noqa: E402

TIMEOUT = 60
PG_TIMEOUT_S = 20  # how long a collective waits for the other ranks before gloo gives up


class NotWritten(Exception):
    """The exercise still raises NotImplementedError; the message says what to write."""


class OutOfStep(Exception):
    """The ranks were about to make different collective calls; the message names them."""


class GraderError(Exception):
    """The grader's own code raised, with none of the learner's code running: a fault of the
    grader, not a verdict. The message is the original traceback."""


#: Words of a collective that failed because another rank did (it stopped, or never came): the
#: cause is that rank's, even when this rank was inside the grader's code
PEER_FAILURE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
                "Timed out waiting", "timed out", "Application timeout caused pair closure",
                "Socket Timeout")


def learner_files(aliases: dict[str, str]) -> set[str]:
    """The files of the learner's loaded exercises (their frames are the learner's code)."""
    return {os.path.realpath(sys.modules[loaded].__file__) for loaded in aliases.values()
            if getattr(sys.modules.get(loaded), "__file__", None)}


#: Where torch and Python live: an error raised in there, from the grader's code, may come of
#: what the learner's code left (a gradient of the wrong shape), so it is not called the grader's
LIBRARIES = tuple(os.path.realpath(path) + os.sep for path in (
    os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"],
    sysconfig.get_paths()["purelib"]))


def graders_own(error: BaseException, learners: set[str]) -> bool:
    """Whether ``error`` is a fault of the grader's own lines: raised there (not in torch's or
    Python's code, and not a RuntimeError, which torch's operations raise on what they are
    handed, the learner's doing as likely as not), with none of the learner's code on the
    stack, and not by a collective that another rank left hanging or broke."""
    frames = traceback.extract_tb(error.__traceback__)
    files = [os.path.realpath(frame.filename) for frame in frames]
    if not files or any(file in learners for file in files):
        return False
    if files[-1].startswith(LIBRARIES) or isinstance(error, RuntimeError):
        return False
    return not any(word in str(error) for word in PEER_FAILURE)


#: Which loaded module each rank must find as ``exercise_NN`` (grade.py grades several files of
#: one exercise on the same ranks: all are loaded before the ranks fork, and this picks one)
ALIASES: dict[str, str] = {}


def _guarded(aliases, task, *args):
    for name, loaded in aliases.items():
        sys.modules[name] = sys.modules[loaded]
    try:
        return "ok", task(*args)
    except NotImplementedError as error:
        return "todo", str(error)
    except OutOfStep as error:
        return "out of step", str(error)
    except Exception as error:
        if not graders_own(error, learner_files(aliases)):
            raise
        raise GraderError(traceback.format_exc()) from None


_groups: dict[int, RankGroup] = {}  # kept between exercises while they run cleanly


def on_ranks(world_size: int, task, *args) -> list:
    """Run ``task(*args)`` on ``world_size`` gloo ranks; results in rank order."""
    group = _groups.get(world_size)
    if group is None or not group.alive:
        group = _groups[world_size] = RankGroup(world_size, pg_timeout=PG_TIMEOUT_S)
    # (the group closes itself if the run fails)
    results = group.run(_guarded, dict(ALIASES), task, *args, timeout=TIMEOUT)
    for status, value in results:
        if status in ("todo", "out of step"):
            group.close(kill=True)  # stopped midway: its state is unknown
            raise (NotWritten if status == "todo" else OutOfStep)(value)
    return [value for _, value in results]


def close_groups() -> None:
    for group in _groups.values():
        group.close()


def flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def everyone(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def many_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN_FEATURES, 32), *[nn.Linear(32, 32) for _ in range(5)],
                         nn.Linear(32, OUT_FEATURES))


# ----- the learner's collectives, compared across the ranks before each call -----

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
               "all_to_all_single", "barrier")


def _numel(args) -> int:
    """The elements a collective's first argument holds (a tensor, or a list of them)."""
    first = args[0] if args else None
    if isinstance(first, torch.Tensor):
        return first.numel()
    if isinstance(first, (list, tuple)):
        return sum(t.numel() for t in first if isinstance(t, torch.Tensor))
    return 0


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


class SameCalls:
    """While open, each collective of torch.distributed that the learner's code calls is first
    compared across the ranks: one small all_gather of what every rank is about to call.

    A collective that one rank makes and another skips pairs with whatever the other calls
    next, or waits for nothing until gloo's timeout (20 s here) ends it with a message about a
    recv. Compared before the call, the ranks fail at once, all with the same words: which rank
    called what, and which did not. ``finish()``, once the learner's function has returned on
    every rank, is compared like a call: a rank still calling then meets the others' end.
    ``stand_ins`` replace some collectives inside the comparison (a spy for all_reduce)."""

    END, RAISED = -1, -2

    def __init__(self, function: str, stand_ins: dict | None = None):
        self.function, self.stand_ins = function, stand_ins or {}
        self.gather = dist.all_gather  # the real one: the comparison's own collective
        self.counts: Counter = Counter()
        self.saved: dict = {}

    def __enter__(self):
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self.saved[name] = getattr(dist, name)
                setattr(dist, name, self._compared(name, self.stand_ins.get(name,
                                                                            self.saved[name])))
        return self

    def __exit__(self, kind, error, traceback):
        for name, original in self.saved.items():
            setattr(dist, name, original)
        if kind is not None and issubclass(kind, Exception) and not issubclass(kind, OutOfStep):
            try:  # the learner's own error is the news: only tell the others this rank stopped
                self._agree(self.RAISED, 0)
            except OutOfStep:
                pass
        return False

    def finish(self) -> None:
        """Compare "my function has returned" across the ranks, like a call."""
        self._agree(self.END, 0)

    def _compared(self, name: str, inner):
        def call(*args, **kwargs):
            self._agree(COLLECTIVES.index(name), _numel(args))
            self.counts[name] += 1
            return inner(*args, **kwargs)
        return call

    def _agree(self, code: int, numel: int) -> None:
        row = torch.tensor([code, numel])
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
        self.gather(rows, row)
        rows = [tuple(r.tolist()) for r in rows]
        if len(set(rows)) > 1:
            raise OutOfStep(self.describe(rows))

    def describe(self, rows: list[tuple[int, int]]) -> str:
        """The same words on every rank: they are made from the rows all ranks gathered."""
        groups: dict[tuple[int, int], list[int]] = {}
        for rank, row in enumerate(rows):
            groups.setdefault(row, []).append(rank)
        said, calling, stopped = [], set(), []
        for (code, numel), ranks in groups.items():
            who = ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(map(str, ranks))
            if code < 0:
                stopped.append(who)
                said.append(f"{who}'s {self.function} had "
                            f"{'returned' if code == self.END else 'raised an error'}")
                continue
            name = COLLECTIVES[code]
            calling.add(name)
            said.append(f"{who} called {name} for the {_ordinal(self.counts[name] + 1)} time "
                        f"({numel} elements)")
        if stopped and len(calling) == 1:
            name = calling.pop()
            before = self.counts[name]
            verdict = (f"{' and '.join(stopped)} never called this {name} (having called it "
                       f"{before} time{'' if before == 1 else 's'} before)")
        elif not calling:
            verdict = "the ranks ended differently"
        elif len(calling) > 1 or stopped:
            verdict = "the ranks called different collectives at the same point"
        else:
            verdict = ("the ranks called it on tensors of different sizes: it would pair up "
                       "different tensors")
        return ("; ".join(said) + f": {verdict}. Every rank must make the same collective calls "
                "in the same order (a collective under `if rank == ...` leaves the other ranks "
                "waiting for it)")



#: torch.distributed's all-gathers and reduce-scatters, under every name a release gives them
GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base")
REDUCE_SCATTERS = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                   "_reduce_scatter_base")
EVERY_COLLECTIVE = tuple(dict.fromkeys(COLLECTIVES + GATHERS + REDUCE_SCATTERS))


def kind_of(name: str) -> str:
    """A collective's kind, as a verdict says it: "gathers", "reduce-scatters", or its name."""
    return "gathers" if name in GATHERS else "reduce-scatters" if name in REDUCE_SCATTERS else name


class EveryCollective(Recorder):
    """While open, every collective of torch.distributed made by the learner's ``module`` is
    first told to ``seen(name)``, whoever wrote the call: called as ``dist.NAME``, or through a
    name the module bound to one (``all_gather = dist.all_gather_into_tensor``, as the given
    methods do). Counting only a given method would miss the learner's own calls."""

    def __init__(self, module, told):
        super().__init__(EVERY_COLLECTIVE, module)
        self.told = told

    def seen(self, name: str, args, kwargs) -> None:
        self.told(name)


def shown(mine: float, torchs: float) -> str:
    """Two values that differ, written so that they visibly differ: Python's shortest repr
    that reads back as the same number (a float32's 0.0112974 alone could be either)."""
    return f"yours {float(mine)!r}, torch's {float(torchs)!r}"


# ----- 03: all_reduce averaging by hand -----

LATE_S = 0.1  # every rank but 0 makes each of the learner's all_reduces this late


class Waited:
    """A work (or its future) handed to the learner: notes when it is waited for."""

    def __init__(self, inner, record: dict, on_wait=None):
        self.inner, self.record, self.on_wait = inner, record, on_wait

    def _mark(self):
        if not self.record["waited"] and self.on_wait is not None:
            self.on_wait()
        self.record["waited"] = True

    def wait(self, *args, **kwargs):
        self._mark()
        return self.inner.wait(*args, **kwargs)

    def value(self, *args, **kwargs):
        self._mark()
        return self.inner.value(*args, **kwargs)

    def get_future(self):
        return Waited(self.inner.get_future(), self.record, self.on_wait)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class WatchedAllReduce:
    """Stands in for dist.all_reduce during the learner's function: keeps every asynchronous
    work's record (waited for or not), and on ranks other than 0 makes every call late, so
    that rank 0 cannot find an all_reduce it left in flight finished by chance."""

    def __init__(self, delay: float = 0.0):
        self.original, self.delay, self.works = dist.all_reduce, delay, []

    def __call__(self, tensor, *args, async_op=False, **kwargs):
        time.sleep(self.delay)
        work = self.original(tensor, *args, async_op=async_op, **kwargs)
        if not async_op:
            return work
        self.works.append({"waited": False})
        return Waited(work, self.works[-1])

    def unwaited(self) -> int:
        return sum(not w["waited"] for w in self.works)


def what_grad_holds(ours, mean, local, world) -> str:
    """What a wrong result is, said from what it equals: the sum, the rank's own gradient, ..."""
    close = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-8)  # noqa: E731
    for candidate, said in ((mean * world, "the SUM over the ranks: it was never scaled by "
                             "1 / world_size"),
                            (mean / world, "the mean divided by world_size once more: it was "
                             "scaled twice"),
                            (local, "this rank's own gradient, unreduced: the all_reduce did not "
                             "write into p.grad (a copy reduced, or no all_reduce)"),
                            (local / world, "this rank's own gradient scaled, never summed: the "
                             "all_reduce did not write into p.grad")):
        if close(ours, candidate):
            return f"it equals {said}"
    scale = (ours @ mean / (mean @ mean)).item() if mean.any() else 0.0
    if scale and close(ours, mean * scale):
        return (f"it equals the mean times {scale:.4g}: the sum over the ranks scaled by "
                f"{scale / world:.4g}, where 1 / world_size is {1 / world:.4g} (take the world "
                "size from dist.get_world_size(), not a number written in)")
    return "it is none of the mean, the sum or this rank's own gradient"


def difference(diff: float, scale: float, what: str) -> str:
    """Name rounding only when the difference is rounding-sized; else say what it is."""
    if diff <= 1e-6 * scale:
        return (f"a rounding-sized difference ({diff:.3g}, gradients up to {scale:.3g}): the "
                "right mean computed with other arithmetic")
    return (f"a large difference ({diff:.3g}, {diff / scale:.1%} of the largest gradient "
            f"{scale:.3g}): not rounding, .grad does not hold the mean; {what}")


def _then(first, second):
    def both(grad, world):
        return second(first(grad, world), world)
    return both


def _times_reciprocal(grad, world):
    return grad.mul_(1.0 / world)


def _divided(grad, world):
    return grad.div_(world)


def _summed(grad, world):
    dist.all_reduce(grad)
    return grad


#: How the gradients can be laid out for the all_reduce: a ring sums an element in an order that
#: depends on its offset, so at 3 ranks each layout gives other bits, all of them right
LAYOUTS = ("one all_reduce per parameter", "one flat buffer, in model order",
           "one flat buffer, last parameter first (DDP's bucket order)")


# How a mean over the ranks can be computed, in place on one gradient: torch's ("reference")
# first, then the ways that give the mean's value with other bits at 3 ranks
ARITHMETIC = {"reference": _then(_times_reciprocal, _summed),
              "divide before": _then(_divided, _summed),
              "divide after": _then(_summed, _divided),
              "multiply after": _then(_summed, _times_reciprocal)}
WHERE_08 = "lesson 08 shows why, in 'Why 3 ranks are the harder test'"
ARITHMETIC_SAID = {
    "divide before": "You divided each gradient by world_size before the all_reduce: x / 3 and "
                     "x * (1 / 3) round differently (1 / 3 is itself rounded). Multiply by the "
                     f"reciprocal 1.0 / world_size instead, before the all_reduce ({WHERE_08})",
    "divide after": "You divided the sum by world_size after the all_reduce (or used "
                    "ReduceOp.AVG, which does just that on gloo), which rounds this way at 3 "
                    "ranks (at 2 ranks both are exact): multiply by the reciprocal BEFORE the "
                    f"all_reduce, and all_reduce with the default op, SUM ({WHERE_08})",
    "multiply after": "You multiplied the sum by 1 / world_size after the all_reduce: the sum "
                      "of three scaled gradients rounds differently from the scaled sum. "
                      f"Multiply by the reciprocal BEFORE the all_reduce ({WHERE_08})",
    None: "its bits are neither torch's scale-then-sum nor the usual other orders (divided "
          "before, divided after, multiplied after), in any of the layouts tried: "
          f"{', '.join(LAYOUTS)}. A ring sums each element in an order that depends on where it "
          "sits in the buffer, so at 3 ranks a buffer laid out otherwise (buckets, a subset) "
          "gives other bits: multiply each gradient by 1.0 / world_size, then all_reduce per "
          f"parameter or all of them in one flat buffer ({WHERE_08})",
}


def in_layout(grads: list[torch.Tensor], world: int, scaled, layout: str) -> torch.Tensor:
    """The gradients averaged by ``scaled`` in ``layout``, flattened in model order."""
    if layout == LAYOUTS[0]:
        return torch.cat([scaled(g.clone(), world).reshape(-1) for g in grads])
    order = list(range(len(grads)))[::-1 if layout == LAYOUTS[2] else 1]
    flat = scaled(torch.cat([grads[i].reshape(-1) for i in order]), world)
    pieces = dict(zip(order, flat.split([grads[i].numel() for i in order])))
    return torch.cat([pieces[i] for i in range(len(grads))])


def average_task():
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = make_dataset(n=32, seed=rank).tensors
    theirs, mine = TorchDDP(make_model(seed=0)), make_model(seed=0)
    for model in (theirs, mine):
        F.mse_loss(model(x), y).backward()
    local = flat_grads(mine).clone()
    reference = [p.grad.clone() for p in mine.parameters()]
    # The others make each all_reduce late, so one that rank 0 left in flight cannot have
    # finished when its function returns: what rank 0 reads then is what the learner handed back.
    watched = WatchedAllReduce(LATE_S if rank > 0 else 0.0)
    same = SameCalls("average_gradients", {"all_reduce": watched})
    with same:
        sys.modules["exercise_03"].average_gradients(mine)
    at_return = flat_grads(mine).clone()
    same.finish()  # after the snapshot: comparing waits for the others' last all_reduce
    # torch's arithmetic, then the usual wrong orders, in each layout, after the learner's
    # collectives (they are done when it is): the same ring on the same layout, the same bits
    arithmetic = {(name, layout): in_layout(reference, world, scaled, layout)
                  for layout in LAYOUTS for name, scaled in ARITHMETIC.items()}
    ours, torchs = flat_grads(mine), flat_grads(theirs)
    expected = arithmetic[("reference", LAYOUTS[0])]
    right = [bits for (name, _), bits in arithmetic.items() if name == "reference"]
    return {"equal": torch.equal(ours, torchs), "diff": (ours - torchs).abs().max().item(),
            "complete_at_return": torch.equal(at_return, ours),
            "unwaited": (watched.unwaited(), len(watched.works)),
            "as_reference": any(torch.equal(ours, bits) for bits in right),
            "reference_diff": (ours - expected).abs().max().item(),
            "scale": expected.abs().max().item(),
            "holds": what_grad_holds(ours, expected, local, world),
            "arithmetic": next((name for (name, _), bits in arithmetic.items()
                                if name != "reference" and torch.equal(ours, bits)), None),
            "same_everywhere": all(torch.equal(g, ours) for g in everyone(ours))}


def grade_03():
    for world in (2, 3):
        results = on_ranks(world, average_task)
        late = [r for r, result in enumerate(results) if not result["complete_at_return"]]
        unwaited = next(((r, *result["unwaited"]) for r, result in enumerate(results)
                         if result["unwaited"][0]), None)
        seen = ([f"on rank {late[0]}, .grad changed after average_gradients had returned"]
                if late else [])
        if unwaited:
            seen.append(f"on rank {unwaited[0]}, {unwaited[1]} of the {unwaited[2]} works that "
                        "all_reduce(async_op=True) returned were never waited for")
        yield (not seen, f"{world} ranks: .grad holds its final value when average_gradients "
               "returns", "; ".join(seen) + ": an all_reduce was still in flight, or could be. "
               "Wait for every asynchronous all_reduce (work.wait()) before returning, or use "
               "a blocking one")
        if seen:
            return
        diff = max(r["diff"] for r in results)
        worst = max(results, key=lambda r: r["reference_diff"])
        if world == 2:
            yield (all(r["equal"] for r in results), "2 ranks: every .grad equals torch's DDP's "
                   "bit for bit", "expected torch's bits; " + difference(
                       diff, worst["scale"], worst["holds"]) + ". Every gradient must be "
                   "scaled by 1 / world_size and summed over the ranks, into p.grad")
            continue
        yield (all(r["same_everywhere"] for r in results), "3 ranks: every rank holds the "
               "same bits", f"the ranks hold different gradients (on rank {results.index(worst)}"
               f", {worst['holds']}): every rank must all_reduce every gradient, into p.grad")
        off = worst["reference_diff"]
        rounding = off <= 1e-6 * worst["scale"]
        yield (all(r["as_reference"] for r in results), "3 ranks: bit for bit the gradients "
               "of torch's arithmetic (each gradient times 1 / 3, then summed; per parameter or "
               "in one flat buffer)",
               difference(off, worst["scale"], worst["holds"]) + (
                   ". " + ARITHMETIC_SAID[worst["arithmetic"]] if rounding else ""))
        yield (diff < 1e-6, "3 ranks: within 1e-6 of torch's DDP (not bit for bit: torch "
               "sums whole buckets, and a ring's order depends on an element's offset)",
               f"largest difference {diff:.3g}")
