"""Exercise 03 (lesson 03): average every gradient over the ranks, by hand.

After ``loss.backward()`` each rank holds the gradient of its own shard's loss. Data parallelism
needs every rank to hold the mean of all of them. Do it the way torch's DDP does the arithmetic:
multiply each gradient by ``1 / world_size`` first, then ``dist.all_reduce`` it (a SUM), in place.

Graded by ``python lessons/grade.py 03``: ``.grad`` must hold its final value when your function
returns (an asynchronous all_reduce must be waited for first); at 2 ranks every ``.grad`` must
equal torch's DDP's bit for bit; at 3 ranks every rank must hold the very same bits, those of
scale-then-sum computed in the same run (where dividing after the sum rounds differently), and
close to torch's (not equal: torch sums whole buckets, and a ring's summation order depends on
where an element sits).
"""

import torch.distributed as dist
from torch import nn


def average_gradients(model: nn.Module) -> None:
    """Make every parameter's ``.grad`` the mean of that gradient over all ranks, in place."""
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is None:
            continue
        raise NotImplementedError(
            "exercise 03: make this p.grad the mean of its values over all ranks, in place. "
            "Multiply it by the reciprocal of the world size BEFORE summing it over the ranks "
            "(not divide, before or after): lesson 08 shows why that is torch's arithmetic "
            "('Why 3 ranks are the harder test'), and the grader compares bits at 3 ranks, "
            "where they differ. Look up "
            "torch.distributed.all_reduce (what it sums, and where the result goes) and "
            f"Tensor.mul_. (world_size here: {world_size}.) Stuck? python lessons/grade.py "
            "--hint 03")
