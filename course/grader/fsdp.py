"""The checks behind lessons/grade.py for exercise 17, FSDP's reduce-scatter of a unit's gradients.

Root causes first: the divide factors (against torch's own function, 1 to 8 ranks); then, at 3
ranks beside torch's ``fully_shard`` on the same model and batches, the buffer the learner hands
to the collective, caught by a spy standing in for torch's reduce-scatter and all_reduce
(compared with torch's layout and with the layouts of the plausible mistakes, each times the
factors that might have divided it, so that a wrong buffer is named, not only found different);
then how it was averaged; last every rank's shards bit for bit against torch's.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from course.grader.checks import NotWritten, on_ranks
from miniddp.train.data import IN_FEATURES, OUT_FEATURES, make_dataset

try:  # FSDP2: public from torch 2.6, under _composable before
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:
    try:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        fully_shard = MixedPrecisionPolicy = None

WORLD = 3
HIDDEN = 40  # cut in 3: 14, 14, 12 rows; the last weight's 4 rows: 2, 2, 0
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COLLECTIVES = ("reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter", "all_reduce")

HINT_17 = (
    "One buffer of W equal rows, row r holding rank r's chunk of every gradient (each padded to "
    "chunk 0's rows); a SUM reduce-scatter leaves this rank its row summed; the division by W "
    "is split around the sum: all of it after the sum, except in fp16, where a power of two "
    "near sqrt(W) comes before it to keep fp16 in range.",
    "divide_factors: (1, W) unless the reduction is in fp16; there, double a factor from 1 while "
    "W is divisible by it and W over it is larger than it, the rest after. "
    "reduce_scatter_gradients: the rows per parameter are the ceiling of its dim 0 over W; "
    "build the buffer rank by rank, parameter by parameter, pad, cast to the reduce dtype; "
    "divide, reduce-scatter, divide; split this rank's row by parameter and cut each piece back "
    "to the shape of its (unpadded) chunk, in the gradient's dtype.",
    """divide_factors:
    if reduce_dtype != torch.float16:
        return 1, world_size
    before = 1
    while world_size % before == 0 and world_size / before > before:
        before *= 2
    return before, world_size / before
reduce_scatter_gradients:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = [-(-g.shape[0] // world_size) for g in grads]
    pieces = []
    for r in range(world_size):
        for g, n in zip(grads, rows):
            piece = chunk(g, world_size, r)
            pieces.append(torch.cat([piece, piece.new_zeros(n - len(piece), *g.shape[1:])]))
    buffer = torch.cat([p.reshape(-1) for p in pieces]).to(reduce_dtype)
    before, after = divide_factors(world_size, reduce_dtype)
    buffer.div_(before)
    out = buffer.new_empty(buffer.numel() // world_size)
    reduce_scatter(out, buffer)
    out.div_(after)
    sizes = [n * g[0].numel() for g, n in zip(grads, rows)]
    shards = [chunk(g, world_size, rank) for g in grads]
    return [part[:s.numel()].view_as(s).to(g.dtype)
            for part, s, g in zip(out.split(sizes), shards, grads)]""")


def exercise():
    return sys.modules["exercise_17"]


# ----- the divide factors -----

def torch_divide_factors(world: int, dtype: torch.dtype) -> tuple[float, float]:
    """(before, after) as torch's fully_shard divides: its own function where this torch has
    it (AVG means a sum, then / W), else its rule written out."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            _get_gradient_divide_factors,
        )
        group = type("Group", (), {"size": lambda self: world})()
        pre, post, op, _ = _get_gradient_divide_factors(group, None, dtype)
        if op == dist.ReduceOp.AVG:
            return 1, world
        return pre or 1, post or 1
    except (ImportError, TypeError):
        if dtype != torch.float16:
            return 1, world
        pre = 1
        while world % pre == 0 and world / pre > pre:
            pre *= 2
        return pre, world / pre


def grade_factors():
    for dtype in DTYPES.values():
        for world in range(1, 9):
            expected = torch_divide_factors(world, dtype)
            try:
                got = tuple(exercise().divide_factors(world, dtype))
            except NotImplementedError as todo:
                raise NotWritten(str(todo)) from None
            if got == expected:
                continue
            name = str(dtype).replace("torch.", "")
            why = f"at {world} ranks in {name} torch divides by {expected}, yours by {got}"
            if dtype == torch.float16 and got == (1, world):
                why += (": that is AVG's arithmetic, a sum then / W. In fp16 a sum of W "
                        "gradients can leave fp16's range, so torch divides by a power of two "
                        "near sqrt(W) before the sum and by the rest after")
            elif dtype != torch.float16 and got[0] != 1:
                why += (": for fp32 and bf16 torch divides nothing before the sum, all of it "
                        "after (a sum, then / W, as gloo's AVG does)")
            return False, why
    return True, ""


# ----- the spy, and what the buffer should have been -----

class Spy:
    """Stands in for torch's reduce-scatters and all_reduce during the learner's call: records
    each call's name, input buffer and op, then makes it."""

    def __init__(self):
        self.calls, self.originals = [], {n: getattr(dist, n) for n in COLLECTIVES
                                          if hasattr(dist, n)}

    def __enter__(self):
        for name, original in self.originals.items():
            setattr(dist, name, self.wrapped(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(dist, name, original)

    def wrapped(self, name, original):
        def call(*args, **kwargs):
            given = kwargs.get("input", kwargs.get("tensor", args[0] if name == "all_reduce"
                                                     else args[1] if len(args) > 1 else None))
            at = 1 if name == "all_reduce" else 2
            op = kwargs.get("op", args[at] if len(args) > at else dist.ReduceOp.SUM)
            if torch.is_tensor(given):
                given = given.detach().clone().reshape(-1)
            elif isinstance(given, (list, tuple)):
                given = torch.cat([t.detach().reshape(-1) for t in given])
            self.calls.append((name, given, op))
            return original(*args, **kwargs)
        return call


def chunk(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    rows = -(-t.shape[0] // world)
    return t[rank * rows:(rank + 1) * rows]


def padded(piece: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([piece, piece.new_zeros(rows - len(piece), *piece.shape[1:])]).reshape(-1)


def layouts(grads, world: int, dtype) -> dict[str, torch.Tensor]:
    """Torch's buffer, and the buffers of the plausible mistakes, in ``dtype``, undivided."""
    rows = [-(-g.shape[0] // world) for g in grads]
    unpadded = [torch.cat([chunk(g, world, r).reshape(-1) for g in grads]) for r in range(world)]
    longest = max(len(u) for u in unpadded)
    flat = torch.cat([g.reshape(-1) for g in grads])
    out = {
        "torch": torch.cat([padded(chunk(g, world, r), n) for r in range(world)
                            for g, n in zip(grads, rows)]),
        "no padding": torch.cat(unpadded),
        "no padding, each row padded at its end": torch.cat(
            [torch.cat([u, u.new_zeros(longest - len(u))]) for u in unpadded]),
        "flat": flat,
        "flat, padded at its end": torch.cat([flat, flat.new_zeros(-len(flat) % world)]),
    }
    return {name: b.to(dtype) for name, b in out.items()}


def divided(buffer: torch.Tensor, world: int, before) -> dict[str, torch.Tensor]:
    """``buffer`` as it may reach the collective: as is, divided by torch's before, times 1/W
    (DDP's way), divided by W."""
    return {"as is": buffer, "/ before": buffer / before,
            "x 1/W": buffer * (1 / world), "/ W": buffer / world}


def identify(given, grads, world, dtype):
    """(layout, division) naming the buffer that reached the collective, or None."""
    before = torch_divide_factors(world, dtype)[0]
    for layout, buffer in layouts(grads, world, dtype).items():
        for division, candidate in divided(buffer, world, before).items():
            if given.dtype == candidate.dtype and torch.equal(given, candidate):
                return layout, division
    for layout, buffer in layouts(grads, world, torch.float32).items():
        if given.dtype != dtype and given.shape == buffer.shape:
            return layout, f"in {str(given.dtype).replace('torch.', '')}"
    return None


# ----- one backward at 3 ranks, beside torch's fully_shard -----

def make_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                             nn.Tanh(), nn.Linear(HIDDEN, OUT_FEATURES))


def reduce_task(dtype_name: str) -> list[dict]:
    """One report per unit (each Linear): the collectives the learner made, and where its
    shards differ from torch's."""
    dtype, rank, world = DTYPES[dtype_name], dist.get_rank(), dist.get_world_size()
    x, y = make_dataset(n=16 * world, seed=0).tensors
    x, y = x[16 * rank:16 * (rank + 1)], y[16 * rank:16 * (rank + 1)]
    theirs, plain = make_model(), make_model()
    policy = MixedPrecisionPolicy(reduce_dtype=dtype)
    mesh = init_device_mesh("cpu", (world,))  # torch's default is a GPU wherever there is one
    for m in [m for m in theirs if isinstance(m, nn.Linear)] + [theirs]:
        fully_shard(m, mesh=mesh, mp_policy=policy)
    for model in (theirs, plain):
        F.mse_loss(model(x), y).backward()
    reports = []
    for unit, (mine, torchs) in enumerate(zip(plain, theirs)):
        if not isinstance(mine, nn.Linear):
            continue
        grads = [p.grad for p in mine.parameters()]
        error, got = None, []
        with Spy() as spy:
            try:
                got = exercise().reduce_scatter_gradients(grads, dtype)
            except NotImplementedError:
                raise
            except Exception as e:  # reported after the buffer it made, which names the cause
                error = f"{type(e).__name__}: {e}"
        expected = [p.grad.to_local() for p in torchs.parameters()]
        report = {"unit": unit, "calls": [(name, str(op), identify(given, grads, world, dtype)
                                           if given is not None else None)
                                          for name, given, op in spy.calls],
                  "shapes": [tuple(t.shape) for t in got], "dtypes": [str(t.dtype) for t in got],
                  "expected_shapes": [tuple(t.shape) for t in expected], "differ": None,
                  "error": error}
        if report["shapes"] == report["expected_shapes"]:
            differ = [int((a != b).sum()) for a, b in zip(got, expected)]
            if any(differ) or report["dtypes"] != [str(t.dtype) for t in expected]:
                report["differ"] = differ
        reports.append(report)
    return reports


LAYOUT_MISTAKES = {
    "flat": "your buffer holds the gradients whole, one after another (FSDP1's flat "
            "parameter); torch's has one row per rank: row r holds chunk r of every gradient",
    "flat, padded at its end": "your buffer holds the gradients whole, one after another "
            "(FSDP1's flat parameter), padded at its end; torch's has one row per rank: row r "
            "holds chunk r of every gradient",
    "no padding": "your rows hold each rank's chunks unpadded, so they differ in length; torch "
            "pads every chunk with zero rows to chunk 0's rows",
    "no padding, each row padded at its end": "your rows hold each rank's chunks unpadded, the "
            "row padded at its end; torch pads every chunk with zero rows to chunk 0's rows, so "
            "each parameter's chunk starts at the same place in every row",
}


def first_call_problem(world: int, dtype_name: str, r: dict, what: str) -> str | None:
    where = f"{dtype_name}, unit {r['unit']}"
    if not r["calls"]:
        return f"{where}: no reduce-scatter was made: use the reduce_scatter helper"
    if len(r["calls"]) > 1:
        return (f"{where}: {len(r['calls'])} collectives ({', '.join(c[0] for c in r['calls'])})"
                "; torch makes one reduce-scatter per unit")
    name, op, found = r["calls"][0]
    if what == "layout":
        if found is None:
            return (f"{where}: the buffer handed to {name} is none of torch's layout, the flat "
                    "one or the unpadded one (with or without a division): row r must hold "
                    "chunk r of every gradient, each padded to chunk 0's rows, in reduce_dtype")
        layout, division = found
        if division.startswith("in "):
            return (f"{where}: the buffer reached the collective {division}; torch reduces in "
                    f"reduce_dtype ({dtype_name}): cast it before")
        if layout != "torch":
            return f"{where}: {LAYOUT_MISTAKES[layout]}"
        if name == "all_reduce":
            return (f"{where}: an all_reduce of the whole buffer: each rank needs its row only, "
                    "a reduce-scatter")
        return None
    if found is None or found[1].startswith("in "):
        return f"{where}: not checked, the buffer is not torch's (above)"
    layout, division = found
    fp16 = DTYPES[dtype_name] == torch.float16
    if division == "x 1/W":
        return (f"{where}: the buffer was multiplied by 1/W before the sum (DDP's arithmetic); "
                "torch sums, then divides by W" + (" (fp16: by its factors)" if fp16 else ""))
    if "AVG" in op and fp16:
        return (f"{where}: ReduceOp.AVG in fp16: a sum of W gradients can leave fp16's range; "
                "torch divides by divide_factors' before, sums (SUM), then divides by after")
    if "AVG" not in op and "SUM" not in op:
        return f"{where}: the collective reduced with {op}; torch sums (SUM)"
    if division == "/ W" and not fp16:
        return (f"{where}: the buffer was divided by W before the sum; for {dtype_name} torch "
                "sums first, then divides by W")
    if fp16 and division != "/ before":
        return (f"{where}: in fp16 the buffer reached the sum {division}; torch divides it by "
                "divide_factors' before first, then by after once summed")
    return None


def bits_problem(world: int, dtype_name: str, r: dict) -> str | None:
    where = f"{dtype_name}, unit {r['unit']}"
    if r["error"]:
        return f"{where}: reduce_scatter_gradients raised {r['error']}"
    if r["shapes"] != r["expected_shapes"]:
        return (f"{where}: your shards have shapes {r['shapes']}, torch's {r['expected_shapes']}"
                ": each is this rank's rows of torch.chunk's cut, unpadded (rank 2 has none of "
                "the last weight)")
    if r["differ"] is None:
        return None
    if any(d.endswith("float16") for d in r["dtypes"]) and dtype_name != "fp32":
        return f"{where}: your shards are in {r['dtypes']}: cast them back to each gradient's dtype"
    return (f"{where}: {sum(r['differ'])} elements of your shards differ from torch's "
            f"(per parameter {r['differ']})")


def first_problem(results: dict, find, *args) -> str | None:
    for dtype_name, reports in results.items():
        for rank, units in enumerate(reports):
            for r in units:
                problem = find(WORLD, dtype_name, r, *args)
                if problem:
                    return f"rank {rank} of {WORLD}, {problem}"
    return None


def grade_17():
    if fully_shard is None:
        yield (False, "torch's FSDP2 (fully_shard), to grade against",
               f"torch {torch.__version__} has no fully_shard: exercise 17 needs torch 2.4 or "
               "later")
        return
    ok, why = grade_factors()
    yield (ok, "divide_factors: torch's (before, after) at 1 to 8 ranks, fp32, bf16 and fp16",
           why)
    if not ok:
        return
    results = {name: on_ranks(WORLD, reduce_task, name) for name in DTYPES}
    problem = first_problem(results, first_call_problem, "layout")
    yield (problem is None, f"{WORLD} ranks: one reduce-scatter per unit, of torch's layout (row "
           "r: chunk r of every gradient, padded to chunk 0's rows, in reduce_dtype)", problem)
    problem = first_problem(results, first_call_problem, "averaging")
    yield (problem is None, f"{WORLD} ranks: torch's averaging (fp32, bf16: sum, then / W; "
           "fp16: / before, sum, / after)", problem)
    problem = first_problem(results, bits_problem)
    yield (problem is None, f"{WORLD} ranks: every rank's gradient shards equal torch's "
           "fully_shard bit for bit (fp32, bf16 and fp16 reduction)", problem)
