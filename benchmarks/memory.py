"""Memory: peak bytes allocated by DDP training steps, with and without gradient_as_bucket_view.

For miniddp and torch's DDP, each with ``gradient_as_bucket_view`` off and on, and zeroing
gradients both ways (``zero_grad(set_to_none=True)``, torch's default, and ``False``): wrap a
copy of the model, then run three training steps (the second rebuilds the buckets) and then one
more, a steady step. The peak of each part is measured from just before the wrapping, so the
model's own parameters are not counted and the buckets are:

* on GPU: ``torch.cuda.max_memory_allocated()`` minus what was allocated before;
* on CPU (Linux): the process's peak resident memory (``VmHWM``, reset through
  ``/proc/self/clear_refs`` first) minus its resident memory before. tracemalloc would see none
  of torch's memory, and RSS alone lags behind frees because glibc keeps freed blocks; so blocks
  of 64 KiB and more are set to be mmapped (``mallopt``), which returns them to the system as
  soon as they are freed. It counts every thread's memory, gloo's buffers included. (torch's
  profiler with ``profile_memory=True`` was tried and dropped: frees made on gloo's threads are
  not reported to it, so its total drifted from run to run.)

Without the option a gradient lives twice, in ``.grad`` and in its bucket; with it ``.grad`` is a
view of the bucket. Both DDPs must end with bit-identical parameters.

    python benchmarks/memory.py           # no GPU: gloo, 2 CPU ranks, under a minute
    python benchmarks/memory.py --quick   # smoke run, seconds
"""

from __future__ import annotations

import copy
import ctypes
import gc

import harness
import torch
import torch.distributed as dist
from harness import Trainer, check
from torch import nn

import miniddp
from miniddp.train.report import print0

CONFIGS = [(impl, view, none) for impl in ("miniddp", "torch") for view in (False, True)
           for none in (True, False)]
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
    for _ in range(STEPS):
        trainer.step()
    first = meter.peak()
    meter.reset_peak()
    trainer.step()
    return {"first_steps_peak_mb": first, "steady_peak_mb": meter.peak(), "end_mb": meter.now()}


def measure(setup: harness.Setup) -> dict:
    device = harness.rank_device(setup)
    if device.type == "cpu":
        mmap_large_blocks()
    base = harness.make_model(setup, device)
    batches = harness.make_batches(setup, device, dist.get_rank())
    classes = {"miniddp": miniddp.DistributedDataParallel,
               "torch": nn.parallel.DistributedDataParallel}
    for cls in classes.values():  # unmeasured: the first run pays one-off costs (~15 MB)
        train(cls, copy.deepcopy(base), batches, device, False, True)
    finals, rows = {}, []
    for n, (impl, view, none) in enumerate(CONFIGS, 1):
        model = copy.deepcopy(base)
        gc.collect()  # the previous DDP's buffers must not be freed inside this measurement
        figures = train(classes[impl], model, batches, device, view, none)
        finals[impl, view, none] = model
        rows.append({"impl": impl, "gradient_as_bucket_view": view, "set_to_none": none,
                     **figures})
        print0(f"  ({n}/{len(CONFIGS)}) {impl}, gradient_as_bucket_view={view}, "
               f"set_to_none={none}: peak {figures['first_steps_peak_mb']:.1f} MB in the "
               f"first steps, {figures['steady_peak_mb']:.1f} MB in a later one")
    for view in (False, True):
        for none in (True, False):
            check(harness.same_bits(finals["miniddp", view, none], finals["torch", view, none],
                                    device),
                  f"gradient_as_bucket_view={view}, set_to_none={none}: parameters differ")
    return {"model": harness.model_info(base), "batch_per_rank": len(batches[0][0]),
            **harness.rank_facts(device), "steps": STEPS + 1, "bit_identical": True,
            "counted": "cuda.max_memory_allocated" if device.type == "cuda"
            else "peak RSS (VmHWM)", "memory": rows}


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
    return harness.main("memory", __doc__, measure, plot, report, argv)


if __name__ == "__main__":
    main()
