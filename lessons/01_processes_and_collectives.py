"""Lesson 01: processes, a process group, and the three collectives data parallelism is made of.

What this adds since lesson 00: more than one process. Data-parallel training runs one copy of
the lesson-00 loop per process (per GPU, on a GPU machine). The copies share nothing in memory;
they agree only through *collectives*, calls that every process in a *process group* makes
together:

* ``broadcast(t, src)``: every rank ends with ``src``'s tensor. DDP uses it when it wraps the
  model, so every replica begins from rank 0's weights (and for buffers such as batch-norm
  statistics, before each forward).
* ``all_reduce(t)``: every rank ends with the element-wise sum over all ranks. DDP uses it on
  every step, to turn each rank's gradient into the sum (then the mean) of all of them.
* ``all_gather(out, t)``: every rank ends with every rank's tensor, in rank order. Useful to
  compare ranks; the output grows with the number of ranks.

Each rank knows its ``rank`` (0 .. world_size - 1) and the ``world_size``; that is all that makes
one copy behave differently from another. Every collective below is checked against the value
computed by hand, then timed, next to the bytes a ring algorithm sends per rank.

Who starts the processes:

* ``miniddp.launch.launch(fn, world_size)`` forks them from this script and forms the group
  through a file in a temporary directory: no ports, no environment variables;
* ``torchrun`` starts them itself and tells each one ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR`` and ``MASTER_PORT``; ``launch`` sees those and joins that group instead.
  torchrun is what scales to many machines (lesson 12).

Run it:

    python lessons/01_processes_and_collectives.py              # forks 2 ranks, gloo on CPU
    python lessons/01_processes_and_collectives.py --nproc 4    # 4 ranks
    torchrun --standalone --nproc_per_node=2 lessons/01_processes_and_collectives.py

On a machine with N GPUs, ``--nproc N`` (or ``torchrun --standalone --nproc_per_node=N``) uses
NCCL, one GPU per rank. With fewer GPUs than ranks it falls back to gloo on the CPU, because NCCL
refuses two ranks on one GPU.

What you will see: how the ranks were started and their process ids, the result of each
collective with the value it was checked against, a small table of costs (a 4-byte call measures
latency, a 4 MiB call bandwidth), and ``OK: ...``. A few seconds.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from miniddp.launch import launch, launched_by_torchrun, rank_device
from miniddp.report import check, ok, print0


def meet_the_group(device):
    """Every rank is a separate process with its own pid; the group connects them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if launched_by_torchrun():
        started = (f"torchrun (RANK={os.environ['RANK']}, LOCAL_RANK={os.environ['LOCAL_RANK']}, "
                   f"MASTER_ADDR:PORT={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']})")
    else:
        started = "miniddp.launch (forked from this script)"
    print0(f"{world} ranks started by {started}")
    print0(f"backend {dist.get_backend()}, tensors on {device}, pids by rank: {pids}")
    check(len(set(pids)) == world, f"rank {rank}: expected {world} distinct processes, got {pids}")


def broadcast(device):
    rank = dist.get_rank()
    expected = torch.tensor([0.0, 10.0, 20.0, 30.0], device=device)
    t = expected.clone() if rank == 0 else torch.zeros(4, device=device)
    dist.broadcast(t, src=0)
    print0(f"broadcast  from rank 0      -> every rank holds {t.tolist()}")
    check(torch.equal(t, expected), f"rank {rank}: broadcast gave {t.tolist()}, "
                                    f"expected rank 0's {expected.tolist()}")


def all_reduce(device):
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((3,), float(rank + 1), device=device)  # rank r contributes r + 1
    dist.all_reduce(t)  # the default op is SUM
    by_hand = sum(r + 1 for r in range(world))
    print0(f"all_reduce of rank + 1     -> every rank holds {t[0].item():g} "
           f"= {' + '.join(str(r + 1) for r in range(world))}; / {world} ranks = mean "
           f"{t[0].item() / world:g}")
    check(torch.equal(t, torch.full((3,), float(by_hand), device=device)),
          f"rank {rank}: all_reduce gave {t.tolist()}, expected {by_hand} everywhere")


def all_gather(device):
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor([float(rank), float(rank * rank)], device=device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    gathered = torch.stack(out)
    by_hand = torch.tensor([[float(r), float(r * r)] for r in range(world)], device=device)
    print0(f"all_gather of [rank, rank²] -> every rank holds {gathered.tolist()}")
    check(torch.equal(gathered, by_hand),
          f"rank {rank}: all_gather gave {gathered.tolist()}, expected {by_hand.tolist()}")


def median_ms(device, call, *args, reps: int = 10) -> float:
    """Median wall time of ``call(*args)`` on this rank, after two warm-up calls."""
    times = []
    for i in range(reps + 2):
        start = time.perf_counter()
        call(*args)
        if device.type == "cuda":
            torch.cuda.synchronize()  # GPU collectives return before the data has moved
        if i >= 2:
            times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def costs(device):
    """Time each collective at 4 bytes (latency) and at 4 MiB (bandwidth)."""
    world, n = dist.get_world_size(), 4 * 2**20
    collectives = [  # name, the call, and what each rank sends with a ring algorithm
        ("broadcast", lambda t, out: dist.broadcast(t, src=0), "n", n),
        ("all_reduce", lambda t, out: dist.all_reduce(t), "2(W-1)/W * n",
         2 * (world - 1) / world * n),
        ("all_gather", lambda t, out: dist.all_gather(out, t), "(W-1) * n", (world - 1) * n),
    ]
    print0(f"\n{'collective':<11} {'sent per rank':>14} {'4 B':>9} {'4 MiB':>9} {'4 MiB sent':>11}")
    for name, call, formula, sent in collectives:
        row = []
        for numel in (1, n // 4):
            t = torch.ones(numel, device=device)
            row.append(median_ms(device, call, t, [torch.empty_like(t) for _ in range(world)]))
        print0(f"{name:<11} {formula:>14} {row[0]:7.3f}ms {row[1]:7.3f}ms {sent / 2**20:8.1f}MiB")
    print0("(median of 10 calls on rank 0; the 4 B column is pure latency, and it is paid on "
           "every call,\nhowever small: lesson 05 is about paying it less often)\n")


def on_every_rank():
    """The body each rank runs; ``launch`` has already put it in a process group."""
    device = rank_device()
    meet_the_group(device)
    broadcast(device)
    all_reduce(device)
    all_gather(device)
    costs(device)
    return dist.get_world_size()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    args = parser.parse_args()
    world = launch(on_every_rank, args.nproc)[0]  # NCCL if each rank can have a GPU
    ok(f"broadcast, all_reduce and all_gather matched the values computed by hand on {world} "
       f"ranks")


if __name__ == "__main__":
    main()
