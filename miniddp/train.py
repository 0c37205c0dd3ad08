"""The reference training job: DDP, a sharded sampler, snapshots, and a resume that changes nothing.

A student network learns the synthetic teacher task of ``miniddp.data`` with miniddp's
``DistributedDataParallel`` and ``DistributedSampler``. Kill it at any moment and start it
again: it goes on from its last snapshot, and the final weights are the same, bit for bit, as
those of a run that was never interrupted. What that takes:

* the snapshot holds the model, Adam's state, the epoch, the step, the sampler's position inside
  the epoch and every rank's random generators (``miniddp.checkpoint``);
* the data order is a pure function of (seed, epoch): the sampler shuffles with ``seed + epoch``;
* the global random generator is used by the training step alone (each rank adds its own input
  noise). ``iter(DataLoader)`` draws a seed from the global generator unless it has a generator of
  its own; it gets one here, or a resumed epoch would shift every later draw by one;
* snapshots are written atomically by rank 0 while the other ranks wait, so a kill mid-write
  leaves the previous one.

Run it:

    python -m miniddp.train --nproc 2 --snapshot /tmp/snap.pt --out /tmp/model.pt
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

For the fault tests: ``--pid-dir`` makes each rank write its pid to ``DIR/rank<R>.pid``;
``--fault KIND:RANK:STEP`` makes rank RANK, at step STEP, ``raise``, ``hang`` (sleep instead of
taking part) or ``exit`` (die without a word); under torchrun only in the first attempt, so a
restarted job gets past it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from miniddp import checkpoint
from miniddp.data import make_dataset, make_model
from miniddp.ddp import DistributedDataParallel
from miniddp.launch import (
    CollectiveFailed,
    RankError,
    collective,
    join_torchrun_group,
    launch,
    launched_by_torchrun,
    leave_group,
    rank_device,
)
from miniddp.report import mean_over_ranks, print0
from miniddp.sampler import DistributedSampler

LR = 3e-3
NOISE = 0.05  # std of the noise each rank adds to its inputs: the job's use of the global RNG
PEER_GRACE = 3.0  # seconds a rank whose peer vanished waits, so the peer's error is seen first


def parse_fault(text: str) -> tuple[str, int, int]:
    kind, rank, step = text.split(":")
    if kind not in ("raise", "hang", "exit"):
        raise argparse.ArgumentTypeError(f"fault kind must be raise, hang or exit, not {kind!r}")
    return kind, int(rank), int(step)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m miniddp.train", description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--dataset-size", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--save-every", type=int, default=1, help="snapshot every N epochs")
    p.add_argument("--save-every-steps", type=int, default=0,
                   help="also snapshot every N steps, mid-epoch included (0: never)")
    p.add_argument("--snapshot", help="snapshot file: resumed from when it exists")
    p.add_argument("--out", help="rank 0 writes the final model state dict here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    p.add_argument("--nproc", type=int, default=2, help="ranks to start (without torchrun)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="process-group timeout in seconds: how long a collective waits for a "
                        "rank that does not join it")
    p.add_argument("--pid-dir", help="write each rank's pid to DIR/rank<R>.pid")
    p.add_argument("--fault", type=parse_fault, metavar="KIND:RANK:STEP",
                   help="inject a fault: raise, hang or exit on rank RANK at step STEP")
    args = p.parse_args(argv)
    for name in ("epochs", "dataset_size", "batch_size", "save_every", "nproc"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def _write_pid_file(directory: str, rank: int) -> None:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank{rank}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()}\n")
    os.replace(path + ".tmp", path)  # a reader never sees a half-written pid


def _inject_fault(fault, rank: int, step: int) -> None:
    """Fire ``--fault`` once: in the first attempt, not again when torchrun restarts the job."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if fault is None or fault[1:] != (rank, step) or not first_attempt:
        return
    kind = fault[0]
    if kind == "raise":
        raise RuntimeError(f"injected fault: rank {rank} raises at step {step}")
    if kind == "hang":
        time.sleep(24 * 3600)  # alive, but never joins the next collective
    os._exit(3)


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
        _write_pid_file(args.pid_dir, rank)

    dataset = make_dataset(args.dataset_size, seed=args.seed)
    sampler = DistributedSampler(dataset, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        generator=torch.Generator())  # keeps iter(loader) off the global RNG
    model = make_model(seed=args.seed).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    torch.manual_seed(args.seed * 100_003 + rank)  # each rank its own noise

    epoch = step = 0
    with collective("checking that every rank sees the same snapshot", args.timeout):
        resume = _agree_on_snapshot(args.snapshot)
    if resume:
        snapshot = checkpoint.load(args.snapshot, model, optimizer, sampler)
        epoch, step = snapshot["epoch"], snapshot["step"]
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        print0(f"resuming from {args.snapshot}: epoch {epoch}, step {step}, "
               f"{sampler.state_dict()['consumed']}/{sampler.num_samples} of the epoch's samples "
               "done on each rank" + (f" (torchrun restart {restart})" if restart else ""))
    else:
        print0(f"starting from scratch: {world_size} ranks, backend {dist.get_backend()}, "
               f"{args.epochs} epochs of {len(dataset)} samples, batch {args.batch_size} per rank"
               + ("" if args.snapshot else "; no --snapshot, so nothing to resume from"))
    with collective("DDP's construction (shape check and broadcast from rank 0)", args.timeout):
        ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None,
                                      bucket_cap_mb=args.bucket_cap_mb)

    every = args.save_every_steps
    while epoch < args.epochs:
        sampler.set_epoch(epoch)  # the epoch a snapshot stopped in keeps its position
        batches = len(loader)  # before iter(): after a resume, only what is left of the epoch
        seen, losses, start = 0, [], time.perf_counter()
        for i, (x, y) in enumerate(loader):
            _inject_fault(args.fault, rank, step)
            x, y = x.to(device), y.to(device)
            x = x + NOISE * torch.randn_like(x)
            with collective(f"step {step}: DDP's forward and the gradient all_reduce in "
                            "backward", args.timeout):
                loss = F.mse_loss(ddp(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            optimizer.step()
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
    if args.out and rank == 0:
        checkpoint.write_atomic(checkpoint.model_state(ddp), args.out)
        print0(f"final model state dict written to {args.out}")
    return {"steps": step, "held_out_loss": held_out_loss}


def _run_under_torchrun(args) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    @record  # torchrun's summary then shows this rank's traceback, not only its exit code
    def run():
        backend = None if args.backend == "auto" else args.backend
        join_torchrun_group(backend, args.timeout)
        try:
            train(args)
        finally:
            leave_group()

    run()


def main(argv=None) -> int:
    args = parse_args(argv)
    if launched_by_torchrun():
        _run_under_torchrun(args)
        return 0
    backend = None if args.backend == "auto" else args.backend
    try:
        launch(train, world_size=args.nproc, args=(args,), backend=backend,
               timeout=None, pg_timeout=args.timeout)
    except RankError as error:
        print(f"miniddp.train failed: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
