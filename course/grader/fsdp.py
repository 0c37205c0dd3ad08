"""The checks behind lessons/grade.py for exercise 17, FSDP's reduce-scatter of a unit's gradients.

First the divide factors, against torch's own function at 1 to 8 ranks (a wrong rule is named:
``fsdp_verdicts.FP16_RULES``). Then, at 2 and 3 ranks beside torch's ``fully_shard`` on the same
model and batches, with fp32, bf16 and fp16 reduction: the collectives the learner made, seen by
a spy standing in for torch's reduce-scatters and all_reduce; and every rank's shards, bit for
bit. A solution whose shards are torch's passes, whatever its buffer looked like on the way.
When they differ, the verdict's first words are the first place where the learner's run leaves
torch's (``timeline``: the same spy records torch's own collectives in its backward): a
collective of another form or group, a buffer with other elements or bits, a shard. Then the
spy's record says why, when a known mistake speaks of that place: the buffer handed to the
collective is matched exactly against layouts built from the same gradients
(``fsdp_verdicts.identify``), then the collective's op, then what was done to its output; where
none explains it, the first differing element and what torch's collectives did are said.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from course.data import IN_FEATURES, OUT_FEATURES, make_dataset
from course.grader.checks import NotWritten, on_ranks, shown
from course.grader.fsdp_verdicts import (
    buffer_said,
    chunk,
    dtype_name,
    factors_verdict,
    identify,
    laid_out,
    torch_divide_factors,
)
from course.grader.timeline import (
    Recorder,
    argument,  # noqa: F401 (exercise 18's grader takes it from here)
    collective_events,
    first_divergence,
    value_events,
    verdict,
    what_torch_did,
)

try:  # FSDP2: public from torch 2.6, under _composable before
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:
    try:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        fully_shard = MixedPrecisionPolicy = None

WORLDS = (3, 2)  # 3 first: there the chunks are padded, which tells more layouts apart
HIDDEN = 40  # cut in 3: 14, 14, 12 rows; the last weight's 4 rows: 2, 2, 0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COLLECTIVES = ("reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter", "all_reduce")
REDUCE_SCATTERS = COLLECTIVES[:3]

def exercise():
    return sys.modules["exercise_17"]


def grade_factors() -> str | None:
    got = {}
    for name, dtype in DTYPES.items():
        for world in range(1, 9):
            try:
                got[(name, world)] = tuple(exercise().divide_factors(world, dtype))
            except NotImplementedError as todo:
                raise NotWritten(str(todo)) from None
    return factors_verdict(got, DTYPES)


class Spy(Recorder):
    """Stands in for the reduce-scatters and the all_reduce, on the learner's side and on
    torch's: each call's name, group, input (flat), op and output (after the call)."""

    def __init__(self, module=None):
        super().__init__(COLLECTIVES, module)


# ----- one backward beside torch's fully_shard -----

def make_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                             nn.Tanh(), nn.Linear(HIDDEN, OUT_FEATURES))


def torch_shards(mesh, dtype) -> list[tuple[int, list, list, list]]:
    """(unit, this rank's gradients, torch's shards of them, torch's collectives for them) for
    each unit (each Linear), after one backward of a plain copy of the model and of torch's
    ``fully_shard`` of it on ``mesh``; its collectives recorded by the learner's ``Spy``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = make_dataset(n=16 * world, seed=0).tensors
    x, y = x[16 * rank:16 * (rank + 1)], y[16 * rank:16 * (rank + 1)]
    theirs, plain = make_model(), make_model()
    for m in [m for m in theirs if isinstance(m, nn.Linear)] + [theirs]:
        fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=dtype))
    F.mse_loss(plain(x), y).backward()
    loss = F.mse_loss(theirs(x), y)
    with Spy() as spy:
        loss.backward()
    units = [unit for unit, m in enumerate(plain) if isinstance(m, nn.Linear)]
    calls = dict(zip(reversed(units), per_unit(spy.calls)))  # the backward runs last unit first
    return [(unit, [p.grad for p in plain[unit].parameters()],
             [p.grad.to_local() for p in theirs[unit].parameters()], calls.get(unit, []))
            for unit in units]


def per_unit(calls: list[dict]) -> list[list[dict]]:
    """A backward's collectives, cut where each unit's reduce-scatter begins."""
    cut: list[list[dict]] = []
    for call in calls:
        if call["name"] in REDUCE_SCATTERS or not cut:
            cut.append([])
        cut[-1].append(call)
    return cut


#: torch_shards by (world size, dtype): it does not depend on the learner's file, so it is
#: computed once for every file graded on these ranks (every rank fills it in the same call:
#: torch's collectives stay matched)
_REFERENCES: dict[tuple[int, str], list] = {}


def torch_reference(dtype_name_: str) -> list[tuple[int, list, list, list]]:
    world = dist.get_world_size()
    if (world, dtype_name_) not in _REFERENCES:
        mesh = init_device_mesh("cpu", (world,))  # torch's default is a GPU wherever there is one
        _REFERENCES[world, dtype_name_] = torch_shards(mesh, DTYPES[dtype_name_])
    return _REFERENCES[world, dtype_name_]


def reduce_task(dtype_name_: str) -> list[dict]:
    """One report per unit (each Linear): the collectives the learner made, and what differs
    from torch's shards and why."""
    dtype, reports = DTYPES[dtype_name_], []
    for unit, cached, expected, torch_calls in torch_reference(dtype_name_):
        grads = [g.clone() for g in cached]  # fresh for each file, as the learner's are
        error, got = None, []
        with Spy(exercise()) as spy:
            try:
                got = list(exercise().reduce_scatter_gradients([g.clone() for g in grads], dtype))
            except NotImplementedError:
                raise
            except Exception as e:  # reported after the collectives, which may name the cause
                error = f"{type(e).__name__}: {e}"
        bits = bits_problem(spy.calls, grads, got, expected, dtype, error)
        reports.append({"unit": unit, "calls": call_problem(spy.calls, grads, error),
                        "bits": bits and located(bits, spy.calls, got, torch_calls, expected)})
    return reports


def located(known: str, calls: list[dict], got: list, torch_calls: list[dict], expected: list,
            groups: dict | None = None, about=("collective", "input", "shard")) -> str:
    """A verdict whose first words are the first event where the learner's collectives and
    shards leave torch's (``timeline``), then ``known`` if it speaks of that event; where only
    the shards differ, what torch's collectives did."""
    mine = collective_events(calls, "", groups) + value_events("shard of parameter", got, "")
    theirs = (collective_events(torch_calls, "", groups)
              + value_events("shard of parameter", expected, ""))
    found = first_divergence(mine, theirs)
    said = verdict(found, known, about)
    if found is None or (known and said.endswith(known[1:])):
        return said
    shards = first_divergence(value_events("shard of parameter", got, ""),
                              value_events("shard of parameter", expected, ""))
    if shards and not found.kind.startswith("shard"):
        said += f"; then {shards.line}"
    return said + f" ({what_torch_did(torch_calls, groups)})"


def call_problem(calls: list[dict], grads, error) -> str | None:
    names = [c["name"] for c in calls]
    if error and not calls:
        return None  # said with the shards
    if not calls:
        return "no collective was made: use the reduce_scatter helper"
    if len(calls) > 1:
        each = len(calls) == len(grads)
        return (f"{len(calls)} collectives ({', '.join(names)}) for a unit of {len(grads)} "
                "gradients" + (": one per gradient" if each else "") + "; torch makes one "
                "reduce-scatter per unit, of every gradient at once (and where an element sits "
                "in that one buffer decides its rounding)")
    if names[0] == "all_reduce":
        return ("an all_reduce of the whole buffer, then this rank's part: each rank needs its "
                "row only, which one reduce-scatter gives it")
    return None


def bits_problem(calls, grads, got, expected, dtype, error) -> str | None:
    """None when the shards are torch's, bit for bit; else what went wrong, in the learner's
    terms, or the smallest difference when that cannot be told."""
    if not error and equal(got, expected):
        return None
    world = dist.get_world_size()
    if len(calls) == 1:  # a wrong buffer is the news, even if the code then raised
        found = identify(calls[0]["given"], grads, world, dtype)
        said = found and buffer_said(found, world, dtype, dtype == torch.float16)
        if said:
            return said + (f" (then reduce_scatter_gradients raised {error})" if error else "")
    if error:
        return f"reduce_scatter_gradients raised {error}"
    shapes = [tuple(t.shape) for t in got]
    if shapes != [tuple(t.shape) for t in expected]:
        return (f"your shards have shapes {shapes}, torch's "
                f"{[tuple(t.shape) for t in expected]}: each is this rank's rows of "
                "torch.chunk's cut, unpadded (at 3 ranks rank 2 has none of the last weight)")
    if any(a.dtype != b.dtype for a, b in zip(got, expected)):
        return (f"your shards are in {[dtype_name(t.dtype) for t in got]}: cast each back to "
                "its gradient's dtype")
    if len(calls) != 1:
        return smallest_difference(got, expected, "")
    return collective_problem(calls[0], grads, got, expected, dtype)


def equal(got, expected) -> bool:
    return len(got) == len(expected) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        for a, b in zip(got, expected))


def collective_problem(call: dict, grads, got, expected, dtype) -> str:
    """The collective's input was torch's buffer: its form, its op, what came after it."""
    world = dist.get_world_size()
    if identify(call["given"], grads, world, dtype) is None:
        return buffer_difference(call["given"], grads, world, dtype)
    if call["name"] == "reduce_scatter":
        return ("you used dist.reduce_scatter, the list form: gloo sums its pieces in another "
                "order than the one flat buffer of reduce_scatter_single (the reduce_scatter "
                "helper), which torch uses: other bits from 3 ranks on")
    if "AVG" in call["op"] and dtype == torch.float16:
        return ("ReduceOp.AVG in fp16: a sum of W gradients can leave fp16's range; torch "
                "divides by before, sums (SUM), then divides by after")
    if "AVG" not in call["op"] and "SUM" not in call["op"]:
        return f"the collective reduced with {call['op']}; torch sums (SUM)"
    return after_problem(call, grads, got, expected, dtype, world)


def after_problem(call, grads, got, expected, dtype, world) -> str:
    """The buffer and the collective were torch's: what was done to the output."""
    before, after = torch_divide_factors(world, dtype)
    out = call["out"]
    if "AVG" in call["op"]:
        after = 1
    candidates = {
        "the shards hold the sum: nothing was divided after it; torch divides by "
        f"{'after' if before != 1 else 'W'} ({after}) once summed": out,
        f"you divided the sum by W ({world}); torch divides it by after = W / before ({after})":
            out / world,
        f"you multiplied the sum by 1 / {after:g}; torch divides by {after:g} (the reciprocal "
        "is itself rounded)": out * (1 / after),
        f"you divided the sum by before ({before}): the factors swapped": out / before,
    }
    for said, values in candidates.items():
        if same_shards(values, grads, got, world):
            return said
    return smallest_difference(got, expected, "the buffer and the collective were torch's; ")


def same_shards(values, grads, got, world) -> bool:
    rank = dist.get_rank()
    rows = [-(-g.shape[0] // world) for g in grads]
    if values.numel() != sum(n * g[0].numel() for g, n in zip(grads, rows)):
        return False
    parts = values.split([n * g[0].numel() for g, n in zip(grads, rows)])
    for part, g, mine in zip(parts, grads, got):
        shard = chunk(g, world, rank)
        if not torch.equal(part[:shard.numel()].view_as(shard).to(g.dtype), mine):
            return False
    return True


def buffer_difference(given, grads, world, dtype) -> str:
    before = torch_divide_factors(world, dtype)[0]
    torchs = laid_out([g.float() for g in grads], world, "rank-major", "below").to(dtype)
    torchs = torchs / before if before != 1 else torchs
    said = ("could not tell what went wrong: the buffer handed to the collective is none of "
            "the layouts tried (rows by rank, by gradient, gradients whole; chunks padded "
            "below, above or not at all; in reduce_dtype or not; divided before the sum or "
            "not). ")
    if given is None or given.numel() != torchs.numel():
        return said + (f"It holds {0 if given is None else given.numel()} elements, torch's "
                       f"{torchs.numel()} (W rows of chunk 0's size for every gradient)")
    if given.dtype != torchs.dtype:
        return said + f"It is in {dtype_name(given.dtype)}, torch's in {dtype_name(dtype)}"
    k = int((given != torchs).nonzero()[0])
    row = k // (len(given) // world)
    return said + (f"The first difference from torch's: element {k} (row {row}), "
                   f"{shown(given[k].item(), torchs[k].item())}")


def smallest_difference(got, expected, prefix: str) -> str:
    differ = [int((a != b).sum()) for a, b in zip(got, expected)]
    k = next(i for i, d in enumerate(differ) if d)
    at = tuple((got[k] != expected[k]).nonzero()[0].tolist())
    return (prefix + f"could not tell what went wrong: {sum(differ)} elements of your shards "
            f"differ from torch's (per parameter {differ}); the first, parameter {k} at "
            f"{list(at)}: {shown(got[k][at].item(), expected[k][at].item())}")


def first_problem(results: dict, key: str) -> str | None:
    for (world, name), reports in results.items():
        for rank, units in enumerate(reports):
            for r in units:
                if r[key]:
                    return f"{world} ranks, {name}, unit {r['unit']}, rank {rank}: {r[key]}"
    return None


def grade_17():
    if fully_shard is None:
        yield (False, "torch's FSDP2 (fully_shard), to grade against",
               f"torch {torch.__version__} has no fully_shard: exercise 17 needs torch 2.4 or "
               "later")
        return
    problem = grade_factors()
    yield (problem is None, "divide_factors: torch's (before, after) at 1 to 8 ranks, fp32, bf16 "
           "and fp16", problem)
    if problem:
        return
    results = {(world, name): on_ranks(world, reduce_task, name)
               for world in WORLDS for name in DTYPES}
    problem = first_problem(results, "calls")
    yield (problem is None, "2 and 3 ranks: one reduce-scatter per unit", problem)
    problem = first_problem(results, "bits")
    yield (problem is None, "2 and 3 ranks: every rank's gradient shards equal torch's "
           "fully_shard bit for bit (fp32, bf16 and fp16 reduction)", problem)
