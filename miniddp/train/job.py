"""The reference training job: DDP, a sharded sampler, snapshots, and a resume that changes nothing.

A student network learns the synthetic teacher task of ``miniddp.train.data`` with miniddp's
``DistributedDataParallel`` and ``DistributedSampler``. Kill it at any moment and start it
again: it goes on from its last snapshot, and the final weights are the same, bit for bit, as
those of a run that was never interrupted. What that takes:

* the snapshot holds the model, Adam's state, the epoch, the step, the sampler's position inside
  the epoch and every rank's random generators (``miniddp.train.checkpoint``);
* with ``--zero``, Adam's state is sharded over the ranks (``miniddp.ZeroRedundancyOptimizer``,
  ZeRO stage 1): each rank keeps the moments of its share of the parameters. The snapshot still
  holds the whole state (gathered on rank 0), in the layout plain Adam uses, so a run resumes
  with or without ``--zero`` and at another number of ranks;
* the data order is a pure function of (seed, epoch): the sampler shuffles with ``seed + epoch``;
* the global random generator is used by the training step alone (each rank adds its own input
  noise). ``iter(DataLoader)`` draws a seed from the global generator unless it has a generator of
  its own; it gets one here, or a resumed epoch would shift every later draw by one;
* snapshots are written atomically by rank 0 while the other ranks wait, so a kill mid-write
  leaves the previous one.

Run it:

    python -m miniddp.train --nproc 2 --snapshot /tmp/snap.pt --out /tmp/model.pt
    python -m miniddp.train --nproc 2 --zero --snapshot /tmp/snap.pt   # Adam's state sharded
    torchrun --standalone --nproc_per_node=2 -m miniddp.train --snapshot /tmp/snap.pt
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 -m miniddp.train \\
        --snapshot /tmp/snap.pt --save-every-steps 20

    # two machines (or two terminals), the same command on each; the snapshot path must be on a
    # file system both can read:
    torchrun --nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 \\
        --rdzv-id=job1 -m miniddp.train --snapshot /shared/snap.pt

Under ``--max-restarts`` torchrun restarts every worker when one dies, and each resumes from the
snapshot. The restarted workers get a fresh namespace in torchrun's rendezvous store (keyed by
``TORCHELASTIC_RESTART_COUNT``): on gloo they would otherwise read the dead workers' addresses
from the previous attempt and hang or fail (pytorch issue 135712). That key is only consistent
on one node; for restarts across nodes set ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for torchrun.

What you will see: where it starts (or resumes) from, one line per epoch (step, loss averaged over
ranks, samples per second), the held-out loss at the end. Bit-identity across a resume holds for
2 ranks; with 3 or more, gloo's sum depends on the bucket layout, which DDP rebuilds after its
first step, so the first step after a resume may differ in the last bits.

**Resuming with another number of ranks** (a node lost, torchrun's elastic ``--nnodes=1:4``)
works: the samples of the interrupted epoch that no rank had reached are dealt over the new
ranks, each used exactly once; rank r continues saved rank r's random generators where there
was one, and a new rank starts from its seed. The job says so in one line, and that from there
the run is no longer bit-identical to an uninterrupted one: the per-rank batches, the order in
which gradients are summed and the random streams all differ.

Before the first step every output path is tried (``miniddp.train.job_files``): a ``--out`` or
``--snapshot`` that cannot be written stops the job at once, named. Should the final write fail
anyway, the model is written beside the snapshot or in the temporary directory, and the job
says where. While it runs, the job holds ``<snapshot>.lock``: a second job given the same
``--snapshot`` is refused, naming the holder. The snapshot it replaces stays as ``NAME.prev``.
Ctrl-C, SIGTERM and SIGHUP stop it with one line saying where the last snapshot is.

For the fault tests: ``--fault`` and ``--pid-dir`` (``miniddp.train.faults``).

One module because it is one job, read top to bottom: its arguments, its training loop
and the ways it is started. What a snapshot holds
(``checkpoint``), the output paths (``job_files``), the data (``data``) and the faults
(``faults``) live apart.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from miniddp.ddp import DistributedDataParallel
from miniddp.launch import (
    CollectiveFailed,
    RankError,
    Stopped,
    collective,
    join_torchrun_group,
    launch,
    launched_by_torchrun,
    leave_group,
    rank_device,
    stop_on_signals,
)
from miniddp.sampler import DistributedSampler, EqualBatchCount
from miniddp.train import checkpoint
from miniddp.train.data import make_dataset, make_model
from miniddp.train.faults import inject_fault, parse_fault, write_pid_file
from miniddp.train.job_files import JobFileError, last_snapshot, prepare, write_final_model
from miniddp.train.report import mean_over_ranks, print0

LR = 3e-3
NOISE = 0.05  # std of the noise each rank adds to its inputs: the job's use of the global RNG
PEER_GRACE = 3.0  # seconds a rank whose peer vanished waits, so the peer's error is seen first


def _number(convert, least: float, what: str, or_equal: bool = False):
    """An argparse type: a finite number above ``least`` (or equal to it, with ``or_equal``;
    ``inf`` and ``nan`` are numbers too)."""
    def parse(text: str):
        value = convert(text)
        if not (math.isfinite(value) and (value >= least if or_equal else value > least)):
            raise argparse.ArgumentTypeError(f"must be {what}, not {text}")
        return value
    parse.__name__ = convert.__name__  # argparse's "invalid float value: 'x'"
    return parse


RESUME_HELP = """resuming: run the same command again with the same --snapshot. With another
--nproc (or torchrun size) than the run that saved, the rest of the interrupted epoch is dealt
over the new ranks, each sample once; the run then goes on correctly but not bit for bit as an
uninterrupted one would.

consistency: --check-every N compares every rank's step each synchronized step and a checksum
of every parameter every N steps, and stops every rank, naming the ranks and parameters, if the
replicas drift apart or fall out of step (TORCH_DISTRIBUTED_DEBUG=INFO does the same with
N=100, =DETAIL also compares each collective before it is launched;
miniddp/checks/consistency.py)."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m miniddp.train", description=__doc__.split("\n")[0],
                                epilog=RESUME_HELP)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--dataset-size", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--save-every", type=int, default=1, help="snapshot every N epochs")
    p.add_argument("--save-every-steps", type=_number(int, -1, "0 (never) or more"),
                   default=0,
                   help="also snapshot every N steps, mid-epoch included (0: never)")
    p.add_argument("--snapshot", help="snapshot file: resumed from when it exists, at any number "
                                      "of ranks; locked (FILE.lock) while the job runs")
    p.add_argument("--out", help="rank 0 writes the final model state dict here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: NCCL when every rank gets a GPU of its own, else gloo")
    p.add_argument("--bucket-cap-mb", default=None, type=_number(
        float, 0, "a size in MB, 0 or more (0: each parameter its own bucket; for a single "
                  "bucket, one above the model's size)", or_equal=True),
        help="DDP's bucket_cap_mb (default: DDP's 25; 0: each parameter its own bucket)")
    p.add_argument("--nproc", type=int, default=2, help="ranks to start (without torchrun)")
    p.add_argument("--timeout", type=_number(float, 0, "a number of seconds above 0"),
                   default=60.0,
                   help="process-group timeout in seconds: how long a collective waits for a "
                        "rank that does not join it")
    p.add_argument("--check-every", type=_number(int, 0, "a number of steps, 1 or more"),
                   metavar="N", help="check that the replicas agree every N steps (see below)")
    p.add_argument("--zero", action="store_true",
                   help="shard Adam's state over the ranks (ZeRO stage 1)")
    p.add_argument("--pid-dir", help="write each rank's pid to DIR/rank<R>.pid")
    p.add_argument("--fault", type=parse_fault, metavar="KIND:RANK:STEP",
                   help="inject a fault: raise, hang, exit or drift on rank RANK at step STEP")
    args = p.parse_args(argv)
    for name in ("epochs", "dataset_size", "batch_size", "save_every", "nproc"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def _agree_on_snapshot(path: str | None) -> bool:
    """Every rank must resume from the same snapshot, or none: check, rather than diverge."""
    found = path is not None and os.path.exists(path)
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (found, socket.gethostname()))
    if len({f for f, _ in views}) > 1:
        seen = ", ".join(f"rank {r} on {host}: {'found' if f else 'missing'}"
                         for r, (f, host) in enumerate(views))
        raise RuntimeError(f"the ranks disagree on whether {path} exists ({seen}). Put "
                           "--snapshot on a file system that every node shares.")
    return found


def train(args) -> dict:
    """One rank's training run (every rank calls it, inside a process group)."""
    try:
        return _train(args)
    except CollectiveFailed as error:
        if error.peer_gone:  # that peer's own failure is the news: let its launcher see it first
            time.sleep(PEER_GRACE)
        raise


def _save(args, model, optimizer, sampler, epoch, step, trained=None) -> None:
    with collective(f"the snapshot at step {step} (gather, then barrier)", args.timeout):
        checkpoint.save(args.snapshot, model, optimizer, sampler, epoch=epoch, step=step,
                        trained=trained, extra={"seed": args.seed})


def _train(args) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    if args.pid_dir:
        write_pid_file(args.pid_dir, rank)

    dataset = make_dataset(args.dataset_size, seed=args.seed)
    sampler = DistributedSampler(dataset, seed=args.seed)
    loader = DataLoader(dataset, batch_sampler=EqualBatchCount(sampler, args.batch_size),
                        generator=torch.Generator())  # keeps iter(loader) off the global RNG
    model = make_model(seed=args.seed).to(device)
    if args.zero:  # every rank checks that the others hold the same parameters
        from miniddp.optim import ZeroRedundancyOptimizer  # here only: ~0.6 s of torch's imports

        with collective("the sharded optimizer's construction", args.timeout):
            optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=LR)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    torch.manual_seed(args.seed * 100_003 + rank)  # each rank its own noise

    epoch = step = 0
    with collective("checking that every rank sees the same snapshot", args.timeout):
        resume = _agree_on_snapshot(args.snapshot)
    if resume:
        snapshot = checkpoint.load(args.snapshot, model, optimizer, sampler, resize=True)
        epoch, step = snapshot["epoch"], snapshot["step"]
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        done = sampler.state_dict()["consumed"]
        where = (f"{done}/{done + len(sampler)} of the epoch's samples done on each rank"
                 if len(snapshot["rng"]) == world_size else
                 _resized(len(snapshot["rng"]), world_size, sampler, epoch, args.epochs))
        print0(f"resuming from {args.snapshot}: epoch {epoch}, step {step}, {where}"
               + (f" (torchrun restart {restart})" if restart not in (None, "0") else ""))
    else:
        print0(f"starting from scratch: {world_size} ranks, backend {dist.get_backend()}, "
               f"{args.epochs} epochs of {len(dataset)} samples, batch {args.batch_size} per rank"
               + (", Adam's state sharded (ZeRO-1)" if args.zero else "")
               + ("" if args.snapshot else "; no --snapshot, so nothing to resume from"))
    with collective("DDP's construction (shape check and broadcast from rank 0)", args.timeout):
        ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                      bucket_cap_mb=args.bucket_cap_mb)
    if args.check_every:
        ddp.check_every(args.check_every)

    every = args.save_every_steps
    while epoch < args.epochs:
        sampler.set_epoch(epoch)  # the epoch a snapshot stopped in keeps its position
        batches = len(loader)  # before iter(): after a resume, only what is left of the epoch
        seen, losses, start = 0, [], time.perf_counter()
        for i, (x, y) in enumerate(loader):
            inject_fault(args.fault, rank, step, ddp.module)
            x, y = x.to(device), y.to(device)
            x = x + NOISE * torch.randn_like(x)
            with collective(f"step {step}: DDP's forward and the gradient all_reduce in "
                            "backward", args.timeout):
                loss = F.mse_loss(ddp(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            with collective(f"step {step}: the optimizer step", args.timeout):
                optimizer.step()  # with --zero: each rank's share, then broadcasts
            step, seen = step + 1, seen + len(x)
            losses.append(loss.detach())
            if args.snapshot and every and step % every == 0 and i + 1 < batches:
                _save(args, ddp, optimizer, sampler, epoch, step, trained=seen)
        epoch += 1
        elapsed = time.perf_counter() - start
        with collective(f"averaging epoch {epoch}'s loss over ranks", args.timeout):
            loss = mean_over_ranks(torch.stack(losses).mean()) if losses else float("nan")
        due = epoch % args.save_every == 0 or epoch == args.epochs or (every and step % every == 0)
        if args.snapshot and due:
            _save(args, ddp, optimizer, sampler, epoch, step)
        print0(f"epoch {epoch:>3}/{args.epochs} | step {step:>6} | loss {loss:.6f} | "
               f"{world_size * seen / elapsed:9,.0f} samples/s" + (" | snapshot" if due and
                                                                    args.snapshot else ""))

    held_out = make_dataset(1024, seed=args.seed + 1)
    with torch.no_grad():
        x, y = held_out.tensors
        held_out_loss = F.mse_loss(model(x.to(device)), y.to(device)).item()
    print0(f"done: {step} steps, held-out loss {held_out_loss:.6f}")
    rescued = None
    if args.out and rank == 0:
        written = write_final_model(checkpoint.model_state(ddp), args.out, args.snapshot)
        print0(f"final model state dict written to {written}")
        rescued = None if written == Path(args.out).absolute() else str(written)
    return {"steps": step, "held_out_loss": held_out_loss, "rescued": rescued}


def _resized(saved_by: int, world_size: int, sampler, epoch: int, epochs: int) -> str:
    """The one line that says what resuming at another world size changes."""
    state = sampler.state_dict()
    if epoch >= epochs:
        rest = "every epoch is done"
    elif state["epoch"] != epoch:  # saved at the end of an epoch: the next starts afresh
        rest = f"epoch {epoch} is dealt over the {world_size} ranks from its start"
    else:
        rest = (f"the {state['end'] - state['begin']} samples of epoch {epoch} that no rank had "
                f"reached are dealt over the {world_size} ranks, each used once")
    kept = list(range(min(saved_by, world_size)))
    fresh = list(range(saved_by, world_size))
    return (f"saved by {saved_by} ranks, resumed by {world_size}: {rest}; ranks {kept} continue "
            "the saved ranks' random generators" + (f", ranks {fresh} start from their seeds"
                                                    if fresh else "") +
            ". From here the run is NOT bit-identical to an uninterrupted one: the per-rank "
            "batches, the order in which gradients are summed and the random streams differ.")


def _run_under_torchrun(args) -> int:
    from torch.distributed.elastic.multiprocessing.errors import record

    @record  # torchrun's summary then shows this rank's traceback, not only its exit code
    def run():
        backend = None if args.backend == "auto" else args.backend
        join_torchrun_group(backend, args.timeout)
        try:
            return train(args)
        finally:
            leave_group()

    return 1 if run()["rescued"] else 0  # the model is safe, but not where --out asked


def main(argv=None) -> int:
    args = parse_args(argv)
    torchrun = launched_by_torchrun()
    rank0 = not torchrun or os.environ["RANK"] == "0"  # the launcher, or torchrun's rank 0
    try:
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if torchrun else args.nproc
        lock = prepare(args.out, args.snapshot, holds_lock=rank0,
                       nccl_ranks=ranks_here if args.backend == "nccl" else 0)
    except JobFileError as error:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        again = (f" (torchrun restart {restart}: restarting cannot fix this; stop the job and "
                 "fix the command)" if restart else "")
        print(f"miniddp.train: {error}{again}", file=sys.stderr, flush=True)
        return 2
    backend = None if args.backend == "auto" else args.backend
    try:
        if torchrun:  # torchrun's agent owns the signals: SIGTERM from it must kill at once
            return _run_under_torchrun(args)
        with stop_on_signals():
            results = launch(train, world_size=args.nproc, args=(args,), backend=backend,
                             timeout=None, pg_timeout=args.timeout)
    except RankError as error:
        print(f"miniddp.train failed: {error}", file=sys.stderr, flush=True)
        return 1
    except (KeyboardInterrupt, Stopped) as stop:
        how = "Ctrl-C" if isinstance(stop, KeyboardInterrupt) else stop.signal.name
        if rank0:
            print(f"miniddp.train: stopped by {how}; {last_snapshot(args.snapshot)}.",
                  file=sys.stderr, flush=True)
        return 130 if isinstance(stop, KeyboardInterrupt) else stop.code
    finally:
        if lock is not None:
            lock.release()
    return 1 if results[0]["rescued"] else 0


if __name__ == "__main__":
    sys.exit(main())
