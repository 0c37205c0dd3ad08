"""The checks behind lessons/grade.py for exercise 05: which parameters share a bucket, against
torch's own assignment, first at the limits and then on random lists, then the gradients of
torch's DDP against one all_reduce per bucket of the learner's layout."""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from course.data import make_dataset
from course.grader.checks import flat_grads, many_layers, on_ranks
from miniddp.buckets import bucket_limits

CAP_MB_05 = 0.01


def boundary_cases() -> list[tuple[str, list[torch.Tensor]]]:
    """Parameter lists that put a bucket exactly at its limit, one element short of it and one
    past it: the first limit (4000 bytes) and the cap (9000), float32 and float64, one
    parameter or several adding up to it. Torch closes a bucket once it holds AT LEAST the
    limit, so these are where a comparison written the other way shows."""
    f32, f64 = torch.float32, torch.float64
    t = lambda n, dtype=f32: torch.empty(n, dtype=dtype)  # noqa: E731
    cases = []
    for name, dtype, size in (("float32", f32, 4), ("float64", f64, 8)):
        first, cap = 4000 // size, 9000 // size
        for delta, where in ((0, "exactly at"), (-1, "one element short of"),
                             (1, "one element past")):
            cases += [
                (f"one {name} parameter {where} the first limit", [t(first + delta, dtype),
                                                                    t(10, dtype)]),
                (f"{name} parameters adding up to {where} the first limit",
                 [t(first // 2, dtype), t(first - first // 2 + delta, dtype), t(10, dtype)]),
                (f"{name}: the second bucket {where} the cap",
                 [t(first, dtype), t(cap + delta, dtype), t(10, dtype)]),
                (f"{name}: parameters adding up to {where} the cap in the second bucket",
                 [t(first, dtype), t(cap // 3, dtype), t(cap - cap // 3 + delta, dtype),
                  t(10, dtype)]),
                (f"{name}: the third bucket {where} the cap",
                 [t(first, dtype), t(cap, dtype), t(cap + delta, dtype), t(10, dtype)]),
            ]
    cases += [  # the limits count per (dtype, device): each dtype's first bucket at 4000 bytes
        ("float32 and float64 interleaved, each exactly at its first limit",
         [t(1000), t(500, f64), t(10), t(10, f64)]),
        ("float64 first at its limit, float32 after it still in its first bucket",
         [t(500, f64), t(999), t(1), t(10)]),
    ]
    return cases


def describe(params) -> list[tuple[int, str]]:
    return [(p.numel() * p.element_size(), str(p.dtype)[6:]) for p in params]


def simulated(params, first: int, cap: int, *, more_than=(False, False), per_dtype=True,
              global_first=False, before=False, limits=("first", "cap"), size=None):
    """Which parameters share a bucket under torch's rule, or under it with one change: a
    bucket closed only past its limit (``more_than``, at the first limit and at the cap), one
    open bucket for all dtypes, the first limit for the first bucket overall, a bucket closed
    before the parameter that would cross its limit, other limits, another count of bytes."""
    size = size or (lambda p: p.numel() * p.element_size())
    closed, open_buckets, count = [], {}, 0
    for i, p in enumerate(params):
        entry = open_buckets.setdefault(p.dtype if per_dtype else None, [[], 0, 0])
        which = 0 if (count if global_first else entry[2]) == 0 else 1
        limit = (first, cap)[("first", "cap").index(limits[which])]
        if before and entry[0] and entry[1] + size(p) > limit:
            closed.append(entry[0])
            entry[0], entry[1], entry[2], count = [], 0, entry[2] + 1, count + 1
            which = 1
            limit = (first, cap)[("first", "cap").index(limits[1])]
        entry[0].append(i)
        entry[1] += size(p)
        if not before and (entry[1] > limit if more_than[which] else entry[1] >= limit):
            closed.append(entry[0])
            entry[0], entry[1], entry[2], count = [], 0, entry[2] + 1, count + 1
    closed += [members for members, _, _ in open_buckets.values() if members]
    return sorted(sorted(b) for b in closed)


AT_LEAST = "torch closes a bucket once it holds at least its limit (>=)"
#: Each plausible wrong rule (``simulated``'s options), and what to say of it
RULES = {
    (("more_than", (True, True)),):
        f"you close a bucket only once it holds MORE than its limit; {AT_LEAST}: a bucket "
        "exactly at its limit closes, with the parameter that reached it",
    (("more_than", (True, False)),):
        f"at the first limit you close a bucket only once it holds MORE than it; {AT_LEAST}, "
        "the first limit as the cap",
    (("more_than", (False, True)),):
        f"at the cap you close a bucket only once it holds MORE than it; {AT_LEAST}, the cap "
        "as the first limit",
    (("before", True),):
        "you closed a bucket before adding the parameter that would take it past its limit; "
        "torch adds the parameter first and closes the bucket once it holds at least its "
        "limit: the parameter that crosses it stays in the bucket it closes",
    (("per_dtype", False),):
        "you kept one open bucket for all dtypes; torch keeps one per dtype (a bucket is one "
        "flat tensor, of one dtype), each with its own first limit",
    (("global_first", True),):
        "only the first bucket overall closed at first_bytes; torch gives the first bucket of "
        "EACH dtype first_bytes, and cap_bytes to the later ones",
    (("limits", ("cap", "cap")),):
        "every bucket closed at cap_bytes; the first bucket of each dtype closes at first_bytes",
    (("limits", ("first", "first")),):
        "every bucket closed at first_bytes; after each dtype's first bucket the limit is "
        "cap_bytes",
    (("size", "numel"),):
        "you counted elements; the limits are in bytes: numel() * element_size()",
    (("size", "four"),):
        "you counted 4 bytes per element whatever the dtype; a parameter's bytes are numel() "
        "* element_size() (8 for float64)",
}
SIZES = {"numel": lambda p: p.numel(), "four": lambda p: 4 * p.numel()}


def rule_named(cases, got) -> str | None:
    """What to say of the wrong rule that gives ``got`` on every one of ``cases``."""
    for options, said in RULES.items():
        kwargs = {k: SIZES[v] if k == "size" else v for k, v in options}
        if all(simulated(params, 4000, 9000, **kwargs) == mine
               for params, mine in zip(cases, got)):
            return said
    return None


def random_cases() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    cases = []
    for case in range(30):
        count = int(torch.randint(1, 12, (), generator=g))
        cases.append([torch.empty(int(torch.randint(1, 3000, (), generator=g)),
                                  dtype=torch.float64 if case % 3 == 0 and k % 2 else
                                  torch.float32) for k in range(count)])
    return cases


def order_mistake(got: list[list[int]], expected: list[list[int]]) -> str:
    """What a layout of torch's buckets in another order, or of other members, got wrong."""
    if got == expected[::-1]:
        return (". Yours are torch's buckets in the opposite order: the list sorted by smallest "
                "index must be reversed (the last layers' gradients are ready first, so their "
                "bucket is launched first)")
    if sorted(map(sorted, got)) == sorted(map(sorted, expected)):
        if got == [sorted(b) for b in expected]:
            return (". Your buckets are torch's, but the indices inside a bucket are not in "
                    "model order")
        return (". Yours are torch's buckets in another order: sort them by their smallest "
                "index, then reverse the list")
    return ""


def buckets_task():
    assign = sys.modules["exercise_05"].assign_buckets
    members = lambda layout: sorted(sorted(b) for b in layout)  # noqa: E731  (order aside)
    boundary = boundary_cases()
    every = [params for _, params in boundary] + random_cases()
    for what, params in boundary:  # which parameters share a bucket; order comes next
        theirs, _ = dist._compute_bucket_assignment_by_size(params, [4000, 9000])
        expected, got = [list(b) for b in reversed(theirs)], assign(params, 4000, 9000)
        if members(got) != members(expected):
            said = rule_named(every, [members(assign(p, 4000, 9000)) for p in every])
            return "boundary", (f"{what}: for parameters of (bytes, dtype) {describe(params)}, "
                                f"first_bytes=4000, cap_bytes=9000: expected {expected}, got "
                                f"{got}. " + (said or "Your buckets follow none of the usual "
                                              "other rules (closing past the limit, before "
                                              "adding, one bucket for all dtypes, other "
                                              "limits, elements for bytes)"))
    for params in random_cases():
        theirs, _ = dist._compute_bucket_assignment_by_size(params, [4000, 9000])
        expected, got = [list(b) for b in reversed(theirs)], assign(params, 4000, 9000)
        if got != expected:
            return "random", (f"for parameters of (bytes, dtype) {describe(params)}, "
                              f"first_bytes=4000, cap_bytes=9000: expected {expected}, got {got}"
                              + order_mistake([list(b) for b in got], expected))
    model, theirs = many_layers(), TorchDDP(many_layers(), bucket_cap_mb=CAP_MB_05,
                                            find_unused_parameters=True)
    x, y = make_dataset(n=16, seed=dist.get_rank()).tensors
    for m in (model, theirs):
        F.mse_loss(m(x), y).backward()
    params = list(model.parameters())
    layout = assign(params, *bucket_limits(CAP_MB_05))
    for members in layout:  # lesson 05's all_reduce_in_buckets
        flat = torch.cat([params[i].grad.reshape(-1) for i in members]) * (1.0 / 3)
        dist.all_reduce(flat)
        offset = 0
        for i in members:
            params[i].grad.copy_(flat[offset:offset + params[i].numel()].view_as(params[i]))
            offset += params[i].numel()
    same = torch.equal(flat_grads(model), flat_grads(theirs))
    return None, (same, (flat_grads(model) - flat_grads(theirs)).abs().max().item(), layout)


def grade_05():
    results = on_ranks(3, buckets_task)
    failed, detail = results[0]
    yield (failed != "boundary", f"{len(boundary_cases())} parameter lists at the limits "
           "(exactly at, one element short of, one past; first limit and cap; float32 and "
           "float64): the parameters that share a bucket are torch's",
           detail if failed == "boundary" else "")
    if failed == "boundary":
        return
    layout_ok = failed is None
    yield (layout_ok, "30 parameter lists (mixed dtypes too): the layout of torch's "
           "_compute_bucket_assignment_by_size, reversed", "" if layout_ok else detail)
    if layout_ok:
        same = all(r[1][0] for r in results)
        diff = max(r[1][1] for r in results)
        yield (same, "3 ranks: one all_reduce per bucket of yours gives torch's DDP's gradients "
               "bit for bit", f"largest difference {diff:.3g} with your layout {detail[2]}")

