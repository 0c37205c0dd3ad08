"""Lesson 09: checkpoints and restarts: a job killed mid-run goes on as if nothing happened.

What this adds since lesson 08: survival. A job on many machines fails sooner or later. Without
a snapshot everything is lost; with a careless one the job resumes *differently*. Here a worker
is SIGKILLed mid-run, torchrun restarts the job, and its final weights are bit-identical to
those of a run that was never interrupted.

What a snapshot needs, each shown and checked:

* **rank 0 writes, atomically.** All replicas hold the same weights, so one copy is enough.
  ``torch.save(obj, path)`` empties the file as it opens it: a crash mid-write loses even the
  previous snapshot. ``miniddp.train.checkpoint.write_atomic`` writes a temporary file, fsyncs,
  ``os.replace``-s it in and fsyncs the directory; ``checkpoint.save`` then holds every rank at
  a barrier until the snapshot is on disk. A writer is killed halfway both ways.
* **the ``module.`` prefix.** A DDP's ``state_dict()`` keys start with ``module.``, the bare
  model's do not, and ``load_state_dict`` refuses one in the other; ``checkpoint`` takes either.
* **everything that decides the future**: weights, the optimizer's state, epoch and step, the
  sampler's position *inside* the epoch (torch's sampler has none: it replays the epoch), and
  every rank's random generators. Three controls resume without one each and end elsewhere.
* **restarts under torchrun** (``--max-restarts``): every worker starts again from the top and
  finds the snapshot. On gloo, restarted workers can read the dead ones' keys in the agent's
  store and hang (pytorch issue 135712); ``miniddp.launch.join_torchrun_group`` gives each
  attempt a fresh ``PrefixStore`` (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` works too).

Run it:

    python lessons/09_checkpoints_and_restarts.py     # starts torchrun itself, with a restart
    torchrun --standalone --nproc_per_node=2 lessons/09_checkpoints_and_restarts.py

Run plainly, it starts one torchrun agent with ``--max-restarts=1``; rank 1 SIGKILLs itself at
step 45 (the last snapshot was at step 40, mid-epoch), the agent stops rank 0 and restarts both,
and they resume and finish. Under your own torchrun without restarts each worker plays the crash
itself: it stops at step 45, drops everything and resumes. At 3 ranks and more the first step
after a resume may differ in the last bits (the buckets are rebuilt: lesson 08).

What you should see: the naive file gone and the atomic one intact after a killed writer; the
prefix refused, then loaded both ways; the loss falling, a snapshot every 10 steps; rank 1
killed and torchrun's restart; the resume in epoch 3 of 4 after step 40; the same weights as an
uninterrupted run bit for bit; the three controls differing; ``OK: ...``. About 25 s, most of it
processes starting (the SGD is written out: torch.optim would import ``torch._dynamo`` each time).
"""

import argparse
import os
import shutil
import signal
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from course.data import make_dataset, make_model
from course.report import check, mean_over_ranks, ok, print0
from course.tools import PlainSGD
from miniddp import DistributedDataParallel, DistributedSampler
from miniddp.launch import join_torchrun_group, leave_group, rank_device
from miniddp.launch.torchrun_agents import (
    as_worker,
    run_agents,
    shown,
    started_by_torchrun,
    torchrun,
    verdict,
)
from miniddp.train import checkpoint

EPOCHS, DATASET_SIZE, BATCH_SIZE = 4, 1024, 32
STEPS_PER_EPOCH = DATASET_SIZE // (BATCH_SIZE * 2)  # 16 on the lesson's 2 workers, 64 in all
LR, NOISE = 0.2, 0.05
SAVE_EVERY = 10  # steps; 40 is half way through the third epoch (steps 32-47)
KILL_AT, KILLED_RANK = 45, 1
FILES = ("naive.pt", "atomic.pt", ".atomic.pt.tmp", "snapshot.pt", ".snapshot.pt.tmp",
         "resumed_from.pt")  # what the lesson writes into its --workdir
# torch 2.3's torchrun closes its rendezvous while stopping the workers for a restart, so
# --max-restarts ends the job instead (pytorch issue 123678, fixed in 2.4; see
# miniddp.torch_versions). There the lesson plays the crash in-process, as without restarts.
TORCHRUN_CAN_RESTART = not version("torch").startswith("2.3.")


# ----- part 1, on rank 0 before the process group exists: a writer killed halfway -----

class KilledHere:
    """Pickling this object SIGKILLs the process: a crash at a known point inside a write."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)


def killed_while_writing(write, state: dict, path: Path) -> int:
    """Fork a child that runs ``write(state + KilledHere, path)``; return its exit status."""
    pid = os.fork()  # no process group, no GPU yet: nothing that a fork would break
    if pid == 0:
        try:
            write({**state, "crash": KilledHere()}, path)
        finally:
            os._exit(0)  # not reached: the child dies inside write()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def loads(path: Path):
    try:
        return torch.load(path, weights_only=True)
    except Exception as error:  # what a resume would meet
        return f"{type(error).__name__}{': ' * bool(str(error))}{str(error)[:60]}"


def writers_killed_halfway(workdir: Path):
    print0("1. a snapshot writer SIGKILLed halfway, two ways (in a forked child):")
    old, new = make_model(seed=0).state_dict(), make_model(seed=1).state_dict()
    naive, atomic = workdir / "naive.pt", workdir / "atomic.pt"
    torch.save(old, naive)
    checkpoint.write_atomic(old, atomic)
    statuses = [killed_while_writing(torch.save, new, naive),
                killed_while_writing(checkpoint.write_atomic, new, atomic)]
    check(statuses == [-signal.SIGKILL] * 2, f"the writers should have been SIGKILLed: {statuses}")
    after = loads(naive)
    print0(f"   torch.save(obj, path): {naive.name} has {naive.stat().st_size} bytes and does not "
           f"load ({after}). The file was emptied when it was opened; the old snapshot is gone")
    check(isinstance(after, str), "a file whose writer was killed should not load")
    kept, leftover = loads(atomic), atomic.with_name(f".{atomic.name}.tmp")
    check(isinstance(kept, dict) and all(torch.equal(kept[k], old[k]) for k in old),
          f"{atomic.name} should still hold the previous snapshot, got {kept}")
    print0(f"   checkpoint.write_atomic(obj, path): {atomic.name} still loads the previous "
           f"snapshot; the unfinished {leftover.name} is left behind for the next save to "
           "overwrite")
    check(leftover.exists(), f"the killed atomic writer should have left {leftover.name}")


# ----- part 2, on every rank: the module. prefix -----

def the_module_prefix(device):
    print0("\n2. the module. prefix:")
    ids = [device] if device.type == "cuda" else None
    ddp = DistributedDataParallel(make_model(seed=0).to(device), device_ids=ids)
    wrapped, bare = ddp.state_dict(), make_model(seed=1).to(device)
    print0(f"   DDP's keys: {', '.join(list(wrapped)[:2])}, ...  the bare model's: "
           f"{', '.join(list(bare.state_dict())[:2])}, ...")
    try:
        bare.load_state_dict(wrapped)
        error = "nothing"
    except RuntimeError as e:
        error = str(e)
    print0(f"   bare.load_state_dict(ddp.state_dict()) raises: {error.splitlines()[1].strip()[:60]}"
           f"... {error.splitlines()[2].strip()[:50]}...")
    check("Missing key(s)" in error and "Unexpected key(s)" in error,
          f"loading DDP's keys into the bare model should fail, got: {error[:200]}")
    checkpoint.load_model_state(bare, wrapped)
    other = DistributedDataParallel(make_model(seed=2).to(device), device_ids=ids)
    checkpoint.load_model_state(other, bare.state_dict())  # and the other way round
    same = all(torch.equal(p, q) and torch.equal(p, r) for p, q, r in
               zip(ddp.module.parameters(), bare.parameters(), other.module.parameters()))
    check(same, "load_model_state should load a DDP state dict into the bare model and back")
    check(list(checkpoint.model_state(ddp)) == list(bare.state_dict()),
          "checkpoint.model_state(ddp) should have the bare model's keys")
    print0("   checkpoint.load_model_state loaded DDP's state into the bare model and the bare "
           "model's into a DDP; snapshots store the bare keys (checkpoint.model_state)")


# ----- part 3, on every rank: the job, its snapshots, the crash and the resume -----

def train(device, save_to=None, resume_from=None, forget=None, stop_at=None, kill_at=None,
          verbose=False):
    """The job: miniddp's DDP, the sampler, SGD with momentum, per-rank input noise.

    Snapshots go to ``save_to`` every SAVE_EVERY steps; ``resume_from`` restores one, except
    what ``forget`` names ("optimizer", "sampler" or "rng"). ``stop_at`` returns None at that
    step (a crash played in-process); at ``kill_at`` rank KILLED_RANK SIGKILLs itself. Returns
    the final parameters (flattened) and this rank's losses.
    """
    rank = dist.get_rank()
    dataset = make_dataset(n=DATASET_SIZE, seed=0)
    sampler = DistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler,
                        generator=torch.Generator())  # keeps iter(loader) off the global RNG
    ids = [device] if device.type == "cuda" else None
    ddp = DistributedDataParallel(make_model(seed=0).to(device), device_ids=ids)
    optimizer = PlainSGD(ddp.parameters(), lr=LR, momentum=0.9)
    torch.manual_seed(1000 + rank)  # each rank its own noise
    epoch = step = 0
    if resume_from:
        snapshot = checkpoint.load(resume_from, ddp, None if forget == "optimizer" else optimizer,
                                   None if forget == "sampler" else sampler,
                                   restore_rng=forget != "rng")
        epoch, step = snapshot["epoch"], snapshot["step"]
        if verbose:
            print0(f"   resuming from {Path(resume_from).name}: in epoch {epoch + 1}/{EPOCHS}, "
                   f"after step {step}, {sampler.state_dict()['consumed']} of "
                   f"{sampler.num_samples} samples of the epoch done on each rank")
    losses = []
    while epoch < EPOCHS:
        sampler.set_epoch(epoch)  # the epoch a snapshot stopped in keeps its position
        seen, first, first_step = 0, len(losses), step
        for x, y in loader:
            if step == stop_at:
                return None
            if step == kill_at and rank == KILLED_RANK:
                print(f"   rank {rank}: SIGKILL to myself at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = x.to(device), y.to(device)
            loss = F.mse_loss(ddp(x + NOISE * torch.randn_like(x)), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step, seen = step + 1, seen + len(x)
            losses.append(loss.detach())
            if save_to and step % SAVE_EVERY == 0:
                checkpoint.save(save_to, ddp, optimizer, sampler, epoch=epoch, step=step,
                                trained=seen)
        if verbose:
            mean = mean_over_ranks(torch.stack(losses[first:]).mean())
            resumed = first_step % STEPS_PER_EPOCH != 0  # resumed mid-epoch: part of it ran
            print0(f"   end of epoch {epoch + 1}/{EPOCHS} | step {step} | loss {mean:.4f}, mean of "
                   f"steps {first_step + 1}-{step}"
                   + (f" only (steps before {first_step + 1} ran before the resume)" if resumed
                      else ""))
        epoch += 1
    return torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]), losses


def resume_and_prove(device, snapshot: Path, attempt: int) -> str:
    """Resume the job from ``snapshot``, then run it again uninterrupted: the same bits."""
    kept = snapshot.with_name("resumed_from.pt")  # the job overwrites its snapshot as it goes
    if dist.get_rank() == 0:
        shutil.copy(snapshot, kept)
    dist.barrier()
    resumed, _ = train(device, save_to=snapshot, resume_from=snapshot, verbose=True)
    reference, losses = train(device)
    losses = [mean_over_ranks(loss) for loss in (losses[0], losses[-1])]
    check(losses[1] < 0.3 * losses[0],
          f"the loss went from {losses[0]:.4f} to {losses[1]:.4f}, not below 30% of it")
    check(torch.equal(resumed, reference), f"rank {dist.get_rank()}: the resumed job ended "
          f"{(resumed - reference).abs().max():.3g} away from an uninterrupted run")
    print0(f"   an uninterrupted run (loss {losses[0]:.3f} -> {losses[1]:.4f}) ended with the "
           "same weights, bit for bit")

    print0("   resumed from the same snapshot without one thing each:")
    for forget, what in (("sampler", f"the sampler's position: epoch "
                                     f"{KILL_AT // STEPS_PER_EPOCH + 1} "
                                     "starts over"),
                         ("optimizer", "the optimizer's state: momentum starts from zero"),
                         ("rng", "the random generators: other noise on every rank")):
        other, _ = train(device, resume_from=kept, forget=forget)
        differs = (other - reference).abs().max().item()
        print0(f"     without {what}: max difference {differs:.2g}")
        check(differs > 0, f"resuming without {forget} state gave the very same weights: "
                           "the controls prove nothing")
    how = (f"was restarted by torchrun (restart {attempt}) after rank {KILLED_RANK} was "
           f"SIGKILLed at step {KILL_AT}" if attempt else
           f"stopped at step {KILL_AT} (a crash played in-process)")
    return (f"the job {how}, resumed from the step-{(KILL_AT // SAVE_EVERY) * SAVE_EVERY} "
            "snapshot mid-epoch and ended bit-identical to an uninterrupted run; without the "
            "sampler's, optimizer's or RNG state it does not")


def on_every_rank(workdir: Path, attempt: int, restarts: int) -> str:
    device = rank_device()
    snapshot = workdir / "snapshot.pt"
    if attempt > 0:
        print0(f"\n3. (continued) attempt {attempt}: torchrun's own lines above say what its "
               f"agent did: it saw rank {KILLED_RANK} end with exit code -9 (killed by signal 9, "
               "SIGKILL), stopped any worker still running ('closing signal SIGTERM'), "
               "and started every worker again; each runs the script from the top and "
               "finds the snapshot")
        return resume_and_prove(device, snapshot, attempt)
    the_module_prefix(device)
    print0(f"\n3. the job: {EPOCHS} epochs of {STEPS_PER_EPOCH} steps, a "
           f"snapshot every {SAVE_EVERY} steps to {snapshot}")
    if restarts > 0:
        print0(f"   torchrun may restart {restarts} time(s): rank {KILLED_RANK} will be "
               f"SIGKILLed at step {KILL_AT}")
        try:
            train(device, save_to=snapshot, kill_at=KILL_AT, verbose=True)
        except RuntimeError as error:  # rank 0: its peer vanished in the middle of a collective
            # Seldom seen: in nearly every run the agent (which looks at its workers every 0.1 s)
            # stops rank 0 with SIGTERM before this is raised and printed.
            print0(f"   rank 0, at step {KILL_AT}: {str(error).split('] ')[-1][:80]}"
                   "... It exits too, and torchrun restarts both")
            sys.exit(1)
        check(False, f"rank {KILLED_RANK} should have been killed at step {KILL_AT}")
    print0(f"   torchrun may not restart (--max-restarts=0), so nobody may die: the workers "
           f"stop at step {KILL_AT}, drop everything, and resume as a restarted job would")
    check(train(device, save_to=snapshot, stop_at=KILL_AT, verbose=True) is None,
          f"the job should have stopped at step {KILL_AT}")
    return resume_and_prove(device, snapshot, attempt)


def worker(workdir: Path | None, backend: str | None):
    """One worker of one attempt, started by torchrun."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    temporary = workdir is None
    if temporary:  # by hand under torchrun: a directory per torchrun run, shared by attempts
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", os.environ["MASTER_PORT"])
        workdir = Path(tempfile.gettempdir()) / f"miniddp-lesson09-{run_id}"
    if attempt == 0 and os.environ["RANK"] == "0":  # attempt 0 starts from scratch
        workdir.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            (workdir / name).unlink(missing_ok=True)
        writers_killed_halfway(workdir)
    join_torchrun_group(backend, pg_timeout=30)  # None: NCCL if each local rank has a GPU
    try:
        message = on_every_rank(workdir, attempt, restarts)
    finally:
        leave_group()
    if temporary and os.environ["RANK"] == "0":
        shutil.rmtree(workdir, ignore_errors=True)
    ok(message)


# ----- run plainly: one torchrun agent that may restart its workers once -----

def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="where snapshots go (default: a temporary "
                        "directory, removed at the end)")
    parser.add_argument("--timeout", type=float, default=90.0,
                        help="seconds before torchrun is stopped (run plainly)")
    parser.add_argument("--backend", help="process group backend (default: NCCL when every "
                        "worker has a GPU, gloo otherwise)")
    args = parser.parse_args()
    if started_by_torchrun():
        as_worker(lambda: worker(args.workdir, args.backend))  # names its rank if it fails
        return
    if not TORCHRUN_CAN_RESTART:
        print(f"torch {version('torch')}: its torchrun cannot restart workers (pytorch issue "
              "123678), so the crash is played in-process instead", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="miniddp-lesson09-"))
    command = torchrun("--standalone", "--nproc_per_node=2",
                       f"--max-restarts={int(TORCHRUN_CAN_RESTART)}", "--monitor_interval=0.1",
                       str(Path(__file__).resolve()), "--workdir", str(workdir))
    print(f"starting: {shown(command)}", flush=True)
    try:
        done = run_agents([command], ["[torchrun] "], args.timeout)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    expected = "restarted by torchrun" if TORCHRUN_CAN_RESTART else "played in-process"
    said = verdict(done, expected)[len("OK: "):]  # the OK line of the workers' rank 0, above
    print(f"OK: torchrun exited 0, and its workers' rank 0 said: {said}")


if __name__ == "__main__":
    main()
