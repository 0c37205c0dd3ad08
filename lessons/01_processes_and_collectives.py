"""Lesson 01: processes, a process group, and the three collectives data parallelism is made of.

What this adds since lesson 00: more than one process, each running a copy of lesson 00's loop
(one per GPU on a GPU machine). The copies share no memory; they agree only through
*collectives*, calls that every process in a *process group* makes together:

* ``broadcast(t, src)``: every rank ends with ``src``'s tensor. DDP uses it when it wraps the
  model, so every replica begins from rank 0's weights (and for buffers such as batch-norm
  statistics, before each forward).
* ``all_reduce(t)``: every rank ends with the element-wise sum over all ranks. DDP uses it on
  every step, to turn each rank's gradient into the sum (then the mean) of all of them.
* ``all_gather(out, t)``: every rank ends with every rank's tensor, in rank order (to compare
  ranks; the output grows with their number).

A rank knows only its ``rank`` (0 .. world_size - 1) and the ``world_size``: all that makes one
copy differ from another. Each collective is checked against a value computed by hand, then timed.

Then all_reduce is written out by hand, as gloo does it on the CPU: a *ring*. Cut the buffer
into ``world_size`` chunks; in ``W - 1`` steps each rank sends one chunk to its left neighbour
and adds the one arriving from its right into its own (*reduce-scatter*: rank ``c`` ends with
chunk ``c`` summed); in ``W - 1`` more the finished chunks travel round (*all-gather*). Each rank
sends ``2 (W - 1) / W`` times the buffer, whatever ``W``: that is why the ring scales.
``ring_all_reduce`` (``isend``/``irecv`` only) equals ``dist.all_reduce`` exactly on integers, and
on floats at 2 ranks. At 3 it shows why float bits depend on where an element sits: each chunk is
summed in its own order, and with ``1.0`` on rank 0 and ``2**-24`` on the others the same three
numbers give ``1.0000001`` in chunk 0 and ``1.0`` elsewhere, by hand and in gloo's all_reduce.
That is why DDP must use torch's bucket layout to match torch's bits at 3 ranks (lessons 05, 08).

Ranks are forked by ``miniddp.launch.launch(fn, world_size)`` (the group formed through a file),
or started by ``torchrun``, which sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``... (lesson 12).

Run it:

    python lessons/01_processes_and_collectives.py              # forks 2 ranks, gloo on CPU
    python lessons/01_processes_and_collectives.py --nproc 4    # 4 ranks
    torchrun --standalone --nproc_per_node=2 lessons/01_processes_and_collectives.py

With N GPUs, ``--nproc N`` uses NCCL, one GPU per rank; with fewer GPUs than ranks, gloo on the
CPU (NCCL refuses two ranks on one GPU).

What you will see: how the ranks were started, each collective's result next to its check, a
table of costs (4 B measures latency, 4 MiB bandwidth), the ring by hand equal to all_reduce,
(on 3 ranks) each chunk's summation order and its bits, and ``OK: ...``. About 10 s.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from course.report import check, ok, print0
from miniddp.launch import launch, launched_by_torchrun, rank_device


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


def ring_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over the ranks in place, around a ring, with point-to-point messages only."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = list(t.tensor_split(world))  # views into t
    left, right = (rank - 1) % world, (rank + 1) % world
    for s in range(world - 1):  # reduce-scatter: afterwards rank c holds chunk c's sum
        send, add_into = chunks[(rank + 1 + s) % world], chunks[(rank + 2 + s) % world]
        arriving = torch.empty_like(add_into)
        for request in (dist.isend(send.clone(), left), dist.irecv(arriving, right)):
            request.wait()
        torch.add(add_into, arriving, out=add_into)  # mine + (what came from the right)
    for s in range(world - 1):  # all-gather: the summed chunks go round the ring
        send, overwrite = chunks[(rank + s) % world], chunks[(rank + 1 + s) % world]
        for request in (dist.isend(send.clone(), left), dist.irecv(overwrite, right)):
            request.wait()
    return t


def ring_by_hand(device):
    """The ring against gloo's all_reduce: exactly equal on integers, and on floats at 2 ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    for name, t in (("integers", torch.randint(-1000, 1000, (1000,), generator=g)),
                    ("floats", torch.randn(1000, generator=g))):
        t = t.to(device)
        theirs = t.clone()
        dist.all_reduce(theirs)
        mine = ring_all_reduce(t.clone())
        if name == "integers" or world == 2:
            check(torch.equal(mine, theirs), f"rank {rank}: the ring by hand gave other {name} "
                  f"than dist.all_reduce (max difference {(mine - theirs).abs().max().item()})")
            print0(f"ring by hand on 1000 {name:<8} -> equal to dist.all_reduce exactly")
        else:
            diff, scale = (mine - theirs).abs().max().item(), theirs.abs().max().item()
            check(diff <= 1e-6 * scale, f"rank {rank}: the ring by hand gave floats up to "
                  f"{diff:.3g} from dist.all_reduce's (values up to {scale:.3g}): more than "
                  "the rounding of another summation order")
            same = "equal to" if torch.equal(mine, theirs) else f"within {diff:.1e} of"
            print0(f"ring by hand on 1000 {name:<8} -> {same} dist.all_reduce (gloo also cuts "
                   "chunks into segments, so its order differs in places)")


def summation_order():
    """On 3+ ranks: one sum, three orders, and the bits depend on the chunk an element is in."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    values = [1.0] + [2.0**-24] * (world - 1)  # rank 0 holds 1.0, the others 2**-24
    t = torch.full((2 * world,), values[rank], device=device)  # 2 elements per chunk
    mine = ring_all_reduce(t.clone())
    theirs = t.clone()
    dist.all_reduce(theirs)
    print0(f"\n{world} ranks; rank 0 holds 1.0, the others 2**-24; every element sums the same "
           f"{world} numbers:")
    for c, part in enumerate(mine.tensor_split(world)):
        order = [(c + k) % world for k in range(world)]  # x_c + (x_c+1 + (... + x_c-1))
        by_hand, formula = torch.tensor(values[order[-1]]), f"x{order[-1]}"
        for r in reversed(order[:-1]):
            by_hand = torch.tensor(values[r]) + by_hand  # float32, innermost first
            formula = f"x{r} + " + (f"({formula})" if "+" in formula else formula)
        print0(f"  chunk {c}: {formula:<24} = {by_hand.item():.9f}; ring by hand gave "
               f"{part[0].item():.9f}")
        check(torch.equal(part, by_hand.to(device).expand_as(part)),
              f"rank {rank}: chunk {c} of the ring gave {part.tolist()}, expected {formula} = "
              f"{by_hand.item():.9f}")
    print0(f"  gloo's all_reduce, element by element: {[f'{v:.7f}' for v in theirs.tolist()]}")
    check(len(set(mine.tolist())) > 1 and len(set(theirs.tolist())) > 1,
          "the same numbers summed in other orders should give other bits in some chunks")
    return world


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
    ring_by_hand(device)
    if dist.get_world_size() >= 3:
        summation_order()
    return dist.get_world_size()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    args = parser.parse_args()
    world = launch(on_every_rank, args.nproc)[0]  # NCCL if each rank can have a GPU
    if world < 3 and not launched_by_torchrun():
        launch(summation_order, 3)  # the order only shows from 3 ranks on
    ring = ("equals all_reduce exactly, on integers and on floats" if world == 2 else
            "equals all_reduce exactly on integers, and on floats within rounding (another "
            "summation order)")
    ok(f"broadcast, all_reduce and all_gather matched the values computed by hand on {world} "
       f"ranks; the ring by hand {ring}, and its summation order explains the bits")


if __name__ == "__main__":
    main()
