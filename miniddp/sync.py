"""Making every rank start from the same model: shape checks and broadcasts from rank 0.

Data parallelism only works if every rank holds the same parameters. Checking shapes first
matters: broadcasting tensors of different sizes does not fail cleanly in every backend, it
can hang or corrupt memory. So shapes are gathered from every rank, and every rank raises the
same error (naming the parameter, its shape on each rank, and the ranks) before any broadcast.
Strides are compared too: a bucket view copies its parameter's memory layout, so a
``channels_last`` parameter on one rank only would have the ranks sum mismatched elements.

A job whose ranks built different DDP classes (a process started without miniddp in torch's
place) must stop here, not at a timeout: torch's first collective at construction all-gathers
its number of parameters, and miniddp's carries :data:`MINIDDP_SAYS` there, a negative count no
torch rank sends. Every miniddp rank raises :class:`MixedDDPClasses` (the mix, its likely cause
and the fix); every torch rank stops at once ("... inconsistent -999999999 params").
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class ModelsDiffer(ValueError, RuntimeError):
    """The ranks' models differ: a RuntimeError, as torch raises (and a ValueError, which code
    written for miniddp may catch)."""


#: What miniddp's ranks send where torch's send their number of parameters.
MINIDDP_SAYS = -999_999_999


class MixedDDPClasses(RuntimeError):
    """Some ranks built torch's DistributedDataParallel and others miniddp's."""


def _all_gather_among_miniddp_ranks(mine, named_tensors, group=None) -> list:
    """Every rank's ``mine`` (``dist.all_gather_object``) at construction, once every rank of
    ``group`` is known to be building miniddp's class; :class:`MixedDDPClasses` if not."""
    device = named_tensors[0][1].device if named_tensors else torch.device("cpu")
    refuse_torchs_ddp_on_other_ranks(device, group)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def refuse_torchs_ddp_on_other_ranks(device: torch.device, group=None) -> None:
    """Raise on every miniddp rank if any rank of ``group`` is constructing torch's DDP (whose
    first collective, its parameter count, meets this one)."""
    said = torch.tensor([MINIDDP_SAYS], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(said) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, said, group=group)
    torchs = [rank for rank, s in enumerate(everyone) if s.item() != MINIDDP_SAYS]
    if torchs:
        raise MixedDDPClasses(
            f"rank(s) {torchs} of this job built torch's DistributedDataParallel, the others "
            "miniddp's. Likely cause, also under `python -m miniddp.run`: those ranks were "
            "started with an environment of its own (Popen(..., env=...), os.execve) lacking "
            "MINIDDP_IN_TORCHS_PLACE and PYTHONPATH. Fix: call miniddp.install() in the child's "
            "code, or pass os.environ on (env={**os.environ, ...}), or build miniddp's DDP "
            "explicitly. A job started without it: `python -m miniddp.run script.py`.")


def verify_same_shapes(named_tensors: list[tuple[str, torch.Tensor]], group=None) -> None:
    """Raise on every rank if a rank built torch's DDP, or if any rank's parameter names, shapes
    or strides differ (on a rank whose parameter differs from rank 0's, in torch's words too)."""
    mine = [(name, tuple(t.shape), tuple(t.stride())) for name, t in named_tensors]
    everyone = _all_gather_among_miniddp_ranks(mine, named_tensors, group)
    problems, torchs, me = [], "", dist.get_rank(group)
    if len({len(shapes) for shapes in everyone}) > 1:
        counts = ", ".join(f"rank {r}: {len(s)}" for r, s in enumerate(everyone))
        problems.append(f"the number of parameters differs across ranks ({counts})")
    for k, (name, _, _) in enumerate(everyone[0]):
        seen = {r: shapes[k] for r, shapes in enumerate(everyone) if k < len(shapes)}
        if len(set(seen.values())) > 1:
            detail = "; ".join(f"rank {r}: {n} {list(shape)} strides {list(stride)}"
                               for r, (n, shape, stride) in seen.items())
            problems.append(f"parameter {name!r} differs across ranks ({detail})")
            if not torchs and seen.get(me, seen[0])[1:] != seen[0][1:]:
                what, i = ("sizes", 1) if seen[me][1] != seen[0][1] else ("strides", 2)
                torchs = (f" (In torch's words: [{me}]: params[{k}] in this process with {what} "
                          f"{list(seen[me][i])} appears not to match {what} of the same param "
                          "in process 0.)")
    if problems:
        raise ModelsDiffer(
            "DistributedDataParallel needs the same model on every rank, but "
            + "; and ".join(problems[:5])
            + ". Build the model the same way on every rank (same sizes, same order, same "
            "memory format)." + torchs)


def held(group):
    """What miniddp keeps of a process group: ``None`` for the default group, looked up again
    at each use. A gloo group still alive while Python shuts down can abort the process under
    torch 2.13 ("terminate called without an active exception", one exit in three here), and
    ``destroy_process_group()`` frees the group only if nothing else holds it. A model or an
    optimizer usually lives until the script ends, so it must not be what holds the group."""
    return None if group is None or group is dist.group.WORLD else group


def group_rank0(group=None) -> int:
    """The global rank of ``group``'s rank 0, which is what ``dist.broadcast``'s ``src`` means."""
    if group is None or group is dist.group.WORLD:
        return 0
    return dist.get_global_rank(group, 0)


def broadcast_from_rank0(tensors: list[torch.Tensor], group=None) -> None:
    """At construction: rank 0's values, counted as an in-place edit, as torch's broadcast."""
    broadcast_from(tensors, group_rank0(group), group, keep_versions=False)


def broadcast_from(tensors: list[torch.Tensor], src: int, group=None,
                   keep_versions: bool = True) -> None:
    """Overwrite ``tensors`` in place with global rank ``src``'s values, one broadcast per
    dtype/device (under ``join``, the rank to copy is the last one still training).

    Flattening into one buffer per dtype turns hundreds of small broadcasts into a few. The
    copies keep the tensors' autograd version counters, as torch 2.13's forward does: a buffer
    saved for backward by an earlier forward must not look modified to that backward."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    preserve = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
    with torch.no_grad(), contextlib.ExitStack() as versions:
        if preserve is not None and keep_versions:  # one each: older torch takes no tuple
            for t in tensors:
                versions.enter_context(preserve(t))
        for same_kind in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in same_kind])
            dist.broadcast(flat, src=src, group=group)
            offset = 0
            for t in same_kind:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
