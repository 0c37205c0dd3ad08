"""Memory: peak bytes allocated by DDP training steps, with and without gradient_as_bucket_view.

For miniddp and torch's DDP, each with ``gradient_as_bucket_view`` off and on, and zeroing
gradients both ways (``zero_grad(set_to_none=True)``, torch's default, and ``False``): wrap a
copy of the model, then run three training steps (the second rebuilds the buckets) and then one
more, a steady step. The peak of each step is measured from just before the wrapping, so the
model's own parameters are not counted and the buckets are:

* on GPU: ``torch.cuda.max_memory_allocated()`` minus what was allocated before;
* on CPU (Linux): the process's peak resident memory (``VmHWM``, reset through
  ``/proc/self/clear_refs`` first) minus its resident memory before. tracemalloc would see none
  of torch's memory, and RSS alone lags behind frees because glibc keeps freed blocks; so blocks
  of 64 KiB and more are set to be mmapped (``mallopt``), which returns them to the system as
  soon as they are freed. It counts every thread's memory, gloo's buffers included. (torch's
  profiler with ``profile_memory=True`` was tried and dropped: frees made on gloo's threads are
  not reported to it, so its total drifted from run to run.)

Every configuration runs in a rank group of its own: fresh processes, which first pay the
one-off costs outside the measurement (a plain training step, a collective, both DDP classes on
a tiny model). Run one after another in one process, the configurations saw each other on
NCCL: tensors of a finished one (held by NCCL's work objects or the caching allocator) were
freed while the next was measured, which gave a 2 MB peak for 197 MB of gradients (the first
GPU run, 2026-11-24). The parent compares a hash of each configuration's final parameters:
miniddp's must be torch's, bit for bit.

Without the option a gradient lives twice, in ``.grad`` and in its bucket; with it ``.grad`` is a
view of the bucket.

On CUDA, ``MINIDDP_MEMORY_SNAPSHOTS=DIR`` writes a snapshot of the caching allocator after each
configuration (every live block and the stack that allocated it; open it in
https://pytorch.org/memory_viz): where torch's DDP keeps its extra copy on NCCL (see
benchmarks/README.md). gpu.sh sets it to ``results/logs/memory-snapshots``.

    python benchmarks/memory.py           # no GPU: gloo, 2 CPU ranks, under a minute
    python benchmarks/memory.py --quick   # smoke run, seconds
"""

from __future__ import annotations

import copy
import ctypes
import gc
import hashlib
import os
from pathlib import Path

import harness
import torch
import torch.distributed as dist
from harness import Trainer, check
from torch import nn

import miniddp
from course.report import print0
from course.tools import sync

CONFIGS = [(impl, view, none) for impl in ("miniddp", "torch") for view in (False, True)
           for none in (True, False)]
CLASSES = {"miniddp": miniddp.DistributedDataParallel,
           "torch": nn.parallel.DistributedDataParallel}
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
STEPS = 3  # step 0 uses one bucket, step 1 rebuilds the buckets, step 2 is steady


class Meter:
    """Memory in use above where it stood at creation: now, and at its peak since the last
    :meth:`reset_peak` (MiB). CUDA: the caching allocator's counts; CPU: RSS and VmHWM."""

    def __init__(self, device: torch.device):
        self.device, self.start = device, 0.0
        self.reset_peak()
        self.start = self.now()

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # sets the peak (VmHWM) to the current RSS

    def _read(self, field: str) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            count = torch.cuda.memory_allocated if field == "VmRSS" else \
                torch.cuda.max_memory_allocated
            return count(self.device) / 2**20
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field))

    def now(self) -> float:
        return self._read("VmRSS") - self.start

    def peak(self) -> float:
        return self._read("VmHWM") - self.start


def mmap_large_blocks() -> None:
    """Have glibc mmap every block of 64 KiB or more, so that freeing one returns it to the
    system at once (this also stops glibc from raising the threshold on its own)."""
    libc = ctypes.CDLL(None)
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    libc.mallopt(M_TRIM_THRESHOLD, 64 * 1024)


def train(cls, model, batches, device, view: bool, none: bool) -> dict:
    """Wrap ``model``, train it STEPS steps and then one more; return the memory figures."""
    meter = Meter(device)
    ddp = cls(model, gradient_as_bucket_view=view, **harness.ddp_kwargs(device))
    trainer = Trainer(ddp, batches, set_to_none=none)
    peaks = []  # step 0's includes the wrapping
    for step in range(STEPS):
        if step:
            meter.reset_peak()
        trainer.step()
        peaks.append(meter.peak())
    first = max(peaks)
    meter.reset_peak()
    trainer.step()
    return {"first_steps_peak_mb": first, "steady_peak_mb": meter.peak(), "end_mb": meter.now(),
            "peak_by_step_mb": peaks}


def warm_up(base: nn.Module, batches, device) -> None:
    """One-off costs outside the measurement: a plain training step (the BLAS workspace on a
    GPU), the communicator's first collective, and both DDP classes wrapping a tiny model."""
    Trainer(copy.deepcopy(base), batches).step()
    dist.all_reduce(torch.ones(1, device=harness.collective_device(device)))
    tiny = nn.Linear(4, 4).to(device)
    for cls in CLASSES.values():
        ddp = cls(copy.deepcopy(tiny), **harness.ddp_kwargs(device))
        ddp(torch.ones(2, 4, device=device)).sum().backward()
    sync(device)


def parameter_digest(model: nn.Module) -> str:
    """The bits of every parameter, hashed: what the parent compares between processes."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def measure(setup: harness.Setup, config: tuple) -> dict:
    """One configuration, in a rank group of its own (see the module docstring)."""
    impl, view, none = config
    device = harness.rank_device(setup)
    if device.type == "cpu":
        mmap_large_blocks()
    base = harness.make_model(setup, device)
    batches = harness.make_batches(setup, device, dist.get_rank())
    warm_up(base, batches, device)
    model = copy.deepcopy(base)
    gc.collect()  # the warm-up's buffers must not be freed inside the measurement
    snapshots = os.environ.get("MINIDDP_MEMORY_SNAPSHOTS") if device.type == "cuda" else None
    if snapshots:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    figures = train(CLASSES[impl], model, batches, device, view, none)
    if snapshots:  # every live block at the end, with the stack that allocated it
        Path(snapshots).mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(f"{snapshots}/{impl}-view{view:d}-none{none:d}-"
                                         f"{setup.backend}-rank{dist.get_rank()}.pickle")
    print0(f"  {impl}, gradient_as_bucket_view={view}, set_to_none={none}: peak "
           f"{figures['first_steps_peak_mb']:.1f} MB in the first steps, "
           f"{figures['steady_peak_mb']:.1f} MB in a later one")
    return {"row": {"impl": impl, "gradient_as_bucket_view": view, "set_to_none": none,
                    **figures, "pid": os.getpid()}, "digest": parameter_digest(model),
            "model": harness.model_info(base, setup),
            "batch_per_rank": harness.batch_size(batches), **harness.rank_facts(device)}


def parts(setup: harness.Setup) -> list[tuple]:
    return CONFIGS


def combine(setup: harness.Setup, figures: list[dict]) -> dict:
    """Every configuration's row; miniddp's parameters must be torch's, bit for bit."""
    digests = {(f["row"]["impl"], f["row"]["gradient_as_bucket_view"],
                f["row"]["set_to_none"]): f["digest"] for f in figures}
    for view in (False, True):
        for none in (True, False):
            check(digests["miniddp", view, none] == digests["torch", view, none],
                  f"gradient_as_bucket_view={view}, set_to_none={none}: parameters differ")
    first = figures[0]
    return {"model": first["model"], "batch_per_rank": first["batch_per_rank"],
            "gpu": first["gpu"], "gpus_visible": first["gpus_visible"], "steps": STEPS + 1,
            "bit_identical": True, "process_per_configuration": True,
            "counted": "cuda.max_memory_allocated" if setup.device == "cuda"
            else "peak RSS (VmHWM)", "memory": [f["row"] for f in figures]}


def plot(result: dict, ax) -> None:
    rows = {(r["impl"], r["set_to_none"], r["gradient_as_bucket_view"]): r
            for r in result["memory"]}
    groups = [(impl, none) for impl in ("miniddp", "torch") for none in (True, False)]
    for k, view in enumerate((False, True)):
        x = [i + 0.4 * k for i in range(len(groups))]
        ax.bar(x, [rows[g + (view,)]["steady_peak_mb"] for g in groups], 0.4,
               label=f"gradient_as_bucket_view={view}: a steady step")
        ax.scatter(x, [rows[g + (view,)]["first_steps_peak_mb"] for g in groups], marker="_",
                   s=300, color="black", label="first steps (bucket rebuild)" if k else None)
    ax.set_xticks([i + 0.2 for i in range(len(groups))],
                  [f"{impl}\nset_to_none={none}" for impl, none in groups], fontsize=8)
    s = result["setup"]
    ax.set(ylabel="peak MB beyond the model", title=f"{s['device']}, {s['backend']}, "
           f"{result['model']['gradient_mb']} MB of gradients, {result['counted']}")
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7, loc="lower right")


def report(result: dict) -> str:
    rows = [[r["impl"], r["gradient_as_bucket_view"], r["set_to_none"],
             r["first_steps_peak_mb"], r["steady_peak_mb"], r["end_mb"]]
            for r in result["memory"]]
    return harness.table(["DDP", "gradient_as_bucket_view", "set_to_none",
                          "peak MB, first steps", "peak MB, a steady step", "live at end MB"],
                         rows)


def main(argv=None) -> list[dict]:
    return harness.main("memory", __doc__, measure, plot, report, argv, parts=parts,
                        combine=combine)


if __name__ == "__main__":
    main()
