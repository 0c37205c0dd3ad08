"""Lesson 11: benchmarking bucket sizes against torch's DDP, and how to read the result.

What this adds since lesson 10: numbers you can trust. Lesson 05 predicted from
``t(n) = alpha + n * beta`` that buckets beat one all_reduce per parameter; lesson 08 proved the
bits. Here both DDPs train side by side at several ``bucket_cap_mb``, timed, and the lesson
shows how to turn noisy step times into a conclusion:

* **correctness first**: no time is shown until every miniddp has the buckets of the torch DDP
  with its cap and bit-identical parameters after all the timed steps.
* **alternate, in one process group**: each round runs every contestant for one step, in a
  shuffled order, never one twice in a row (it would find its tensors in cache), after untimed
  warm-up rounds; a barrier before each step, which counts as long as its slowest rank.
* **medians of per-round ratios**: two contestants in one round suffered the same load, so
  their ratio cancels most of it; the A/A control (two identical torch DDPs) stays near 1
  while absolute times swing by 2x.
* **a confidence interval of the median ratio** (exact, from order statistics:
  ``course.tools.median_interval``), not the spread of single rounds: a ratio whose 95%
  interval excludes 1 is a finding. Comparing a median with the A/A control's interquartile
  range dismisses real gaps however many rounds are run; both rules are shown on simulated
  rounds 11% apart.
* **what the model predicts**: each bucket is one all_reduce and pays ``alpha``, so B buckets
  cost ``(B - B_default) * alpha`` more than the default's; large buckets lose overlap instead
  (lesson 06). On gloo with 2 cores there is little overlap to lose; on NCCL there is. Measure on
  the machine you train on.

Why ``alpha`` here is larger than lesson 05's (often 2-3x): lesson 05 times bursts of calls back
to back, per call, with the ranks already in step, and fits a line through many sizes; here it
is one 4-byte call right after a barrier, the slowest rank's time: what one bucket's all_reduce
costs inside a step. Both are right for their question.

The model: a deep, narrow student (52 tensors, 1.5 MiB of gradients). The caps: one bucket per
parameter, 0.125 MiB, torch's default and an explicit 25 (one bucket). The full sweep is
``benchmarks/bucket_sweep.py``; its saved results are summarized at the end.

Run it:

    python lessons/11_benchmarking_buckets.py               # forks 2 ranks, gloo on CPU
    python lessons/11_benchmarking_buckets.py --rounds 100  # more rounds: steadier medians
    torchrun --standalone --nproc_per_node=2 lessons/11_benchmarking_buckets.py

What you should see: ``alpha`` and ``beta``; "bit-identical" for every cap; a table of median
step times and ratios with 95% intervals and the model's prediction; the A/A control; the two
rules on simulated rounds; ``runs/11_benchmarking_buckets.png``; one line per saved sweep;
``OK: ...``. About 30 s. Times are shown and read, never a condition of OK.
"""

import argparse
import copy
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.data import DataLoader

from course.data import IN_FEATURES, OUT_FEATURES, make_dataset, shard
from course.report import check, ok, print0, save_figure
from course.tools import (
    alternate,
    median_interval,
    per_round,
    quartiles,
    slowest_rank,
    summarize_saved_sweeps,
    sync,
    verdict,
)
from miniddp import DistributedDataParallel
from miniddp.launch import launch, rank_device

HIDDEN_LAYERS, WIDTH = 24, 128
BATCH_SIZE = 16  # per rank
LR = 0.02
WARMUP = 3  # untimed rounds: the buckets are rebuilt at the second step
MIB = 2**20
DEFAULT = "default"
# bucket_cap_mb for each label. None: not passed, torch's default (1 MiB first, then 25 MiB).
# An explicit cap applies to every bucket, so 25 makes a single bucket of this 1.5 MiB model.
CAPS = {"per-parameter": 1 / MIB,  # a 1-byte cap: every tensor closes a bucket of its own
        "0.125": 0.125, DEFAULT: None, "25": 25.0}
SAVED = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


class Residual(nn.Linear):
    """``x + tanh(W x + b) / sqrt(depth)``: a deep stack that still learns in a few dozen steps
    (a plain stack of 26 tanh layers barely moves). Its parameters are a Linear's."""

    def forward(self, x):
        return x + torch.tanh(super().forward(x)) / HIDDEN_LAYERS**0.5


def deep_student() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(IN_FEATURES, WIDTH),
                             *[Residual(WIDTH, WIDTH) for _ in range(HIDDEN_LAYERS)],
                             nn.Linear(WIDTH, OUT_FEATURES))


class Contestant:
    """A wrapped copy of the student, its optimizer, and the loss of every step it took."""

    def __init__(self, ddp, batches):
        self.ddp, self.batches, self.losses = ddp, batches, []
        self.optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)

    def step(self):
        x, y = self.batches[len(self.losses) % len(self.batches)]
        loss = F.mse_loss(self.ddp(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.detach())


def alpha_and_beta(nbytes: int, device, calls: int = 30) -> tuple[float, float]:
    """Median time of a 4-byte all_reduce (``alpha``) and of one holding every gradient, which
    gives ``beta`` (seconds per byte). Alternated too; the slowest rank's times."""
    tiny, full = torch.zeros(1, device=device), torch.zeros(nbytes // 4, device=device)
    times = [[], []]
    for k in range(calls + 2):
        for i, t in enumerate((tiny, full)):
            sync(device)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            sync(device)
            if k >= 2:
                times[i].append(time.perf_counter() - start)
    alpha, full_time = (statistics.median(t) for t in slowest_rank(times, device))
    return alpha, max(full_time - alpha, 0.0) / nbytes


def same_buckets_as_torch(ours, theirs) -> bool:
    logged = theirs._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
    torch_buckets = [[int(i) for i in b.split()] for b in logged.split(",")]
    return [b.param_indices for b in ours.buckets] == torch_buckets


def on_every_rank(rounds: int):
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    student = deep_student().to(device)
    nbytes = sum(4 * p.numel() for p in student.parameters())
    alpha, beta = alpha_and_beta(nbytes, device)
    print0(f"all_reduce here: alpha = {1e6 * alpha:.0f} us per call, beta = "
           f"{1e3 * beta * MIB:.2f} ms per MiB; all {nbytes / MIB:.2f} MiB of gradients in "
           f"one call: {1e3 * (alpha + nbytes * beta):.2f} ms\n(one call after a barrier, the "
           "slowest rank's: more than lesson 05's alpha, a call within a burst of calls)")

    loader = DataLoader(shard(make_dataset(n=2048, seed=0), rank, world),
                        batch_size=BATCH_SIZE, drop_last=True)
    batches = [(x.to(device), y.to(device)) for x, y in loader]  # step k trains on batch k
    ids = [device] if device.type == "cuda" else None
    contestants = {}
    for label, cap in CAPS.items():
        for name, ddp_class in (("miniddp", DistributedDataParallel), ("torch", TorchDDP)):
            cap_kwargs = {} if cap is None else {"bucket_cap_mb": cap}
            ddp = ddp_class(copy.deepcopy(student), device_ids=ids, **cap_kwargs)
            contestants[name, label] = Contestant(ddp, batches)
    contestants["torch again", DEFAULT] = Contestant(  # the A/A control: torch against itself
        TorchDDP(copy.deepcopy(student), device_ids=ids), batches)
    print0(f"{len(contestants)} contestants, {WARMUP} warm-up rounds, {rounds} timed rounds of "
           f"one step each ({BATCH_SIZE} samples per rank)")
    timed = alternate({name: c.step for name, c in contestants.items()}, rounds, device, WARMUP)
    times = {name: [ms / 1e3 for ms in t["wall"]] for name, t in timed.items()}  # in seconds

    for (name, label), contestant in contestants.items():  # before any time is looked at
        theirs = contestants["torch", label].ddp
        if name == "miniddp":
            check(same_buckets_as_torch(contestant.ddp, theirs),
                  f"bucket_cap_mb={label}: miniddp's buckets differ from torch's")
        check(all(torch.equal(p, q) for p, q in zip(contestant.ddp.parameters(),
                                                     theirs.parameters())),
              f"rank {rank}: {name} at bucket_cap_mb={label} ended with other parameters than "
              "torch's DDP at the same cap: its timings would compare different computations")
    losses = torch.stack(contestants["torch", DEFAULT].losses).to(torch.float64)
    dist.all_reduce(losses)
    losses = (losses / world).tolist()
    buckets = {label: len(contestants["miniddp", label].ddp.buckets) for label in CAPS}
    return {"times": times, "buckets": buckets,
            "alpha": alpha, "beta": beta, "nbytes": nbytes, "losses": losses,
            "backend": dist.get_backend(), "world": world, "device": device.type}


# ----- after the ranks: reading the numbers (rank 0 prints) -----

def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f}"


def read(result: dict) -> dict:
    """Print the table, the model's prediction and the noise; check the robust orderings.
    Returns, per cap, miniddp / torch and the cap's step over the default's (torch's)."""
    times, alpha, buckets = result["times"], result["alpha"], result["buckets"]
    default = times["torch", DEFAULT]
    print0(f"\nmedian step times over {len(default)} rounds; ratios are medians of per-round "
           "ratios; 'predicted' adds (buckets - default's buckets) x alpha to torch's default")
    print0(f"{'bucket_cap_mb':<15} {'buckets':>7} {'miniddp ms':>10} {'torch ms':>9} "
           f"{'miniddp/torch (95% interval)':>29} {'cap/default (torch)':>19} {'predicted':>9}")
    ratios = {}
    for label in CAPS:
        ours, theirs = times["miniddp", label], times["torch", label]
        extra = (buckets[label] - buckets[DEFAULT]) * alpha
        mid, low, high = median_interval(per_round(ours, theirs))
        ratios[label] = r = {
            "miniddp/torch": mid, "interval": (low, high), "verdict": verdict(low, high),
            "torch vs default": statistics.median(per_round(theirs, default)),
            "miniddp vs default": statistics.median(per_round(ours, times["miniddp", DEFAULT])),
            "predicted": 1 + extra / statistics.median(default)}
        print0(f"{label:<15} {buckets[label]:>7} {ms(statistics.median(ours)):>10} "
               f"{ms(statistics.median(theirs)):>9} {mid:>6.3f} ({low:.3f}-{high:.3f}) "
               f"{verdict(low, high):>9} {r['torch vs default']:>19.2f} {r['predicted']:>9.2f}")

    control = per_round(times["torch again", DEFAULT], default)
    low, high = quartiles(default)
    c_low, c_high = quartiles(control)
    c_mid, c_from, c_to = median_interval(control)
    print0(f"\nnoise: torch's step at the default cap took {ms(min(default))}-{ms(max(default))} "
           f"ms (middle half {ms(low)}-{ms(high)}: {high / low:.2f}x apart); the A/A control, "
           f"an identical torch DDP in the same rounds, ran at {c_mid:.3f} of it per round "
           f"(95% interval {c_from:.3f}-{c_to:.3f}; single rounds' middle half "
           f"{c_low:.3f}-{c_high:.3f}).")
    if c_from <= 1 <= c_to:
        print0("the A/A interval holds 1: the rounds favour no position, and the intervals "
               "above can be read as they are")
    else:
        print0("the A/A interval misses 1: identical DDPs came out unequal, so the way rounds "
               "are run favours one position here (or the machine changed mid-run); read every "
               "ratio above with that bias in mind, and run again")
    the_two_rules(len(control), (c_low, c_high))

    per_param, more = ratios["per-parameter"], buckets["per-parameter"] - buckets[DEFAULT]
    if per_param["predicted"] >= 1.25:  # a clear prediction: shown next to the measurement
        if not (per_param["torch vs default"] > 1 and per_param["miniddp vs default"] > 1):
            print0(f"one bucket per parameter ({more} more all_reduces) was not slower than the "
                   f"default cap on this run, where the model predicts "
                   f"{per_param['predicted']:.2f}x: the load of other programs outweighed alpha "
                   "in these rounds. Timings are shown, not checked; run again with more "
                   "--rounds")
        print0(f"one all_reduce per parameter: {per_param['torch vs default']:.2f}x the "
               f"default's step time (torch; miniddp {per_param['miniddp vs default']:.2f}x); "
               f"the model says {per_param['predicted']:.2f}x for {more} more calls at alpha "
               "each. It gets the ordering right and the size roughly: a bucket costs more "
               "than alpha (a hook, a copy in and out, a wait), and calls in a row queue up")
    else:
        print0(f"alpha is small here: the model predicts only {per_param['predicted']:.2f}x for "
               "one all_reduce per parameter, too little to check on a shared machine")
    return ratios


def the_two_rules(rounds: int, measured: tuple[float, float], spread: float = 0.3):
    """Simulated rounds, not measured ones: a contestant assumed 11% slower, read by the rule
    that dismisses a gap inside the A/A spread and by the interval of the median, after this
    run's number of rounds and after 100. Each round is assumed as noisy as an A/A control whose
    single rounds' middle half spans ``spread`` (0.85-1.15, an assumption; this run's own A/A
    middle half, ``measured``, is printed beside it); the rounds are the noise's quantiles,
    evenly spaced: what such a measurement gives, the same every run."""
    sigma = spread / 2 / statistics.NormalDist().inv_cdf(0.75)  # log-normal noise of that spread
    q_low, q_high = 1 - spread / 2, 1 + spread / 2
    print0(f"\nthe two rules on simulated rounds (not this run's): a contestant assumed 11% "
           f"slower, each round assumed as noisy as an A/A control whose middle half spans "
           f"{q_low:.2f}-{q_high:.2f} (this run's A/A: {measured[0]:.3f}-{measured[1]:.3f}):")
    for n in sorted({rounds, max(rounds, 100)}):
        gap = [1.11 * math.exp(sigma * statistics.NormalDist().inv_cdf((i + 0.5) / n))
               for i in range(n)]
        mid, low, high = median_interval(gap)
        print0(f"  {n:>3} rounds: median {mid:.3f}, inside the A/A middle half: 'not a finding'; "
               f"95% interval of the median {low:.3f}-{high:.3f}: "
               + ("above 1, a finding" if low > 1 else "holds 1, not shown yet: run more rounds"))
        check(q_low < mid < q_high, f"the 11% gap should lie inside the A/A spread "
                                    f"{q_low:.2f}-{q_high:.2f}, its median is {mid:.3f}")
    check(low > 1, f"after {n} rounds the interval of an 11% gap's median should exclude 1, it "
                   f"is {low:.3f}-{high:.3f}: median_interval does not shrink with the rounds")
    print0("  the spread of single rounds stays as wide however many rounds are run; the "
           "interval of the median narrows (as 1 / sqrt(rounds))")


def plot(result: dict):
    times = result["times"]

    def draw(ax):
        for shift, name in ((-0.12, "miniddp"), (0.12, "torch")):
            for i, label in enumerate(CAPS):
                t = [1e3 * s for s in times[name, label]]
                ax.plot([i + shift] * len(t), t, ".", alpha=0.25,
                        color="C0" if name == "miniddp" else "C1")
            ax.plot([i + shift for i in range(len(CAPS))],
                    [1e3 * statistics.median(times[name, c]) for c in CAPS], "o-",
                    color="C0" if name == "miniddp" else "C1", label=f"{name}, median")
        ax.set_xticks(range(len(CAPS)), [f"{c}\n{result['buckets'][c]} bucket"
                                         + "s" * (result["buckets"][c] > 1) for c in CAPS])
        ax.set(xlabel="bucket_cap_mb", ylabel="step time (ms), every timed round",
               yscale="log", title=f"{result['backend']}, {result['world']} ranks, "
                                   f"{result['device']}: dots are single steps")
        ax.legend(fontsize=8)

    save_figure("11_benchmarking_buckets", draw)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds")
    args = parser.parse_args()
    if args.rounds < 4:
        parser.error("--rounds must be at least 4: medians and quartiles need a few rounds")
    result = launch(on_every_rank, args.nproc, args=(args.rounds,))[0]
    losses = result["losses"]
    print0(f"every cap: same buckets as torch's DDP, parameters bit-identical after all "
           f"{len(losses)} steps; the loss fell {losses[0]:.3f} -> {losses[-1]:.4f}")
    check(losses[-1] < 0.3 * losses[0],
          f"the loss went from {losses[0]:.4f} to {losses[-1]:.4f}, not below 30% of it")
    ratios = read(result)
    plot(result)
    summarize_saved_sweeps(SAVED, result["alpha"], result["backend"], result["device"])
    verdicts = ", ".join(f"{label} {r['verdict']}" for label, r in ratios.items())
    ok(f"miniddp bit-identical to torch's DDP, with torch's buckets, at {len(CAPS)} bucket caps; "
       f"miniddp/torch by its 95% interval (read, not checked): {verdicts}")


if __name__ == "__main__":
    main()
