"""miniddp: PyTorch's DistributedDataParallel rebuilt in readable Python, bit for bit."""

from miniddp.data_parallel import DataParallel
from miniddp.ddp import DistributedDataParallel
from miniddp.launch import RankError, RankGroup, launch, spawn
from miniddp.naive import AllReduceBucketsAfterBackward, AllReduceEachParameter
from miniddp.sampler import DistributedSampler

__all__ = [
    "AllReduceBucketsAfterBackward",
    "AllReduceEachParameter",
    "DataParallel",
    "DistributedDataParallel",
    "DistributedSampler",
    "RankError",
    "RankGroup",
    "launch",
    "spawn",
]
