"""What changed between torch releases that miniddp has to know about, in one place.

miniddp supports torch 2.1 and later, and is compared bit for bit with whichever torch is
installed. Where torch's DDP changed a *choice* between releases, miniddp follows the installed
torch; where an old release had a *bug*, miniddp does the right thing everywhere and the tests
say which torch differs. Each flag below names the release that changed and why it matters.
Checked by running the whole test suite, as it was on 2026-11-25, under torch 2.1.2, 2.3.1,
2.4.1, 2.11.0 and 2.13.0.
"""

from __future__ import annotations

import torch
import torch.distributed


def _release(version: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; local and pre-release suffixes are ignored."""
    major, minor = version.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


#: The installed torch as ``(major, minor)``.
TORCH_RELEASE = _release(torch.__version__)

#: A choice: whether an explicit ``bucket_cap_mb`` also caps the first bucket. Until 2.3 the first
#: bucket was ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) whatever the user asked for; 2.4 made
#: an explicit cap apply to every bucket. ``miniddp.buckets`` follows the installed torch, so that
#: its buckets (and so, at 3 ranks and more, its bits) stay those of the torch it runs beside.
EXPLICIT_CAP_COVERS_FIRST_BUCKET = TORCH_RELEASE >= (2, 4)

#: A bug, fixed in 2.4: a parameter that got a gradient only inside ``no_sync`` micro-batches was
#: left out of the next synced all_reduce, so the replicas drifted apart. miniddp averages it on
#: every torch (the fixed behaviour); the comparisons with torch's DDP skip that case before 2.4.
TORCH_AVERAGES_PARAMETERS_USED_ONLY_IN_NO_SYNC = TORCH_RELEASE >= (2, 4)

#: A bug, fixed in 2.4 (pytorch issue 123678): torch 2.3's torchrun closed its rendezvous while
#: stopping the workers to restart them, so ``--max-restarts`` ended the job instead.
TORCHRUN_CAN_RESTART_WORKERS = TORCH_RELEASE != (2, 3)

#: A bug, fixed mid-2025 (pytorch PR 154976; assumed here from 2.8): destroying a gloo process
#: group held the GIL while waiting for gloo's worker threads. A worker still dropping its last
#: collective, whose tensors need the GIL to be freed, then waits for the main thread, and the
#: main thread for it, forever (pytorch issue 56297). Seen here on 2.1 (2 of 8 torchrun runs of
#: lesson 07) and 2.4; ``miniddp.launch.leave_group`` works around it
#: (tests/operations/test_launch.py).
DESTROY_HOLDS_THE_GIL = TORCH_RELEASE < (2, 8)

#: A missing API: ``torch.compiler.is_compiling`` (torch 2.3 on), which tells miniddp's forward
#: that dynamo is tracing it. Without it (2.1, 2.2), ``torch.compile`` of miniddp is unsupported:
#: the compile tests and lesson 16 skip there.
TORCH_HAS_IS_COMPILING = hasattr(getattr(torch, "compiler", None), "is_compiling")

#: A choice, seen on 2.3.1 (not on 2.4.1): importing inductor's code cache starts a pool of compile
#: workers with ``multiprocessing``, which a daemonic process (each rank of ``miniddp.launch``)
#: may not do: "daemonic processes are not allowed to have children". The ranks compile in their
#: own process there (``miniddp.launch.rank_group``).
INDUCTOR_STARTS_WORKERS_ON_IMPORT = TORCH_RELEASE < (2, 4)

#: A missing API: torch 2.1's key-value stores have no ``check`` (is a key there, without
#: waiting); 2.11 and 2.13 have it. ``miniddp.checks.ledger`` polls with ``check`` where it
#: exists, and elsewhere counts a marker per key with ``add(name, 0)``, which every release has.
#: Detected rather than read from the release number, since the release that added it was not
#: checked.
STORE_HAS_CHECK = hasattr(torch.distributed.Store, "check")
