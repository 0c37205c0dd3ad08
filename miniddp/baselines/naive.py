"""The naive rungs of the ladder that DDP is measured against, sharing the engine's code.

* :class:`AllReduceEachParameter` — after backward, one all_reduce per parameter: the
  textbook version. Pays the collective's fixed latency once per tensor.
* :class:`AllReduceBucketsAfterBackward` — after backward, one all_reduce per bucket: fewer,
  larger messages, but communication still starts only when computation has ended.
* ``miniddp.DistributedDataParallel`` — buckets launched *during* backward (overlap).

All three average gradients with the same arithmetic (multiply by 1 / world size, then SUM), so
they give bit-identical parameters at world size 2, where a ring's sum cannot depend on how the
gradients were grouped. ``ddp.allreduce_calls`` says how many collectives the last step made.
"""

from __future__ import annotations

from miniddp.ddp import DistributedDataParallel
from miniddp.reducer import Reducer


class PerParameterReducer(Reducer):
    """One bucket per parameter, last layer first, never rebuilt."""

    def initial_assignment(self, find_unused: bool = False) -> list[list[int]]:
        return [[i] for i in reversed(range(len(self.params)))]

    @property
    def should_rebuild(self) -> bool:
        return False


class AllReduceEachParameter(DistributedDataParallel):
    """Rung (a): every gradient all_reduced on its own, after the whole backward."""

    reducer_class = PerParameterReducer
    overlap = False


class AllReduceBucketsAfterBackward(DistributedDataParallel):
    """Rung (b): torch's buckets, all_reduced only after the whole backward."""

    overlap = False


#: The ladder by name, naive first, for lessons and benchmarks.
STRATEGIES = {
    "per_parameter": AllReduceEachParameter,
    "buckets_after_backward": AllReduceBucketsAfterBackward,
    "overlap": DistributedDataParallel,
}
