"""The sharded optimizer (ZeRO stage 1): each rank keeps the optimizer state of its own share
of the parameters, steps that share, and sends it to the others.

``ZeroRedundancyOptimizer`` (``miniddp.optim.zero``) is torch's
``torch.distributed.optim.ZeroRedundancyOptimizer`` bit for bit; ``hook_with_zero_step`` and
``hook_with_zero_step_interleaved`` (``miniddp.optim.overlap``) run its step inside DDP's backward
(``overlap_with_ddp=True``): after the last bucket, or bucket by bucket.
Who owns what: ``miniddp.optim.partition``; checkpoints: ``miniddp.optim.state``; the errors:
``miniddp.optim.checks``.
"""

from miniddp.optim.overlap import hook_with_zero_step, hook_with_zero_step_interleaved
from miniddp.optim.zero import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer", "hook_with_zero_step", "hook_with_zero_step_interleaved"]
