"""Exercise 04 (lesson 04): the indices torch's DistributedSampler gives one rank in one epoch.

Three steps, as in ``miniddp.sampler.DistributedSampler``:

1. the order: with ``shuffle``, ``torch.randperm(dataset_len, generator=g)`` where
   ``g = torch.Generator(); g.manual_seed(seed + epoch)``; without, ``0, 1, ..., dataset_len - 1``;
2. equal shares: with ``drop_last``, ``num_samples = dataset_len // num_replicas`` (the tail is
   cut); without, ``num_samples = ceil(dataset_len / num_replicas)`` and the order is padded by
   repeating it from its start, as many times as needed; ``total_size = num_samples *
   num_replicas``, and the order is cut to ``total_size``;
3. rank ``r`` takes every ``num_replicas``-th index starting at ``r``.

Graded by ``python lessons/grade.py 04`` on 3 ranks against torch's sampler, index for index;
like torch's, it must leave the process-wide random state alone (the training draws from it).
"""

import torch  # noqa: F401  (you will need it)


def rank_indices(dataset_len: int, num_replicas: int, rank: int, epoch: int, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False) -> list[int]:
    """This rank's dataset indices for ``epoch``, exactly as torch's DistributedSampler."""
    if shuffle:
        raise NotImplementedError(
            "exercise 04, step 1: make `order`, a list: a permutation of range(dataset_len) "
            "drawn from a torch.Generator seeded with seed + epoch (look up torch.randperm). "
            "Every rank computes the same one, with no communication. Stuck? python "
            "lessons/grade.py --hint 04")
    else:
        order = list(range(dataset_len))  # noqa: F841  (you will use it)
    raise NotImplementedError(
        "exercise 04, steps 2 and 3: give every rank the same number of indices (the tail cut "
        "with drop_last, else `order` padded by repeating it from its start, in integer "
        "arithmetic), then return this rank's share: every num_replicas-th index from position "
        "`rank`. The module docstring gives torch's rule. Stuck? python lessons/grade.py "
        "--hint 04")
