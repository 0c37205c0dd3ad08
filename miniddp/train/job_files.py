"""The files a training job writes: checked before it trains, locked while it runs, rescued.

A job that trains for an hour and then cannot write its result has thrown the hour away, and one
that finds a bad snapshot path at its first save has thrown away the steps before it. So every
output path is tried before the first step (:func:`check_writable`): its directory is created,
a probe file written and removed, and a path that cannot work stops the job at once, named.

Two jobs given the same snapshot path would resume from each other's snapshots and write the
same temporary file. :class:`SnapshotLock` holds ``<snapshot>.lock`` (``fcntl.flock``) for as
long as the job runs, with the holder's pid and host written in it, and refuses a second job.
The kernel drops the lock when the holder dies, however it dies (SIGKILL included), so a lock is
never stale. Holding it, a job knows that nobody else is writing the snapshot: a temporary file
left by a writer killed mid-save is debris, and is removed.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

from miniddp.train.checkpoint import leftovers, load, write_atomic

try:
    import fcntl
except ImportError:  # Windows: no flock; the job runs without the lock
    fcntl = None


class JobFileError(RuntimeError):
    """An output path that cannot be written, or a snapshot another job is using."""


def check_writable(path: str | os.PathLike, what: str) -> Path:
    """Make sure ``path`` can be written later: create its directory, write and remove a probe.

    ``what`` names the path in the error (``"--out"``). Returns the absolute path.
    """
    path = Path(path).absolute()
    if path.is_dir():
        raise JobFileError(f"{what} {path} is a directory; give a file in it, e.g. "
                           f"{path / 'model.pt'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise JobFileError(f"{what} {path}: its directory {path.parent} cannot be created "
                           f"({error.strerror or error}). Give a path in a directory you can "
                           "write to.") from None
    probe = path.with_name(f".{path.name}.probe-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"probe")
    except OSError as error:
        raise JobFileError(f"{what} {path} cannot be written: creating a file in "
                           f"{path.parent} fails ({error.strerror or error}). Give a path in a "
                           "directory you can write to.") from None
    finally:
        probe.unlink(missing_ok=True)
    return path


def check_gpus_for_nccl(ranks_here: int) -> None:
    """NCCL reduces GPU tensors only, one GPU per rank: say so before anything starts."""
    gpus = torch.cuda.device_count()  # asks the driver; CUDA itself stays uninitialized
    if gpus < ranks_here:
        found = "none was found" if gpus == 0 else f"{gpus} found for {ranks_here} ranks here"
        raise JobFileError(f"--backend nccl needs one GPU per rank and {found}. Use --backend "
                           "gloo, or auto (NCCL when every rank has a GPU, gloo otherwise).")


def write_final_model(state: dict, out: str | os.PathLike, snapshot: str | None = None) -> Path:
    """Write the trained weights to ``out``; should that fail, somewhere that works, and say so.

    ``out`` was tried before training, but a disk can fill up or a directory vanish in an hour.
    The fallbacks: beside the snapshot, then the temporary directory. Returns where it went.
    """
    out = Path(out).absolute()
    places = [out]
    if snapshot:
        places.append(Path(snapshot).absolute().with_name(f"rescued-{out.name}"))
    places.append(Path(tempfile.gettempdir()) / f"miniddp-rescued-{os.getpid()}-{out.name}")
    failed = []
    for place in places:
        try:
            write_atomic(state, place)
        except OSError as error:
            failed.append(f"{place}: {error.strerror or error}")
            continue
        if failed:
            print(f"miniddp.train: the final model could NOT be written to {out} "
                  f"({'; '.join(failed)}); it was written to {place} instead.",
                  file=sys.stderr, flush=True)
        return place
    raise OSError(f"the final model could not be written anywhere: {'; '.join(failed)}")


def last_snapshot(path: str | None) -> str:
    """Where a stopped job can go on from, in words."""
    if not path:
        return "there is no snapshot (no --snapshot was given)"
    try:
        snap = torch.load(path, weights_only=True)
    except FileNotFoundError:
        return f"no snapshot was written yet to {path}"
    except Exception:
        return f"the last snapshot is {path}"
    return (f"the last snapshot is {path} (epoch {snap['epoch']}, step {snap['step']}); run the "
            "same command to go on from it")


class SnapshotLock:
    """``<snapshot>.lock``, held while a job uses the snapshot; a second job is refused."""

    def __init__(self, snapshot: str | os.PathLike):
        self.snapshot = Path(snapshot).absolute()
        self.path = self.snapshot.with_name(f"{self.snapshot.name}.lock")
        self._fd: int | None = None

    def acquire(self) -> list[Path]:
        """Take the lock, or raise :class:`JobFileError` naming its holder.

        Returns the temporary files of a snapshot write cut short, which it has removed.
        """
        if fcntl is None:
            return []
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another job"
            os.close(fd)
            raise JobFileError(
                f"the snapshot {self.snapshot} is in use by another job ({holder}; the lock is "
                f"{self.path}). Give this job a --snapshot of its own, or wait for that job to "
                "end.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        self._fd = fd
        removed = [tmp for tmp in leftovers(self.snapshot) if tmp.exists()]
        for tmp in removed:
            tmp.unlink(missing_ok=True)
        return removed

    def release(self) -> None:
        """Let go (the file stays: removing it could let two jobs lock two different files)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def prepare(out: str | None, snapshot: str | None, holds_lock: bool,
            nccl_ranks: int = 0) -> SnapshotLock | None:
    """Everything that can fail before training, checked now: GPUs, output paths, the snapshot
    (a damaged one fails the same way on every retry: under torchrun, before the group forms),
    the lock.

    ``nccl_ranks``: the ranks on this machine that need a GPU each (0: gloo). The process that
    ``holds_lock`` takes the snapshot's lock and returns it, to release when the job ends.
    """
    if nccl_ranks:
        check_gpus_for_nccl(nccl_ranks)
    for flag, path in (("--out", out), ("--snapshot", snapshot)):
        if path:
            check_writable(path, flag)
    if snapshot and Path(snapshot).is_file():  # damaged: say so now, not once per rank
        try:
            load(snapshot, map_location="cpu", restore_rng=False)
        except ValueError as error:  # SnapshotError included
            raise JobFileError(str(error)) from None
    if not (snapshot and holds_lock):
        return None
    lock = SnapshotLock(snapshot)
    for leftover in lock.acquire():
        print(f"removed {leftover}, left by a job killed while it wrote a snapshot",
              file=sys.stderr, flush=True)
    return lock
