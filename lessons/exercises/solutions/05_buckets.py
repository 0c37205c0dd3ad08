"""Exercise 05 (lesson 05): which parameters share a bucket, by torch's rule.

At construction torch's DDP walks the parameters in model order. Per (dtype, device) it keeps
one open bucket: add the parameter (its bytes: ``numel() * element_size()``), and once the
bucket holds at least the current limit, close it. The first bucket of each (dtype, device)
closes at ``first_bytes``, every later one at ``cap_bytes``. A parameter is never split; the one
that crosses the limit stays in the bucket it closed. At the end, the still-open buckets are
closed too. Then sort the buckets by their smallest parameter index and **reverse** the list:
the last layers' gradients are ready first, so their bucket is reduced first.

Graded by ``python lessons/grade.py 05``: the layout against torch's own assignment (first where
a bucket holds exactly its limit, one element less, or one more; then random lists), then the
gradients of torch's DDP (``find_unused_parameters=True`` uses this layout from its first step)
against one all_reduce per bucket of yours, bit for bit at 3 ranks (where layout decides bits).
"""

import torch


def assign_buckets(params: list[torch.Tensor], first_bytes: int,
                   cap_bytes: int) -> list[list[int]]:
    """Parameter indices per bucket, in the order their all_reduces are launched."""
    closed, open_buckets = [], {}  # (dtype, device) -> [members, bytes, buckets closed so far]
    for i, p in enumerate(params):
        entry = open_buckets.setdefault((p.dtype, p.device), [[], 0, 0])
        entry[0].append(i)
        entry[1] += p.numel() * p.element_size()
        if entry[1] >= (first_bytes if entry[2] == 0 else cap_bytes):
            closed.append(entry[0])
            entry[0], entry[1], entry[2] = [], 0, entry[2] + 1
    closed += [members for members, _, _ in open_buckets.values() if members]
    return list(reversed(sorted(closed, key=min)))
