"""Training snapshots: everything a killed job needs to go on as if it had never stopped.

A job that resumes from its weights alone is a different job: Adam restarts its moment estimates,
the sampler replays the epoch from its beginning, dropout and noise draw new numbers. A snapshot
made by :func:`save` holds all of it:

* the model's weights, keyed as in the plain module (no ``module.`` prefix), so the same file
  loads into the bare model, miniddp's DDP and torch's DDP;
* the optimizer's state, the epoch and the step count. A sharded optimizer
  (``miniddp.ZeroRedundancyOptimizer``, or torch's) is gathered on rank 0 first
  (``consolidate_state_dict``), so the snapshot holds the whole state in plain Adam's layout;
* the sampler's position inside the epoch (``miniddp.DistributedSampler.state_dict``), so a job
  snapshotted mid-epoch does not train twice on the first half of that epoch;
* **every** rank's random number generators: torch's CPU generator, the CUDA generator of the
  rank's GPU when it has used one, Python's ``random`` and NumPy's global generator. Ranks draw
  different numbers (each should see different noise), so rank 0 alone could not restore them.

Only rank 0 writes, and the write is atomic: the bytes go to a temporary file in the same
directory, are flushed and fsynced, then ``os.replace`` swaps the file in and the directory is
fsynced. A crash at any moment leaves either the previous snapshot or the new one, never half of
one (and perhaps the temporary file, ``.NAME.tmp``: :func:`leftovers` names it). The snapshot it
replaces stays beside it as ``NAME.prev``, for the day the file is damaged after the fact (a disk
fault, a copy cut short). The other ranks wait at a barrier, so when :func:`save` returns on any
rank the snapshot is on disk: a rank that dies right afterwards cannot lose it.

A snapshot saved by N ranks can resume a job of M ranks (``load(..., resize=True)``): the sampler
deals the samples the N ranks had not reached over the M (see
``miniddp.DistributedSampler.load_state_dict``), and rank r gets saved rank r's generators where
there was one. The job goes on correctly, but not as the N-rank run would have, bit for bit.

Everything is stored as tensors, ints, floats, strings, lists, tuples and dicts, which is what
``torch.load(weights_only=True)`` (torch's default since 2.6) accepts. NumPy's RNG state holds a
NumPy array, which it refuses, so it is stored as a list of ints. A ``numpy.random.Generator``
you create yourself is not global: put its ``bit_generator.state`` (a dict of ints) in ``extra``.

One module because a snapshot's content and the way it reaches the disk are one
promise, "either the previous snapshot or the new one, whole", and :func:`save` and
:func:`load` keep both halves of it (the atomic write, ``NAME.prev``, every rank's generators).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

FORMAT = "miniddp.snapshot/1"


class CheckpointMismatchError(RuntimeError):
    """A state dict does not fit the model: the message lists the keys and shapes that differ."""


class SnapshotError(ValueError):
    """A snapshot file cannot be read: the message names it and says what is left to resume from."""


def _wrappers() -> tuple[type, ...]:
    from miniddp.baselines.data_parallel import DataParallel
    from miniddp.ddp import DistributedDataParallel

    return (DistributedDataParallel, DataParallel, nn.parallel.DistributedDataParallel,
            nn.DataParallel)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DDP / DataParallel wrappers (miniddp's or torch's)."""
    while isinstance(model, _wrappers()):
        model = model.module
    return model


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as the plain module names it: no ``module.`` prefix."""
    return unwrap(model).state_dict()


def _without_prefix(state: dict, expected_keys) -> dict:
    """Drop one ``module.`` from every key when the state has it and the model does not."""
    prefix = "module."
    has = bool(state) and all(k.startswith(prefix) for k in state)
    wants = bool(expected_keys) and all(k.startswith(prefix) for k in expected_keys)
    if has and not wants:
        return {k[len(prefix):]: v for k, v in state.items()}
    return state


def load_model_state(model: nn.Module, state: dict, source: str = "the state dict") -> None:
    """Load ``state`` into ``model`` (plain or wrapped), with or without the ``module.`` prefix.

    Nothing is loaded unless everything fits; otherwise :class:`CheckpointMismatchError` names
    the missing keys, the unexpected keys and the shapes that differ.
    """
    target = unwrap(model)
    expected = target.state_dict()
    state = _without_prefix(dict(state), list(expected))
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k}: {tuple(state[k].shape)} in {source}, {tuple(v.shape)} in the model"
              for k, v in expected.items()
              if k in state and isinstance(v, torch.Tensor) and state[k].shape != v.shape]
    if missing or unexpected or shapes:
        lines = [f"{source} does not fit this {type(target).__name__}:"]
        if missing:
            lines.append(f"  missing keys (the model has them, {source} does not): {missing}")
        if unexpected:
            lines.append(f"  unexpected keys ({source} has them, the model does not): "
                         f"{unexpected}")
        if shapes:
            lines.append(f"  shapes that differ: {shapes}")
        lines.append("It was saved from a different model, or with different settings: load it "
                     "into the model that saved it.")
        raise CheckpointMismatchError("\n".join(lines))
    target.load_state_dict(state)


def rng_state() -> dict:
    """This process's random generators, in a form ``torch.load(weights_only=True)`` accepts."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: this rank's GPU
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _fsync_directory(directory: Path) -> None:
    if os.name == "nt":  # Windows cannot open a directory to fsync it
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def previous(path: str | os.PathLike) -> Path:
    """Where :func:`save` keeps the snapshot that the one at ``path`` replaced."""
    path = Path(path).absolute()
    return path.with_name(f"{path.name}.prev")


def leftovers(path: str | os.PathLike) -> list[Path]:
    """The temporary files a writer of ``path`` killed mid-write can leave (one writer per path:
    remove them only while no job writes ``path``)."""
    path = Path(path).absolute()
    return [path.with_name(f".{path.name}.tmp"), path.with_name(f".{path.name}.prev.tmp")]


def _keep_previous(path: Path) -> None:
    """Hard-link the current file as ``NAME.prev`` (atomically; skipped where links are not)."""
    if not path.exists():
        return
    link = leftovers(path)[1]
    try:
        link.unlink(missing_ok=True)
        os.link(path, link)
        os.replace(link, previous(path))
    except OSError:
        link.unlink(missing_ok=True)


def write_atomic(obj, path: str | os.PathLike, keep_previous: bool = False) -> None:
    """``torch.save(obj)`` to ``path`` so that a crash leaves the old file or the new one.

    The temporary file ``.NAME.tmp`` sits in the same directory (``os.replace`` is atomic only
    within one file system). One writer per path: two jobs sharing a snapshot path would share
    the temporary file too. ``keep_previous`` keeps the replaced file as ``NAME.prev``.
    """
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = leftovers(path)[0]
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        if keep_previous:
            _keep_previous(path)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)  # and the new name survives a power cut


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _in_group() else 0


def save(path: str | os.PathLike, model: nn.Module, optimizer=None, sampler=None, *,
         epoch: int = 0, step: int = 0, trained: int | None = None,
         extra: dict | None = None) -> None:
    """Snapshot the job into ``path``. With a process group, every rank must call it.

    ``epoch`` and ``step`` are where training goes on from: after a whole epoch, the next one.
    ``trained`` is passed to ``sampler.state_dict(trained=...)``: the samples this rank has
    trained on since it began iterating the loader (needed with ``num_workers > 0``).
    ``extra`` is stored as given (plain Python values and tensors only).
    """
    if sampler is not None and not hasattr(sampler, "state_dict"):
        raise TypeError(
            f"{type(sampler).__name__} has no state_dict(): it cannot say where it is inside "
            "an epoch. Use miniddp.DistributedSampler, or pass sampler=None and resume at "
            "an epoch boundary with sampler.set_epoch(snapshot['epoch']).")
    if optimizer is not None and hasattr(optimizer, "consolidate_state_dict"):
        optimizer.consolidate_state_dict(to=0)  # a sharded optimizer: every rank sends its share
    rngs = [rng_state()]
    if _in_group():
        everyone = [None] * dist.get_world_size() if _rank() == 0 else None
        dist.gather_object(rngs[0], everyone, dst=0)
        rngs = everyone
    if _rank() == 0:
        snapshot = {
            "format": FORMAT,
            "model": model_state(model),
            "optimizer": None if optimizer is None else optimizer.state_dict(),
            "epoch": int(epoch),
            "step": int(step),
            "sampler": None if sampler is None else sampler.state_dict(trained=trained),
            "rng": rngs,
            "extra": extra or {},
        }
        write_atomic(snapshot, path, keep_previous=True)
    if _in_group():
        dist.barrier()  # nobody goes on (or dies) before the snapshot is on disk


def _device_of(model: nn.Module | None) -> torch.device:
    tensor = None if model is None else next(iter(unwrap(model).state_dict().values()), None)
    return torch.device("cpu") if tensor is None else tensor.device


def _read(path, location) -> dict:
    """``torch.load`` the file, or say in plain words that it is not a whole snapshot.

    torch's own errors name no file (``EOFError``, a zip reader's complaint), and for random
    bytes advise ``weights_only=False``: never the advice for a file of unknown origin.
    """
    try:
        return torch.load(path, map_location=location, weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as error:
        size = os.path.getsize(path)
        prev = previous(path)
        there = (f"The snapshot it replaced is still there: {prev}; to resume from it, move it "
                 f"to {path}." if prev.exists() else f"No previous snapshot ({prev.name}) is "
                 "there to resume from.")
        raise SnapshotError(
            f"{path} is not a complete snapshot ({size} bytes; torch.load raised "
            f"{type(error).__name__}): it was cut short or damaged, or is not a snapshot at all. "
            f"Nothing was loaded. {there}") from None


def load(path: str | os.PathLike, model: nn.Module | None = None, optimizer=None, sampler=None,
         *, map_location=None, restore_rng: bool = True, resize: bool = False) -> dict:
    """Restore what :func:`save` stored into whichever of the objects are given; return it all.

    Tensors are mapped to ``map_location`` (default: the model's device, so a snapshot written on
    ``cuda:0`` loads onto ``cuda:3`` or the CPU). The file is read with ``weights_only=True``.
    ``restore_rng`` sets this rank's generators to what this rank had. A job with another number
    of ranks than the one that saved is refused unless ``resize``: then the sampler deals the
    rest of the epoch over this job's ranks, and rank r gets saved rank r's generators when
    there was a rank r (the others keep theirs). ``len(snapshot["rng"])`` is the saved count.
    """
    location = _device_of(model) if map_location is None else map_location
    snapshot = _read(path, location)
    if not isinstance(snapshot, dict) or snapshot.get("format") != FORMAT:
        raise ValueError(f"{path} is not a snapshot written by miniddp.train.checkpoint.save "
                         "(it has "
                         f"no format={FORMAT!r}); a bare state dict loads with "
                         "load_model_state(model, torch.load(path, weights_only=True)).")
    saved_by = len(snapshot["rng"])
    world_size = dist.get_world_size() if _in_group() else 1
    if saved_by != world_size and not resize and (restore_rng or sampler is not None):
        raise ValueError(
            f"the snapshot {path} was saved by {saved_by} rank(s) and this job has "
            f"{world_size}. Resume with {saved_by} rank(s) to repeat the original run bit for "
            "bit, or pass resize=True: the sampler deals the rest of the epoch over this job's "
            "ranks and rank r gets saved rank r's random generators where there was one.")
    if model is not None:
        load_model_state(model, snapshot["model"], source=f"the snapshot {path}")
    if optimizer is not None:
        if snapshot["optimizer"] is None:
            raise ValueError(f"the snapshot {path} was saved without an optimizer state")
        optimizer.load_state_dict(snapshot["optimizer"])
    if sampler is not None:
        if snapshot["sampler"] is None:
            raise ValueError(f"the snapshot {path} was saved without a sampler state")
        sampler.load_state_dict(snapshot["sampler"], reshard=resize)
    if restore_rng and _rank() < saved_by:
        set_rng_state(snapshot["rng"][_rank()])
    return snapshot
