"""Exercise 07 (lesson 07): one optimizer step from k micro-batches, with ``no_sync``.

``micro_batches`` is a list of k ``(x, y)`` pairs. The gradient of one step must be the gradient
of the mean loss over all k micro-batches on all ranks, with one all_reduce round per step:

* ``optimizer.zero_grad()`` once, before the first micro-batch (``.grad`` must accumulate);
* for the first k - 1 micro-batches, forward *and* backward inside ``with ddp.no_sync():``
  (the flag is read at forward time), with the loss ``F.mse_loss(ddp(x), y) / k``;
* the last micro-batch the same, outside ``no_sync``: its backward averages the whole
  accumulated ``.grad`` over the ranks once;
* ``optimizer.step()`` once.

Graded by ``python lessons/grade.py 07`` with miniddp's DDP (all_reduces launched only in the
last micro-batch's backward of each step) and torch's (parameters equal to the correct loop's
bit for bit after every step).
"""

import torch.nn.functional as F


def accumulation_step(ddp, optimizer, micro_batches) -> None:
    """One optimizer step from ``micro_batches``, communicating once."""
    k = len(micro_batches)
    optimizer.zero_grad()
    for j, (x, y) in enumerate(micro_batches):
        if j < k - 1:
            with ddp.no_sync():
                (F.mse_loss(ddp(x), y) / k).backward()
        else:
            (F.mse_loss(ddp(x), y) / k).backward()
    optimizer.step()
