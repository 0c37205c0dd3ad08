"""The checks behind lessons/grade.py for exercise 04: one rank's indices of torch's
DistributedSampler, case by case, and what a wrong answer is (another epoch's or seed's order,
a contiguous block, a cut or padding of another rule, the process-wide RNG reseeded)."""

import random
import sys

import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from course.grader.checks import on_ranks


def sampler_task():
    rank, world = dist.get_rank(), dist.get_world_size()
    write = sys.modules["exercise_04"].rank_indices
    cases = 0
    for n in (1, 2, 3, 5, 7, 10, 11, 64):
        for shuffle in (True, False):
            for drop_last in (False, True):
                for epoch, seed in ((0, 0), (1, 0), (3, 7)):
                    expected = torch_indices(n, world, rank, epoch, seed, shuffle, drop_last)
                    before = global_random_states()
                    got = write(n, world, rank, epoch, seed, shuffle, drop_last)
                    cases += 1
                    changed = [name for name, state in global_random_states().items()
                               if state != before[name]]
                    if changed:
                        return (f"rank {rank}: rank_indices({n}, {world}, {rank}, epoch={epoch}, "
                                f"seed={seed}, shuffle={shuffle}, drop_last={drop_last}) changed "
                                f"the process-wide random state ({', '.join(changed)}): it "
                                "reseeded or drew from a global generator (torch.manual_seed, "
                                "torch.randperm without generator=, random.shuffle). Torch's "
                                "sampler draws from a torch.Generator of its own and leaves the "
                                "training's random numbers (dropout, augmentation) alone")
                    if list(got) != expected:
                        return (f"rank {rank}: rank_indices({n}, {world}, {rank}, epoch={epoch}, "
                                f"seed={seed}, shuffle={shuffle}, drop_last={drop_last}) "
                                f"returned {list(got)}, torch's sampler gives {expected}"
                                + (sampler_mistake(write, list(got), n, world, rank, epoch,
                                                   seed, shuffle, drop_last)
                                   or rule_named(write, world, rank)))
    return cases


CASES = [(n, shuffle, drop_last, epoch, seed) for n in (1, 2, 3, 5, 7, 10, 11, 64)
         for shuffle in (True, False) for drop_last in (False, True)
         for epoch, seed in ((0, 0), (1, 0), (3, 7))]


def indices(n, world, rank, epoch, seed, shuffle, drop_last, *, pad="repeat", cut=True,
            count="torch", shuffled=None) -> list[int]:
    """torch's sampler written out, or with one change: the padding (``pad``: the order
    repeated from its start as often as needed; or "once", "last", "end"), the order not cut
    to total_size with drop_last, num_samples counted otherwise (``count``), the shuffle flag
    ignored (``shuffled`` True or False whatever ``shuffle`` says)."""
    if shuffle if shuffled is None else shuffled:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    floor, ceil = n // world, -(-n // world)
    num = {"torch": floor if drop_last else ceil, "swapped": ceil if drop_last else floor,
           "plus one": (floor if drop_last else n // world + 1)}[count]
    total = num * world
    padding = total - n
    if pad == "repeat":
        order = order * -(-total // n)
    elif padding > 0:
        order = {"once": order + order[:padding], "last": order + order[-1:] * padding,
                 "end": order + order[n - padding:] if padding <= n else order}[pad]
    return (order[:total] if cut else order)[rank::world]


#: Each plausible wrong rule (``indices``'s options), and what to say of it
RULES = {
    (("pad", "last"),): "You padded by repeating the last index; torch pads with the order "
                        "itself, repeated from its start",
    (("pad", "end"),): "You padded with the order's last indices; torch pads with its first "
                       "ones: the order repeated from its start",
    (("pad", "once"),): "You padded with the order's start once (order + order[:padding]), "
                        "which falls short when the padding is longer than the dataset (1 "
                        "sample at 3 ranks); torch repeats the order as many times as needed",
    (("cut", False),): "The order was not cut to total_size, so the first ranks got extra "
                       "indices (with drop_last the tail it drops, without it the repeats past "
                       "total_size): cut it to total_size before the strided slice",
    (("count", "swapped"),): "You swapped drop_last's two cases: with drop_last torch "
                             "rounds num_samples down (the tail is dropped), without it up "
                             "(the order is padded)",
    (("shuffled", False),): "You never shuffled: with shuffle=True the order is "
                            "torch.randperm(dataset_len, generator=g), g seeded with seed + epoch",
    (("shuffled", True),): "You shuffled with shuffle=False too: without it the order is 0, 1, "
                           "..., dataset_len - 1",
    (("count", "plus one"),): "Your num_samples = n // num_replicas + 1 is one too many when the "
                              "dataset splits evenly; torch rounds up: ceil(n / num_replicas)",
}


def rule_named(write, world, rank) -> str:
    """What to say of the wrong rule that gives the learner's indices in every case."""
    got = [list(write(n, world, rank, e, s, sh, d)) for n, sh, d, e, s in CASES]
    for options, said in RULES.items():
        if all(indices(n, world, rank, e, s, sh, d, **dict(options)) == mine
               for (n, sh, d, e, s), mine in zip(CASES, got)):
            return f". {said}"
    return ""


def global_random_states() -> dict:
    """The process-wide generators a sampler could touch, each as something comparable."""
    return {"torch's default generator": torch.get_rng_state().tolist(),
            "Python's random": random.getstate()}


def torch_indices(n, world, rank, epoch, seed, shuffle, drop_last) -> list[int]:
    sampler = TorchSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                           drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


def sampler_mistake(write, got, n, world, rank, epoch, seed, shuffle, drop_last) -> str:
    """Name a wrong answer that is another epoch's or seed's order (the generator seeded with
    only one of them), or the right order cut the wrong way: a contiguous block.

    An order is recognized on this case and on a 64-sample dataset too: with a handful of
    samples, two seeds often give the same permutation."""
    def gives(e, s):
        return all(list(write(size, world, rank, epoch, seed, shuffle, drop_last))
                   == torch_indices(size, world, rank, e, s, shuffle, drop_last)
                   for size in (n, 64))

    ignored = [(said, what) for said, what, e, s in (("epoch 0's", "the epoch", 0, seed),
                                                       ("seed 0's", "the seed", epoch, 0))
               if shuffle and (e, s) != (epoch, seed) and gives(e, s)]
    if ignored:
        return (f". Yours is {' or '.join(said for said, _ in ignored)} order: the shuffle "
                f"ignores {' or '.join(what for _, what in ignored)}. Seed the generator with "
                f"seed + epoch ({seed} + {epoch}): set_epoch changes the epoch so that each "
                "epoch is shuffled differently, and the same on every rank")
    shares = [torch_indices(n, world, r, epoch, seed, shuffle, drop_last) for r in range(world)]
    size = len(shares[0])
    padded = [shares[r][j] for j in range(size) for r in range(world)]  # before the rank's cut
    if got == padded[rank * size:(rank + 1) * size]:
        return (f". Yours is contiguous, not strided: the block {rank * size}:"
                f"{(rank + 1) * size} of the padded order, where torch's rank r takes every "
                "num_replicas-th index of it, starting at r")
    return ""


def grade_04():
    results = on_ranks(3, sampler_task)
    wrong = [r for r in results if isinstance(r, str)]
    yield (not wrong, f"3 ranks: every rank's indices equal torch's DistributedSampler's in "
           f"{results[0] if not wrong else 'all'} cases", wrong[0] if wrong else "")


