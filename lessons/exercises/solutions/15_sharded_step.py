"""Exercise 15 (lesson 15): the sharded optimizer step, ZeRO stage 1.

After DDP has averaged the gradients, every rank would take the very same step. ZeRO stage 1
lets each rank step only its own share of the parameters, so that it keeps the optimizer state
(Adam's moments) of that share alone, and then sends its updated parameters to every other rank.
Three pieces to write:

* ``owners``: the rank that owns each parameter, by the rule of torch's
  ``ZeroRedundancyOptimizer``: the parameters taken largest first (by number of elements; equal
  sizes keep their order), each given to the rank that owns the fewest elements so far (on a
  tie, the lowest rank);
* in ``__init__``, ``self.local``: an ``optimizer_class`` over this rank's share only;
* ``step``: the local step, then every parameter sent from its owner to every rank.

Graded by ``python lessons/grade.py 15`` against torch's ``ZeroRedundancyOptimizer``: the owners
for 40 parameter lists (of one dtype, and of mixed dtypes: torch counts elements, not
bytes) at 2 and 3 ranks, the parameters and state each rank's optimizer holds,
where every parameter is sent from, and beside torch's DDP the parameters after every step bit
for bit, with SGD with momentum and with Adam, at 2 and 3 ranks.
"""

import torch
import torch.distributed as dist


def owners(params: list[torch.Tensor], world_size: int) -> list[int]:
    """The rank that owns each of ``params``, in their order: torch's partition."""
    result, load = [0] * len(params), [0] * world_size
    for i in sorted(range(len(params)), key=lambda i: params[i].numel(), reverse=True):
        result[i] = load.index(min(load))
        load[result[i]] += params[i].numel()
    return result


class ShardedOptimizer:
    """ZeRO stage 1: steps every parameter, keeping the state of this rank's share only."""

    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.owners = owners(self.params, self.world_size)
        mine = [p for p, owner in zip(self.params, self.owners) if owner == self.rank]
        self.local = optimizer_class(mine, **defaults)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One step of every parameter: this rank's share stepped here, the rest received."""
        self.local.step()
        for p, owner in zip(self.params, self.owners):
            dist.broadcast(p, src=owner)
