"""miniddp: PyTorch's DistributedDataParallel rebuilt in readable Python, bit for bit.

The engine is at the top of the package: ``core`` (the wrapper), ``reducer`` (one backward:
hooks, readiness, launch order, the end of backward), ``buckets`` (torch's bucket rules, and
each bucket's own step: fill, launch, wait, write back), ``events`` (who listens to the
reducer's records), ``sampler``, ``sync`` (broadcasts at wrap time), ``errors`` (the
reducer's messages) and ``profiling`` (named spans while torch.profiler records). It imports
nothing else of the package. ``ddp`` composes the public class
from the engine's, with ``options`` (DDP's options), ``compat`` (torch's private API and what
makes the class look like torch's) and ``checks`` (consistency checks and traces) attached.
Around them, each in a subpackage named for what it is: ``baselines`` (the naive versions),
``optim`` (the sharded optimizer, ZeRO-1), ``fsdp`` (ZeRO-2 and -3), ``launch`` (starting
ranks), ``run`` (miniddp in torch's place in other people's code: ``install()``, ``python -m
miniddp.run script.py``) and ``train`` (the reference job).
"""

from miniddp.baselines.data_parallel import DataParallel
from miniddp.baselines.naive import AllReduceBucketsAfterBackward, AllReduceEachParameter
from miniddp.ddp import DistributedDataParallel
from miniddp.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from miniddp.launch import RankError, RankGroup, launch, spawn
from miniddp.run import install, installed, uninstall
from miniddp.sampler import DistributedSampler

__all__ = [
    "AllReduceBucketsAfterBackward",
    "AllReduceEachParameter",
    "DataParallel",
    "DistributedDataParallel",
    "DistributedSampler",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "RankError",
    "RankGroup",
    "ZeroRedundancyOptimizer",
    "fully_shard",
    "install",
    "installed",
    "launch",
    "spawn",
    "uninstall",
]


def __getattr__(name: str):
    """``miniddp.ZeroRedundancyOptimizer``, imported on first use: it reads torch's own
    (``torch.distributed.optim``, ~0.6 s of imports), which every process importing miniddp
    would pay otherwise (every lesson, rank and torchrun worker)."""
    if name == "ZeroRedundancyOptimizer":
        from miniddp.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer
    raise AttributeError(f"module 'miniddp' has no attribute {name!r}")
