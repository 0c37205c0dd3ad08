"""Grade the exercises in ``lessons/exercises/`` bit for bit against torch.

Each exercise is a lesson's mechanism with its key lines removed and an instruction in their
place (it raises ``NotImplementedError`` until you write them). The grader runs your code on
several forked CPU ranks with gloo (``miniddp.RankGroup``, with timeouts), next to torch's own
``DistributedDataParallel`` or ``DistributedSampler``, and says which check failed and what was
expected. Where torch's bits cannot be expected, the check says why and what it asks instead.

    python lessons/grade.py                # grade your exercises as they stand
    python lessons/grade.py 06             # grade one (03 04 05 06 07)
    python lessons/grade.py --solutions    # grade the reference solutions (all pass)

Exit status 0 when every graded exercise passes every check.
"""

import argparse
import importlib.util
import os
import sys
from contextlib import nullcontext
from pathlib import Path

# Before torch loads: its C++ note that find_unused_parameters found nothing unused (exercise
# 05 uses that flag for its buckets) would bury the grades.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: E402
from torch.utils.data.distributed import DistributedSampler as TorchSampler  # noqa: E402

import miniddp  # noqa: E402
from miniddp.buckets import bucket_limits  # noqa: E402
from miniddp.data import IN_FEATURES, OUT_FEATURES, make_dataset, make_model  # noqa: E402
from miniddp.launch import RankError, RankGroup  # noqa: E402
from miniddp.torch_versions import EXPLICIT_CAP_COVERS_FIRST_BUCKET  # noqa: E402

EXERCISES = Path(__file__).resolve().parent / "exercises"
TIMEOUT = 60


class NotWritten(Exception):
    """The exercise still raises NotImplementedError; the message says what to write."""


def exercise_path(number: str, directory: Path) -> Path:
    found = sorted(directory.glob(f"{number}_*.py"))
    if not found:
        raise FileNotFoundError(f"no file {number}_*.py in {directory}")
    return found[0]


def load(path: Path, number: str) -> None:
    """Import the exercise file; kept in sys.modules so that forked ranks can find it."""
    name = f"exercise_{number}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _guarded(task, *args):
    try:
        return "ok", task(*args)
    except NotImplementedError as error:
        return "todo", str(error)


_groups: dict[int, RankGroup] = {}  # kept between exercises while they run cleanly


def on_ranks(world_size: int, task, *args) -> list:
    """Run ``task(*args)`` on ``world_size`` gloo ranks; results in rank order."""
    group = _groups.get(world_size)
    if group is None or not group.alive:
        group = _groups[world_size] = RankGroup(world_size, pg_timeout=20)
    results = group.run(_guarded, task, *args, timeout=TIMEOUT)  # closes itself if it fails
    for status, value in results:
        if status == "todo":
            group.close(kill=True)  # stopped midway: its state is unknown
            raise NotWritten(value)
    return [value for _, value in results]


def flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def everyone(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


# ----- 03: all_reduce averaging by hand -----

def average_task():
    x, y = make_dataset(n=32, seed=dist.get_rank()).tensors
    theirs, mine = TorchDDP(make_model(seed=0)), make_model(seed=0)
    for model in (theirs, mine):
        F.mse_loss(model(x), y).backward()
    sys.modules["exercise_03"].average_gradients(mine)
    ours, torchs = flat_grads(mine), flat_grads(theirs)
    return {"equal": torch.equal(ours, torchs), "diff": (ours - torchs).abs().max().item(),
            "same_everywhere": all(torch.equal(g, ours) for g in everyone(ours))}


def grade_03():
    for world in (2, 3):
        results = on_ranks(world, average_task)
        diff = max(r["diff"] for r in results)
        if world == 2:
            yield (all(r["equal"] for r in results), "2 ranks: every .grad equals torch's DDP's "
                   "bit for bit", f"expected torch's bits; largest difference {diff:.3g}. "
                   "Did you scale by 1 / world_size and all_reduce every gradient?")
        else:
            yield (all(r["same_everywhere"] for r in results), "3 ranks: every rank holds the "
                   "same bits", "the ranks hold different gradients: every rank must "
                   "all_reduce every gradient")
            yield (diff < 1e-6, "3 ranks: within 1e-6 of torch's DDP (not bit for bit: torch "
                   "sums whole buckets, and a ring's order depends on an element's offset)",
                   f"largest difference {diff:.3g}")


# ----- 04: the sampler -----

def sampler_task():
    rank, world = dist.get_rank(), dist.get_world_size()
    write = sys.modules["exercise_04"].rank_indices
    cases = 0
    for n in (1, 2, 3, 5, 7, 10, 11, 64):
        for shuffle in (True, False):
            for drop_last in (False, True):
                for epoch, seed in ((0, 0), (1, 0), (3, 7)):
                    sampler = TorchSampler(range(n), num_replicas=world, rank=rank,
                                           shuffle=shuffle, seed=seed, drop_last=drop_last)
                    sampler.set_epoch(epoch)
                    expected = list(sampler)
                    got = write(n, world, rank, epoch, seed, shuffle, drop_last)
                    cases += 1
                    if list(got) != expected:
                        return (f"rank {rank}: rank_indices({n}, {world}, {rank}, epoch={epoch}, "
                                f"seed={seed}, shuffle={shuffle}, drop_last={drop_last}) "
                                f"returned {list(got)}, torch's sampler gives {expected}")
    return cases


def grade_04():
    results = on_ranks(3, sampler_task)
    wrong = [r for r in results if isinstance(r, str)]
    yield (not wrong, f"3 ranks: every rank's indices equal torch's DistributedSampler's in "
           f"{results[0] if not wrong else 'all'} cases", wrong[0] if wrong else "")


# ----- 05: bucket assignment -----

CAP_MB_05 = 0.01


def many_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN_FEATURES, 32), *[nn.Linear(32, 32) for _ in range(5)],
                         nn.Linear(32, OUT_FEATURES))


def buckets_task():
    assign = sys.modules["exercise_05"].assign_buckets
    g = torch.Generator().manual_seed(0)
    for case in range(30):
        count = int(torch.randint(1, 12, (), generator=g))
        params = [torch.empty(int(torch.randint(1, 3000, (), generator=g)),
                              dtype=torch.float64 if case % 3 == 0 and k % 2 else torch.float32)
                  for k in range(count)]
        theirs, _ = dist._compute_bucket_assignment_by_size(params, [4000, 9000])
        expected, got = [list(b) for b in reversed(theirs)], assign(params, 4000, 9000)
        if got != expected:
            sizes = [(p.numel() * p.element_size(), str(p.dtype)[6:]) for p in params]
            return False, (f"for parameters of (bytes, dtype) {sizes}, first_bytes=4000, "
                           f"cap_bytes=9000: expected {expected}, got {got}")
    model, theirs = many_layers(), TorchDDP(many_layers(), bucket_cap_mb=CAP_MB_05,
                                            find_unused_parameters=True)
    x, y = make_dataset(n=16, seed=dist.get_rank()).tensors
    for m in (model, theirs):
        F.mse_loss(m(x), y).backward()
    params = list(model.parameters())
    layout = assign(params, *bucket_limits(CAP_MB_05))
    for members in layout:  # lesson 05's all_reduce_in_buckets
        flat = torch.cat([params[i].grad.reshape(-1) for i in members]) * (1.0 / 3)
        dist.all_reduce(flat)
        offset = 0
        for i in members:
            params[i].grad.copy_(flat[offset:offset + params[i].numel()].view_as(params[i]))
            offset += params[i].numel()
    same = torch.equal(flat_grads(model), flat_grads(theirs))
    return True, (same, (flat_grads(model) - flat_grads(theirs)).abs().max().item(), layout)


def grade_05():
    results = on_ranks(3, buckets_task)
    layout_ok, detail = results[0]
    yield (layout_ok, "30 parameter lists (mixed dtypes too): the layout of torch's "
           "_compute_bucket_assignment_by_size, reversed", "" if layout_ok else detail)
    if layout_ok:
        same = all(r[1][0] for r in results)
        diff = max(r[1][1] for r in results)
        yield (same, "3 ranks: one all_reduce per bucket of yours gives torch's DDP's gradients "
               "bit for bit", f"largest difference {diff:.3g} with your layout {detail[2]}")


# ----- 06: the reducer -----

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
    report = {"mismatch": None, "sync": [], "order": [], "late": [], "early_wait": []}
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


def grade_06():
    for world in (2, 3):
        results = on_ranks(world, reducer_task)
        mismatch = next((r["mismatch"] for r in results if r["mismatch"]), None)
        yield (mismatch is None, f"{world} ranks: .grad equals torch's DDP's bit for bit after "
               "every backward (one bucket, then torch's rebuilt buckets)",
               f"{mismatch}. Scale with torch.mul(grad, 1.0 / world_size, out=view), and copy "
               "every bucket back in _finish")
    r = results[0]
    yield (not r["sync"], "every all_reduce is asynchronous (async_op=True)",
           f"{len(r['sync'])} all_reduce calls ran synchronously: backward stopped for each")
    yield (not r["early_wait"], "no all_reduce is waited for before backward has computed every "
           "gradient", "a .wait() ran while gradients were still to come: wait only in _finish")
    yield (not r["late"], "with several buckets, the first all_reduce starts while gradients "
           "are still arriving", f"at steps {r['late']} nothing was launched before the last "
           "gradient: launch a bucket as soon as it is complete")
    yield (not r["order"], "buckets are launched in order, each once",
           f"at steps {r['order']} the all_reduces did not follow self.flat's order")


# ----- 07: no_sync -----

def reference_step(ddp, optimizer, micro_batches):
    k = len(micro_batches)
    optimizer.zero_grad()
    for j, (x, y) in enumerate(micro_batches):
        with ddp.no_sync() if j < k - 1 else nullcontext():
            (F.mse_loss(ddp(x), y) / k).backward()
    optimizer.step()


def no_sync_task(k: int = 3, steps: int = 3):
    step = sys.modules["exercise_07"].accumulation_step
    rank = dist.get_rank()
    learner, reference = TorchDDP(make_model(seed=0)), TorchDDP(make_model(seed=0))
    ours = miniddp.DistributedDataParallel(make_model(seed=0))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9)
                  for m in (learner, reference, ours)]
    x_all, y_all = make_dataset(n=8 * k * steps, seed=rank).tensors
    report = {"mismatch": None, "rounds": []}
    for s in range(steps):
        micro = list(zip(x_all[8 * k * s:8 * k * (s + 1)].chunk(k),
                         y_all[8 * k * s:8 * k * (s + 1)].chunk(k)))
        step(learner, optimizers[0], micro)
        reference_step(reference, optimizers[1], micro)
        ours.reducer.timeline = []
        step(ours, optimizers[2], micro)
        events = [e for e, _, _ in ours.reducer.timeline]
        report["rounds"].append((events.count("backward_end"), events.count("launch")))
        a = torch.cat([p.detach().reshape(-1) for p in learner.parameters()])
        b = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
        if report["mismatch"] is None and not torch.equal(a, b):
            report["mismatch"] = f"after step {s}, rank {rank}: largest difference " \
                                 f"{(a - b).abs().max().item():.3g}"
    report["buckets"] = len(ours.buckets)
    return report


def grade_07():
    for world in (2, 3):
        results = on_ranks(world, no_sync_task)
        mismatch = next((r["mismatch"] for r in results if r["mismatch"]), None)
        yield (mismatch is None, f"{world} ranks: parameters equal the correct loop's on torch's "
               "DDP bit for bit after every step", f"{mismatch}: zero_grad once, loss / k, "
               "step once")
    rounds, buckets = results[0]["rounds"], results[0]["buckets"]
    yield (all(r == (1, buckets) for r in rounds), "one all_reduce round per step: only the last "
           "micro-batch's backward synchronizes", f"(synchronized backwards, all_reduces) per "
           f"step were {rounds}, expected (1, {buckets}): forward and backward of the first k - "
           "1 micro-batches both inside no_sync, the last outside")


GRADERS = {"03": grade_03, "04": grade_04, "05": grade_05, "06": grade_06, "07": grade_07}


def grade(number: str, path: Path, load_error: str | None) -> bool:
    shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
    print(f"\nexercise {number}: {shown}", flush=True)
    if load_error:
        print(f"  FAIL  the file does not import: {load_error}")
        return False
    passed = True
    try:
        for ok, what, why in GRADERS[number]():
            passed &= ok
            print(f"  {'PASS' if ok else 'FAIL'}  {what}" + ("" if ok else f"\n        {why}"),
                  flush=True)
    except NotWritten as todo:
        print(f"  TODO  not written yet: {todo}")
        return False
    except RankError as error:
        lines = [line for line in error.details.strip().splitlines()
                 if line.strip() and not line.startswith("(then")]
        print(f"  FAIL  rank {error.rank} of {error.world_size} raised: {lines[-1]}")
        return False
    return passed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exercises", nargs="*", help=f"which to grade ({' '.join(GRADERS)})")
    parser.add_argument("--solutions", action="store_true",
                        help="grade the reference solutions instead of your exercises")
    parser.add_argument("--dir", type=Path, default=None,
                        help="grade the files NN_*.py of this directory instead")
    args = parser.parse_args()
    unknown = [n for n in args.exercises if n not in GRADERS]
    if unknown:
        parser.error(f"no exercise {', '.join(unknown)}; there are {', '.join(GRADERS)}")
    torch.set_num_threads(1)
    chosen = args.exercises or list(GRADERS)
    directory = args.dir or (EXERCISES / "solutions" if args.solutions else EXERCISES)
    loaded = {}
    for n in chosen:  # all before any rank is forked: the ranks must find every exercise
        path = exercise_path(n, directory)
        try:
            load(path, n)
            loaded[n] = (path, None)
        except Exception as error:
            loaded[n] = (path, f"{type(error).__name__}: {error}")
    try:
        results = {n: grade(n, *loaded[n]) for n in chosen}
    finally:
        for group in _groups.values():
            group.close()
    passed = [n for n, ok in results.items() if ok]
    print(f"\n{len(passed)} of {len(chosen)} exercises pass"
          + ("" if len(passed) == len(chosen) else
             f"; next: python lessons/grade.py {next(n for n in chosen if n not in passed)}"))
    sys.exit(0 if len(passed) == len(chosen) else 1)


if __name__ == "__main__":
    main()
