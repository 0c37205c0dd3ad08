"""Starting ranks: fork them on this machine, or join the ones torchrun started.

* ``launcher``: ``launch(fn, world_size)`` and ``spawn``, the one entry point every lesson,
  benchmark and the reference job use; joining torchrun's group; signals; collectives with a
  deadline.
* ``rank_group``: forked ranks with timeouts, rank-named errors and no orphans.
* ``start_methods``: fork, or a forkserver once a forked child could not run autograd
  (a backward already ran here on a machine with a GPU).
* ``rank_files``: the per-group files ranks leave behind (stderr tails, stack dumps).
* ``torchrun_agents``: torchrun's elastic agents run in-process, for tests of many "machines".

Depends on the engine's torch-release facts only; nothing here knows about DDP.
"""

from miniddp.launch.launcher import (
    CollectiveFailed,
    Stopped,
    collective,
    default_backend,
    join_torchrun_group,
    launch,
    launched_by_torchrun,
    rank_device,
    spawn,
    stop_on_signals,
)
from miniddp.launch.rank_group import RankError, RankGroup, leave_group

__all__ = ["CollectiveFailed", "RankError", "RankGroup", "Stopped", "collective",
           "default_backend", "join_torchrun_group", "launch", "launched_by_torchrun",
           "leave_group", "rank_device", "spawn", "stop_on_signals"]
