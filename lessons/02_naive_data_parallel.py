"""Lesson 02: naive data parallelism, one process driving every replica, and why it is slow.

What this adds since lesson 01: the first way to put several devices to work on one batch,
``DataParallel`` (here ``miniddp.DataParallel``, a readable rebuild of
``torch.nn.DataParallel``). One Python process does everything, at every forward:

1. **scatter**: cut the batch into one chunk per replica (``torch.chunk``: 7 rows over 3 replicas
   give 3, 3 and 1);
2. **replicate**: copy the weights from the first device to every other one, *again, every step*;
3. **parallel apply**: run each replica on its chunk, each in its own thread;
4. **gather**: concatenate the outputs on the first device, where the loss is computed. In
   backward, every replica's gradient flows back into the one real module's ``.grad``.

Why it matters: it is the baseline that DistributedDataParallel replaced, and the reasons are
measurable. First the oracle: a DataParallel step must compute what the plain module computes
on the whole batch (lesson 00), to rounding: the gradient of a batch is the sum of the gradients
of its chunks, added in another order. Then the cost, measured side by side: milliseconds per
step for the plain module and for 1, 2 and 4 replicas, and the bytes of weights copied at every
forward (``dp.last_forward``), which the plain module, and DDP after its first broadcast, never
copy.

What the numbers on a CPU show: the replicas are threads on the CPU (``device_ids=["cpu",
"cpu"]``). Torch releases Python's global interpreter lock (GIL) inside each operation, but this
model's operations last microseconds and the Python between them holds the lock, so the threads
mostly take turns: DataParallel is slower than the plain module here, and slower with every
replica (one replica is the module itself, called directly: nothing to split, copy or gather).
That measures its overheads, not parallel compute; the times are shown, not checked.
On GPUs the replicas do compute at once, but the overheads stay and grow with the GPUs: weights
copied from GPU 0 every step, outputs, loss and gradients all meeting on GPU 0, and one thread
per GPU launching every kernel under one GIL. DDP (lesson 03 on) copies the weights once, runs
one process per GPU, and spreads communication evenly over them.

Run it:

    python lessons/02_naive_data_parallel.py     # replicas as CPU threads; the GPUs when present

One process only, by design: there is no torchrun command for this lesson (torchrun would start
N copies that each drive their own replicas).

What you will see: which thread ran which chunk on which device, the replica's outputs and
gradients next to the plain module's, the loss falling with DataParallel and its largest
difference from the plain module, a table of milliseconds per step and bytes copied per step
for 1, 2 and 4 replicas, and ``OK: ...``. About 10 s.
"""

import os
import statistics
import threading
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from course.data import make_dataset, make_model
from course.report import Progress, check, ok, print0
from miniddp import DataParallel

EPOCHS = 3
BATCH_SIZE = 64
LR = 0.2
REPLICAS = (1, 2, 4)
ROUNDS = 31  # timed steps per variant, taken in turns


def replica_devices(n: int) -> list:
    """``n`` replicas: on the GPUs (round-robin) when there are any, else CPU threads."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i % gpus}" for i in range(n)] if gpus else ["cpu"] * n


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()  # GPU work is asynchronous: wait before reading the clock


def one_forward(device):
    """Watch one forward: who ran which chunk, what was copied; compare with the plain module."""
    model = make_model(seed=0).to(device)
    dp = DataParallel(model, device_ids=replica_devices(3))
    x, y = (t.to(device) for t in make_dataset(n=7, seed=2).tensors)

    seen = []  # the hook runs in each replica's thread: replicas share the module's hooks
    hook = model.register_forward_pre_hook(lambda m, args: seen.append(
        (threading.current_thread().name, args[0].shape[0], str(args[0].device))))
    out = dp(x)
    hook.remove()
    F.mse_loss(out, y).backward()
    dp_grads = [p.grad.clone() for p in model.parameters()]

    print0(f"one forward of {len(x)} rows over {len(dp.device_ids)} replicas:")
    for thread, rows, where in sorted(seen):
        print0(f"  {thread:<22} ran {rows} rows on {where}")
    stats = dp.last_forward
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print0(f"  gathered output: {tuple(out.shape)} on {out.device}; weights copied this forward: "
           f"{stats.param_bytes_copied} bytes = {stats.replicas - 1} replicas x {param_bytes}")
    check(sorted(rows for _, rows, _ in seen) == [1, 3, 3],
          f"torch.chunk splits 7 rows into 3, 3 and 1, but the replicas saw {seen}")
    check(stats.param_bytes_copied == (stats.replicas - 1) * param_bytes,
          f"expected {(stats.replicas - 1) * param_bytes} bytes copied, "
          f"got {stats.param_bytes_copied}")

    model.zero_grad()
    plain_out = model(x)
    F.mse_loss(plain_out, y).backward()
    out_diff = (out - plain_out).abs().max().item()
    grad_diff = max((a - p.grad).abs().max().item() for a, p in zip(dp_grads, model.parameters()))
    print0(f"  vs the plain module on all 7 rows: output differs by {out_diff:.1e}, "
           f"gradients by {grad_diff:.1e}")
    check(out_diff < 1e-5 and grad_diff < 1e-5,
          "DataParallel must compute the plain module's output and gradients, to rounding")


def train(model, device, verbose=True):
    """Lesson 00's loop; ``model`` is the plain module or a DataParallel around one."""
    data = make_dataset(n=2048, seed=0)
    loader = DataLoader(data, batch_size=BATCH_SIZE, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    progress = Progress(EPOCHS * len(loader), every=16, quiet=not verbose)
    for _epoch in range(EPOCHS):
        for x, y in loader:
            loss = F.mse_loss(model(x.to(device)), y.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            progress(loss)
    return model, progress.losses()


def timings(device):
    """Milliseconds per training step, plain vs 1, 2, 4 replicas, in turns (A B C D A B C D)."""
    x, y = (t.to(device) for t in make_dataset(n=BATCH_SIZE, seed=0).tensors)
    variants = {"plain module": make_model(seed=0).to(device)}
    for n in REPLICAS:
        variants[f"DataParallel x{n}"] = DataParallel(make_model(seed=0).to(device),
                                                      device_ids=replica_devices(n))
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in variants.items()}
    times = {k: [] for k in variants}
    for round_ in range(ROUNDS + 2):  # the first two rounds warm up
        for name, model in variants.items():
            sync(device)
            start = time.perf_counter()
            loss = F.mse_loss(model(x), y)
            optimizers[name].zero_grad()
            loss.backward()
            optimizers[name].step()
            sync(device)
            if round_ >= 2:
                times[name].append(1000 * (time.perf_counter() - start))
    medians = {k: statistics.median(v) for k, v in times.items()}

    print0(f"\nwhy it is slow: one training step on a batch of {BATCH_SIZE} (median of "
           f"{ROUNDS}, variants in turns)")
    print0(f"{'':<17} {'ms/step':>8} {'vs plain':>9} {'weights copied/step':>20}")
    for name, model in variants.items():
        copied = model.last_forward.param_bytes_copied if name != "plain module" else 0
        print0(f"{name:<17} {medians[name]:8.2f} {medians[name] / medians['plain module']:8.1f}x "
               f"{copied:>14} bytes")
    return medians


def main():
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = f"{torch.cuda.device_count()} GPU(s)" if device == "cuda" else "CPU threads"
    print0(f"replicas run on {where}")
    one_forward(device)

    print0(f"\ntraining with DataParallel over {len(replica_devices(2))} replicas:")
    dp, losses = train(DataParallel(make_model(seed=0).to(device),
                                    device_ids=replica_devices(2)), device)
    plain, _ = train(make_model(seed=0).to(device), device, verbose=False)
    diff = max((p - q).abs().max().item()
               for p, q in zip(dp.module.parameters(), plain.parameters()))
    print0(f"largest weight difference from the plain module after training: {diff:.1e}")
    steps, copied = len(losses), dp.last_forward.param_bytes_copied
    print0(f"weights copied during training: {steps} steps x {copied} bytes = "
           f"{steps * copied} bytes (the plain module: none; DDP: one broadcast at the start)")
    check(losses[-1] < 0.1 * losses[0],
          f"the loss went from {losses[0]:.4f} to {losses[-1]:.4f}: not below 10% of its start")
    check(diff < 1e-4, f"DataParallel and the plain module ended {diff:.2e} apart")

    medians = timings(device)
    slowdown = medians["DataParallel x2"] / medians["plain module"]
    if slowdown <= 1:  # shown, not checked: a burst of load from other programs can do this
        print0(f"(on this run DataParallel x2 took {medians['DataParallel x2']:.2f} ms per step, "
               f"no more than the plain module's {medians['plain module']:.2f}: it does the same "
               "arithmetic plus threads,\ncopies, scatter and gather, so other programs' load "
               "must have hit the plain module's turns; run again)")
    if device == "cpu":
        print0(f"on this CPU the replicas are threads sharing {os.cpu_count()} cores under one "
               "GIL: the table shows\nDataParallel's overheads (threads, copies, scatter, gather), "
               "not parallel compute; for GPUs see the docstring")
    ok(f"DataParallel computed the plain module's steps (max difference {diff:.1e}) and took "
       f"{slowdown:.1f}x as long with 2 replicas, copying the weights every step")


if __name__ == "__main__":
    main()
