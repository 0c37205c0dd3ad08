"""The checks behind lessons/grade.py for exercise 07: one optimizer step from k micro-batches.

What is observed: on miniddp's DDP, which micro-batch's backward launched all_reduces (each
micro-batch is recognized by its input when the inner module runs, so a forward through
``ddp.module`` counts as that micro-batch too); on torch's DDP, the parameters after every
step. How a wrong result is attributed: the same start is stepped by a set of loops with one
plausible mistake each (``Loop``), and the mistake whose parameters the learner's match on
every step (bit for bit first, then to rounding) is named. k is 3: not a power of two, so that
gradients scaled by 1/k after the backwards round otherwise than each loss divided by k (at
k = 4 both are exact, and the mistake would pass); ``loss / k`` and ``loss * (1 / k)`` still
give the same bits, their backward starting from the same rounded 1/k. At 3 ranks k is the
world size, so a loss divided by the world size is told apart at 2 ranks.
"""

import sys
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from course.data import make_dataset, make_model
from course.grader.checks import on_ranks

K, STEPS, WORLDS = 3, 3, (2, 3)


@dataclass(frozen=True)
class Loop:
    """The reference loop, or the same with one mistake. ``divisor`` is what each micro-batch's
    loss is divided by, as a function of (k, world size); ``last_divisor`` the last one's."""

    divisor: str = "k"
    last_divisor: str | None = None
    zero_grad: str = "once before"  # or "before each", "never", "before the step"
    step_each: bool = False
    skip: str | None = None  # "first" or "last": a micro-batch the loop leaves out
    scale_after: str | None = None  # "div" or "mul": .grad scaled by 1/k before the step

    def factor(self, which: str, k: int, world: int) -> float:
        return {"k": k, "1": 1, "k * k": k * k, "world": world, "k * world": k * world}[which]

    def run(self, ddp, optimizer, micro_batches) -> None:
        k, world = len(micro_batches), dist.get_world_size()
        used = {"first": micro_batches[1:], "last": micro_batches[:-1]}.get(self.skip,
                                                                            micro_batches)
        if self.zero_grad == "once before":
            optimizer.zero_grad()
        for j, (x, y) in enumerate(used):
            if self.zero_grad == "before each":
                optimizer.zero_grad()
            last = j == len(used) - 1
            divisor = self.factor(self.last_divisor if last and self.last_divisor else
                                  self.divisor, k, world)
            with nullcontext() if last else ddp.no_sync():
                (F.mse_loss(ddp(x), y) / divisor).backward()
            if self.step_each and not last:
                optimizer.step()
        if self.zero_grad == "before the step":
            optimizer.zero_grad()
        for p in ddp.parameters() if self.scale_after else ():
            if self.scale_after == "div":
                p.grad.div_(k)
            else:
                p.grad.mul_(1 / k)
        optimizer.step()


REFERENCE = Loop()
#: Each mistake, and what to say of it
MISTAKES = {
    Loop(zero_grad="before each"):
        "optimizer.zero_grad() ran before every micro-batch, so the step used only the last "
        "micro-batch's gradient. Call it once, before the first, so that .grad accumulates "
        "over all k",
    Loop(zero_grad="never"):
        "optimizer.zero_grad() was never called: the first step was right, and every later "
        "one added the previous steps' gradients to its own. Call it once per step, before "
        "the first micro-batch",
    Loop(zero_grad="before the step"):
        "no parameter ever moved: the step never had a gradient to take, either because "
        "optimizer.zero_grad() ran after the backwards, just before optimizer.step(), and "
        "cleared it, or because optimizer.step() was never called. Clear the gradients before "
        "the first micro-batch and step after the last",
    Loop(step_each=True):
        "optimizer.step() ran after every micro-batch, the first k - 1 times on gradients no "
        "rank had averaged. Step once, after the last micro-batch",
    Loop(divisor="1"):
        "each step's update is k times the right one: the gradient is the SUM of the micro-"
        "batches' gradients, not their mean. Divide each micro-batch's loss by k before its "
        "backward",
    Loop(divisor="k * k"):
        "each step's update is 1 / k of the right one: the loss was divided by k twice (or by "
        "k * k). Divide each micro-batch's loss by k, once",
    Loop(divisor="world"):
        "each loss was divided by the world size, not by k, the number of micro-batches. "
        "DDP already averages over the ranks; the division by k averages over the micro-"
        "batches",
    Loop(divisor="k * world"):
        "each loss was divided by k and by the world size: DDP's all_reduce already averages "
        "over the ranks, so the update is 1 / world_size of the right one. Divide by k only",
    Loop(last_divisor="1"):
        "the last micro-batch's loss (the one outside no_sync) was not divided by k: every "
        "micro-batch's loss must be divided by k, in both branches",
    Loop(divisor="1", last_divisor="k"):
        "only the last micro-batch's loss was divided by k: every micro-batch's loss must be, "
        "the first k - 1 inside no_sync too",
    Loop(divisor="1", scale_after="div"):
        "the gradients were divided by k after the backwards: the mean's value, rounded "
        "otherwise than torch's loop, where each micro-batch's loss is divided by k and its "
        "backward scales every gradient as it is computed. Divide each loss by k before its "
        "backward",
    Loop(divisor="1", scale_after="mul"):
        "the gradients were multiplied by 1/k after the backwards: the mean's value, rounded "
        "otherwise than torch's loop, where each micro-batch's loss is divided by k and its "
        "backward scales every gradient as it is computed. Divide each loss by k before its "
        "backward",
    Loop(skip="first"):
        "the first micro-batch was left out (the loop ran over micro_batches[1:]): every one "
        "of the k micro-batches takes part, each loss divided by k",
}


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def which_micro_batch(x, micro_batches) -> int:
    """The index of the micro-batch whose input is ``x`` (-1 for none)."""
    for j, (candidate, _) in enumerate(micro_batches):
        if x is candidate or (x.shape == candidate.shape and torch.equal(x, candidate)):
            return j
    return -1


def launches_per_micro_batch(timeline, k: int) -> list[int]:
    """All_reduce launches after each micro-batch's forward, until the next one's forward."""
    counts, current = [0] * k, None
    for event, ident, _ in timeline:
        if event == "micro-batch":
            current = ident
        elif event == "launch" and current is not None and current >= 0:
            counts[current] += 1
    return counts


def micro_batches(rank: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each step's K micro-batches (inputs, targets) on this rank."""
    x_all, y_all = make_dataset(n=8 * K * STEPS, seed=rank).tensors
    return [list(zip(x.chunk(K), y.chunk(K)))
            for x, y in zip(x_all.chunk(STEPS), y_all.chunk(STEPS))]


#: The reference loop's and each mistake's parameters after every step, by world size: the
#: same for every file graded on these ranks, so trained once (every rank fills it in the
#: same call, so the all_reduces it takes stay matched)
_TRAJECTORIES: dict[int, dict[Loop, list[torch.Tensor]]] = {}


def loops_trajectories() -> dict[Loop, list[torch.Tensor]]:
    world = dist.get_world_size()
    if world not in _TRAJECTORIES:
        batches = micro_batches(dist.get_rank())
        runs = {loop: [] for loop in (REFERENCE, *MISTAKES)}
        for loop, seen in runs.items():
            model = TorchDDP(make_model(seed=0))
            optimizer = sgd(model)
            for current in batches:
                loop.run(model, optimizer, current)
                seen.append(flat(model))
        _TRAJECTORIES[world] = runs
    return dict(_TRAJECTORIES[world])


def no_sync_task():
    step = sys.modules["exercise_07"].accumulation_step
    rank = dist.get_rank()
    learner = TorchDDP(make_model(seed=0))
    ours = miniddp.DistributedDataParallel(make_model(seed=0))
    optimizers = {id(m): sgd(m) for m in (learner, ours)}
    report = {"mismatch": None, "rounds": [], "launches": [], "moved": [], "mistake": None,
              "one_backward": False}
    current: list = []

    def mark(module, args):  # on the inner module: a forward through ddp.module counts too
        if ours.reducer.timeline is not None:
            ours.reducer.timeline.append(("micro-batch", which_micro_batch(args[0], current), 0.))

    def backward_mark(module, args, output):  # when the output's gradient is computed
        timeline = ours.reducer.timeline
        if timeline is not None and output.requires_grad:
            output.register_hook(lambda grad: timeline.append(("output grad", 0, 0.)))

    ours.module.register_forward_pre_hook(mark)
    ours.module.register_forward_hook(backward_mark)
    trajectories = loops_trajectories()
    right, mine = trajectories.pop(REFERENCE), []
    for s, batches in enumerate(micro_batches(rank)):
        current[:] = batches
        start = flat(learner)
        step(learner, optimizers[id(learner)], current)
        ours.reducer.timeline = []
        step(ours, optimizers[id(ours)], current)
        events = [e for e, _, _ in ours.reducer.timeline]
        report["rounds"].append((events.count("backward_end"), events.count("launch")))
        report["launches"].append(launches_per_micro_batch(ours.reducer.timeline, K))
        kinds = [e for e in events if e in ("micro-batch", "output grad")]
        report["one_backward"] |= kinds == ["micro-batch"] * K + ["output grad"] * K
        ours.reducer.timeline = None
        mine.append(flat(learner))
        report["moved"].append(not torch.equal(mine[-1], start))
        if report["mismatch"] is None and not torch.equal(mine[s], right[s]):
            report["mismatch"] = (f"after step {s}, rank {rank}: largest difference "
                                  f"{(mine[s] - right[s]).abs().max().item():.3g}")
    close = lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-7)  # noqa: E731
    for same in (torch.equal, close):  # bits first: some mistakes are only rounding apart
        report["mistake"] = report["mistake"] or next(
            (MISTAKES[loop] for loop, seen in trajectories.items()
             if all(same(a, b) for a, b in zip(mine, seen))
             and (same is torch.equal or not loop.scale_after)), None)
    report["buckets"] = len(ours.buckets)
    return report


def synchronization_problem(launches: list[list[int]], buckets: int) -> str | None:
    """What the launches per micro-batch say went wrong, or None when only the last one's
    backward launched, once per bucket."""
    expected = [0] * (K - 1) + [buckets]
    if all(step == expected for step in launches):
        return None
    said = (f"all_reduces launched per micro-batch (0 to {K - 1}), per step: {launches}; "
            f"expected {expected} in each step")
    first = next(step for step in launches if step != expected)
    early = [j for j in range(K - 1) if first[j]]
    if not any(first):
        why = ("no micro-batch synchronized: the last one ran inside no_sync too (or through "
               "ddp.module). Its forward and backward go outside no_sync, through ddp")
    elif early and len(early) == K - 1 and first[-1]:
        why = ("every micro-batch synchronized: no forward ran inside no_sync. The flag is "
               "read at forward time, so the forward and the backward of the first k - 1 go "
               "inside `with ddp.no_sync():`")
    elif early and not first[-1]:
        why = (f"micro-batch {early[0]} synchronized and the last did not: the all_reduce ran "
               "before the gradients had accumulated, averaging only part of them. The first "
               "k - 1 inside no_sync, the last outside")
    elif early:
        why = (f"micro-batches {early} synchronized as well as the last: they ran outside "
               "no_sync (the flag is read at forward time, so the forward must be inside it)")
    else:
        why = (f"the last micro-batch's backward launched {first[-1]} all_reduces for "
               f"{buckets} buckets: one backward of the last micro-batch, through ddp")
    return f"{why[0].upper()}{why[1:]} ({said})"


def grade_07():
    by_world = {world: on_ranks(world, no_sync_task) for world in WORLDS}
    report = by_world[3][0]
    rounds, buckets = report["rounds"], report["buckets"]
    yield (all(r == (1, buckets) for r in rounds), "one all_reduce round per step",
           (synchronization_problem(report["launches"], buckets) or "") + " (synchronized "
           f"backwards, all_reduces) per step were {rounds}, expected (1, {buckets})")
    problem = synchronization_problem(report["launches"], buckets)
    yield (problem is None, "the micro-batch that synchronizes is the last one of each step",
           problem)
    for world, results in by_world.items():
        wrong = next((r for r in results if r["mismatch"]), None)
        if wrong is None:
            why = ""
        elif problem:
            why = "the synchronization checked above is wrong, and changes the gradient"
        elif wrong["one_backward"]:
            why = ("one backward after all k forwards (the losses added up): the gradient of "
                   "the mean up to rounding, summed in another order, and all k micro-batches' "
                   "activations held at once, which accumulation exists to avoid. Backward each "
                   "micro-batch's loss / k in turn, the first k - 1 inside no_sync")
        elif wrong["mistake"]:
            why = wrong["mistake"]
        elif not any(wrong["moved"]):
            why = "no parameter moved: optimizer.step() never stepped on a gradient"
        else:
            why = ("its parameters match none of the usual mistakes (zero_grad at the wrong "
                   "place, a step per micro-batch, the loss divided by something other than "
                   "k, a micro-batch left out). zero_grad once before the first micro-batch, "
                   "each loss divided by k, one optimizer step after the last")
        yield (wrong is None, f"{world} ranks: parameters equal the correct loop's on torch's "
               f"DDP bit for bit after every step (k = {K} micro-batches)",
               f"{why} ({wrong['mismatch']})" if wrong else "")
