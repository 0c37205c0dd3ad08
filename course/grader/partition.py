"""Exercise 15's first check: the owners, against torch's ``ZeroRedundancyOptimizer``.

Cases are parameter lists of 1-D and 2-D shapes (so that rows, elements and bytes order the
parameters differently, and many sizes tie), each in one dtype and in mixed dtypes, at 2 and 3
ranks. A wrong rule is named by its parts: what the parameters were sorted by and in which
order, what measured a rank's load, how a tie between ranks was broken. Every combination of
those is tried against every case, so two rules that agree on one case are told apart by the
others; the words name only the parts that differ from torch's.
"""

from __future__ import annotations

from itertools import product

import torch
import torch.distributed as dist
from torch import nn

SHAPES = [(1,), (3,), (8,), (64,), (100,), (500,), (4, 16), (16, 4), (8, 8), (2, 50), (50, 2),
          (3, 1)]
DTYPES = (torch.float32, torch.float64, torch.float16)
MEASURES = {"elements": lambda shape, size: shape.numel(),
            "rows": lambda shape, size: shape[0],
            "bytes": lambda shape, size: shape.numel() * size,
            "parameters": lambda shape, size: 1}
ORDERS = ("largest first", "model order", "smallest first", "largest first, ties reversed")


def parameter_shapes(cases: int = 40) -> list[list[tuple[int, ...]]]:
    """Parameter lists with many equal sizes: ties are where rules differ."""
    g = torch.Generator().manual_seed(0)
    return [[SHAPES[int(i)] for i in torch.randint(0, len(SHAPES),
                                                   (int(torch.randint(1, 12, (), generator=g)),),
                                                   generator=g)] for _ in range(cases)]


def torch_owners(params) -> list[int]:
    """The owner torch's ZeroRedundancyOptimizer gives each parameter (a collective)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    ids = {id(p) for p in TorchZeRO(params, torch.optim.SGD, lr=0.1).optim.param_groups[0][
        "params"]}
    found = torch.tensor([dist.get_rank() if id(p) in ids else -1 for p in params])
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return found.tolist()


def partition_task(owners) -> list[tuple]:
    """Each shape list twice: all float32, then of mixed dtypes. torch's rule counts elements
    whatever their dtype (``t.numel()`` in ``_partition_parameters``), but its optimizer refuses
    mixed dtypes, so the expected owners of the mixed list are those of float32 stand-ins."""
    cases = []
    for k, shapes in enumerate(parameter_shapes()):
        expected = torch_owners([nn.Parameter(torch.zeros(s)) for s in shapes])
        for dtypes in ([torch.float32] * len(shapes),
                       [DTYPES[(k + i) % len(DTYPES)] for i in range(len(shapes))]):
            params = [nn.Parameter(torch.zeros(s, dtype=d)) for s, d in zip(shapes, dtypes)]
            sizes = [torch.empty((), dtype=d).element_size() for d in dtypes]
            cases.append((shapes, sizes, [str(d)[6:] for d in dtypes], expected,
                          list(owners(params, dist.get_world_size()))))
    return cases


def greedy(loads: list[int], world: int, order, lowest: bool = True) -> list[int]:
    owners, load = [0] * len(loads), [0] * world
    for i in order:
        least = min(load)
        owners[i] = load.index(least) if lowest else world - 1 - load[::-1].index(least)
        load[owners[i]] += loads[i]
    return owners


def ordered(keys: list[int], order: str) -> list[int]:
    n = range(len(keys))
    return {"largest first": lambda: sorted(n, key=lambda i: keys[i], reverse=True),
            "model order": lambda: list(n),
            "smallest first": lambda: sorted(n, key=lambda i: keys[i]),
            "largest first, ties reversed": lambda: sorted(n, key=lambda i: keys[i])[::-1]}[
        order]()


def rule_owners(rule: tuple, shapes, sizes, world: int) -> list[int]:
    """The owners under ``rule`` = (sorted by, order, load measure, ties to the lowest rank),
    or ("in turn",)."""
    if rule == ("in turn",):
        return [i % world for i in range(len(shapes))]
    sort_by, order, load, lowest = rule
    measure = lambda name: [MEASURES[name](torch.Size(s), b)  # noqa: E731
                            for s, b in zip(shapes, sizes)]
    return greedy(measure(load), world, ordered(measure(sort_by), order), lowest)


TORCHS = ("elements", "largest first", "elements", True)
RULES = [("in turn",)] + [rule for rule in product(MEASURES, ORDERS, MEASURES, (True, False))
                          if rule != TORCHS]


def said(rule: tuple) -> str:
    """What differs in ``rule`` from torch's, in the learner's terms."""
    if rule == ("in turn",):
        return ("you dealt the parameters out in turn; torch balances elements: each parameter "
                "goes to the rank that owns the fewest elements so far")
    sort_by, order, load, lowest = rule
    parts = []
    if sort_by == load != "elements" and load != "parameters":
        how = "shape[0]" if load == "rows" else "numel * element_size"
        parts.append(f"you balanced {load} ({how}) instead of elements: torch's sort and its "
                     "load both count numel(), all of a parameter's elements, whatever its "
                     "shape and dtype")
    else:
        if sort_by != "elements" and order != "model order":
            parts.append(f"you sorted by {sort_by}" + (" (shape[0])" if sort_by == "rows" else "")
                         + "; torch sorts by the number of elements "
                         "(numel), whatever the shape and dtype")
        if load == "parameters":
            parts.append("you balanced the number of parameters each rank owns; torch balances "
                         "their sizes: each parameter goes to the rank that owns the fewest "
                         "elements (numel) so far")
        elif load != "elements":
            parts.append(f"you counted each rank's load in {load}"
                         + (" (shape[0])" if load == "rows" else "") + "; torch counts elements "
                         "(numel), whatever the shape and dtype")
    parts += {"model order": ["you took the parameters in model order; torch takes the largest "
                              "first"],
              "smallest first": ["you took the smallest first; torch takes the largest first"],
              "largest first, ties reversed": [
                  "equal sizes came out in reverse order: torch's sort (sorted with "
                  "reverse=True) is stable and keeps them in model order"]}.get(order, [])
    if not lowest:
        parts.append("on a tie you chose a higher rank; torch chooses the lowest")
    return "; ".join(parts)


def what_went_wrong(cases, world: int) -> str:
    """The rule the learner's owners follow on every case, named; the simplest (fewest parts
    unlike torch's) when several fit."""
    fitting = [rule for rule in RULES if all(
        rule_owners(rule, shapes, sizes, world) == got for shapes, sizes, _, _, got in cases)]
    if not fitting:
        return ("could not tell which rule yours follows: torch's is largest first (by "
                "elements, equal sizes in model order), each to the rank owning the fewest "
                "elements so far, the lowest such rank on a tie")
    return said(min(fitting, key=lambda rule: (len(rule), sum(
        a != b for a, b in zip(rule, TORCHS)))))


def grade_partition(on_ranks, owners_task, worlds) -> str | None:
    for world in worlds:
        cases = on_ranks(world, owners_task)[0]
        wrong = [case for case in cases if case[4] != case[3]]
        if wrong:  # shown: the smallest case that differs
            shapes, _, dtypes, expected, got = min(wrong, key=lambda case: (
                len(case[0]), sum(a != b for a, b in zip(case[3], case[4]))))
            return (f"{what_went_wrong(cases, world)}. The smallest case: parameters of "
                    f"shapes {[list(s) for s in shapes]} (dtypes {dtypes}) at {world} ranks, "
                    f"torch's owners {expected}, yours {got}")
    return None
