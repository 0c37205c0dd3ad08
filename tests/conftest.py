"""Shared fixtures: long-lived groups of forked ranks, one per world size.

Importing ``torch._dynamo`` here, before any fork, matters: torch's DDP imports it lazily on
first construction (seconds of CPU in every rank otherwise).
"""

import pytest
import torch
import torch._dynamo  # noqa: F401  (see the module docstring)

from miniddp.launch import RankGroup, start_methods

torch.set_num_threads(1)


class Ranks:
    """A :class:`RankGroup` that restarts itself after a failure, so one bad case costs one case."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._group = None

    def run(self, fn, *args, timeout: float = 60.0, **kwargs):
        if self._group is None or not self._group.alive:
            self._group = RankGroup(self.world_size, pg_timeout=20.0)
        return self._group.run(fn, *args, timeout=timeout, **kwargs)

    def close(self):
        if self._group is not None:
            self._group.close()


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world_size)`` returns a long-lived group of that many gloo ranks."""
    pools: dict[int, Ranks] = {}

    def get(world_size: int) -> Ranks:
        if world_size not in pools:
            pools[world_size] = Ranks(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture
def ranks_see_monkeypatches():
    """For a test that patches this process and counts on forked ranks inheriting the patch.

    Where ranks start from a forkserver instead (this process already ran a backward on a
    machine with a GPU: ``miniddp.launch.start_methods``) they would not see it: skipped there.
    """
    if not start_methods.fork_is_safe():
        pytest.skip("the ranks start from a forkserver here (a backward already ran in this "
                    "process on a machine with a GPU), so they do not inherit this test's patch")
