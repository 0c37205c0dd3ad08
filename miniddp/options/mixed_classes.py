"""A job whose ranks built different DDP classes: torch's on some, miniddp's on others.

It happens when a launcher starts some ranks without miniddp in torch's place (a worker run
without ``python -m miniddp.run``), and the two constructions do not speak the same protocol.
torch's first collective is an all-gather of one int64, its number of parameters; miniddp's
first is the same all-gather carrying :data:`MINIDDP_SAYS`, a negative count no torch rank
sends. So every miniddp rank learns which ranks are torch's and stops with a message that names
the mix and the fix, and every torch rank stops at once on its own count check ("... while rank
0 has inconsistent -999999999 params") instead of waiting for collectives that never come.
Without it, torch's rank reads miniddp's next message as a parameter count and the miniddp
ranks wait for the rest until the process group's timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: What miniddp's ranks send where torch's send their number of parameters.
MINIDDP_SAYS = -999_999_999


class MixedDDPClasses(RuntimeError):
    """Some ranks built torch's DistributedDataParallel and others miniddp's."""


def all_gather_among_miniddp_ranks(mine, named_tensors, group=None) -> list:
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
            f"rank(s) {torchs} of this job built torch's DistributedDataParallel and the others "
            "miniddp's: every rank must build the same class. A launcher or a multiprocessing "
            "start method started those ranks without miniddp in torch's place. Start the job "
            "with `python -m miniddp.run script.py` (it reaches every Python process the script "
            "starts), call miniddp.install() before any worker starts, or build "
            "miniddp.DistributedDataParallel explicitly in the code every rank runs.")
