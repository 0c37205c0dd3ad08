"""miniddp: PyTorch's DistributedDataParallel rebuilt in readable Python, bit for bit."""

from miniddp.ddp import DistributedDataParallel
from miniddp.launch import RankError, RankGroup, launch, spawn

__all__ = ["DistributedDataParallel", "RankError", "RankGroup", "launch", "spawn"]
