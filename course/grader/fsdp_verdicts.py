"""What exercise 17's grader says: torch's divide factors and the rules a learner may have
followed instead; the buffers a reduce-scatter may have been handed, each named by how it
differs from torch's; what was done to the collective's output.

Every candidate is built from the same gradients as the learner's, so a match is exact, and a
mistake is named by its parts (the order of the rows, where the padding went, the dtype, what
divided the buffer before the sum) rather than looked up in a list of whole mistakes.
"""

from __future__ import annotations

import math
from itertools import product

import torch
import torch.distributed as dist

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
        return (1, world) if dtype != torch.float16 else fp16_loop(world)


def fp16_loop(world: int) -> tuple[int, float]:
    before = 1
    while world % before == 0 and world / before > before:
        before *= 2
    return before, world / before


def _power_of_two_at_most(x: float) -> int:
    p = 1
    while 2 * p <= x:
        p *= 2
    return p


#: Rules a learner may have written for fp16's (before, after), as functions of W, each with
#: what to say of it
FP16_RULES = {
    "ReduceOp.AVG's arithmetic, nothing before the sum and W after: in fp16 a sum of W "
    "gradients can leave fp16's range, so torch divides part of W before the sum":
        lambda w: (1, w),
    "the factors swapped: torch's before is the power of two, divided out before the sum, "
    "and after = W / before comes after it":
        lambda w: tuple(reversed(fp16_loop(w))),
    "before as round(sqrt(W)): torch's before is no rounding of sqrt(W) but its loop's end":
        lambda w: (round(math.sqrt(w)), w / round(math.sqrt(w))),
    "before as int(sqrt(W)): torch's before is no rounding of sqrt(W) but its loop's end":
        lambda w: (int(math.sqrt(w)), w / int(math.sqrt(w))),
    "before as the largest power of two up to sqrt(W): torch's before is its loop's end, "
    "which can pass sqrt(W)":
        lambda w: (_power_of_two_at_most(math.sqrt(w)), w / _power_of_two_at_most(math.sqrt(w))),
    "after as W // before, an integer division: after = W / before, a fraction at odd W":
        lambda w: (fp16_loop(w)[0], w // fp16_loop(w)[0]),
}
LOOP_SAID = ("torch's loop starts before at 1 and, while the value it has divides W and W / "
             "it is larger than it, doubles it; it stops only when that test fails, so it can "
             "end on a value that does not divide W (W = 6: 1, 2, 4, so (4, 1.5))")


def factors_verdict(got: dict, dtypes: dict[str, torch.dtype]) -> str | None:
    """``got[(dtype name, W)]``: the learner's (before, after). None when every one is
    torch's; else the rule the learner followed, named, or the first difference."""
    wrong = [(name, w) for (name, w), pair in got.items()
             if tuple(pair) != torch_divide_factors(w, dtypes[name])]
    if not wrong:
        return None
    name, w = wrong[0]
    shown = (f"at {w} ranks in {name} torch divides by {torch_divide_factors(w, dtypes[name])}"
             f", yours by {tuple(got[(name, w)])}")
    if dtypes[name] != torch.float16:
        fp16 = all(tuple(got[(name, k)]) == fp16_loop(k) for k in range(1, 9))
        return (("you applied fp16's split to " + name if fp16 else f"in {name} you divided "
                 "before the sum") + ": for fp32 and bf16 torch divides nothing before the "
                "sum and all of W after (what gloo's ReduceOp.AVG does); " + shown)
    for said, rule in FP16_RULES.items():
        if all(same_pair(got[(name, k)], rule(k)) for k in range(1, 9)):
            return f"{said}; {shown}. {LOOP_SAID}"
    befores = [got[(name, k)][0] for k in range(1, 9)]
    if all(b > 0 and (int(b) & (int(b) - 1)) == 0 and b == int(b) for b in befores):
        return f"your loop ends elsewhere than torch's; {shown}. {LOOP_SAID}"
    return f"could not tell which rule yours follows; {shown}. {LOOP_SAID}"


def same_pair(a, b) -> bool:
    return len(a) == 2 and all(math.isclose(x, y) for x, y in zip(a, b))


# ----- the buffer handed to the collective -----

def chunk(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    rows = -(-t.shape[0] // world)
    return t[rank * rows:(rank + 1) * rows]


def pad(piece: torch.Tensor, rows: int, where: str) -> torch.Tensor:
    zeros = piece.new_zeros(rows - len(piece), *piece.shape[1:])
    parts = {"below": [piece, zeros], "above": [zeros, piece]}.get(where, [piece])
    return torch.cat(parts).reshape(-1)


def laid_out(grads, world: int, order: str, padding: str) -> torch.Tensor | None:
    """The gradients in one flat buffer: rows by rank ("rank-major", torch's), each gradient's
    chunks together ("parameter-major"), each gradient whole ("whole"), or every row holding
    this rank's chunks ("this rank's rows"); every chunk padded
    "below" (torch's), "above", or not ("none"), or each row or the whole buffer padded at its
    end. None for a combination that is no layout."""
    rows = [-(-g.shape[0] // world) for g in grads]
    if order == "whole":
        if padding not in ("none", "buffer end"):
            return None
        flat = torch.cat([g.reshape(-1) for g in grads])
        return torch.cat([flat, flat.new_zeros(-len(flat) % world)]) if padding != "none" \
            else flat
    if padding == "buffer end":
        return None
    chunk_padding = padding if padding in ("below", "above") else "none"
    which = (lambda r: dist.get_rank()) if order == "this rank's rows" else (lambda r: r)
    by_rank = [[pad(chunk(g, world, which(r)), n, chunk_padding) for g, n in zip(grads, rows)]
               for r in range(world)]
    if order == "parameter-major":
        if padding == "row end":
            return None
        return torch.cat([by_rank[r][k] for k in range(len(grads)) for r in range(world)])
    rows_flat = [torch.cat(row) for row in by_rank]
    if padding == "row end":
        longest = max(len(r) for r in rows_flat)
        rows_flat = [torch.cat([r, r.new_zeros(longest - len(r))]) for r in rows_flat]
    return torch.cat(rows_flat)


ORDERS = ("rank-major", "parameter-major", "whole", "this rank's rows")
PADDINGS = ("below", "above", "none", "row end", "buffer end")
DIVISIONS = ("torch's", "none", "x 1/W", "/ W", "after (the factors swapped)",
             "before, in fp32 then cast")


def divided(buffer32: torch.Tensor, dtype, division: str, before: float, after: float,
            world: int) -> torch.Tensor:
    """The fp32 layout ``buffer32`` cast to ``dtype`` and divided as ``division`` says."""
    if division == "before, in fp32 then cast":
        return (buffer32 / before).to(dtype)
    cast = buffer32.to(dtype)
    return {"torch's": cast / before if before != 1 else cast, "none": cast,
            "after (the factors swapped)": cast / after, "x 1/W": cast * (1 / world),
            "/ W": cast / world}[division]


def identify(given: torch.Tensor, grads, world: int, reduce_dtype) -> dict | None:
    """The layout, dtype and division that ``given`` is, exactly, or None."""
    before, after = torch_divide_factors(world, reduce_dtype)
    grad_dtype = grads[0].dtype
    for order, padding in product(ORDERS, PADDINGS):
        layout = laid_out([g.float() for g in grads], world, order, padding)
        if layout is None or layout.numel() != given.numel():
            continue
        for dtype, division in product((reduce_dtype, grad_dtype), DIVISIONS):
            if division.startswith("after") and reduce_dtype != torch.float16:
                continue  # only fp16 has two factors to swap
            if given.dtype == dtype and torch.equal(
                    given, divided(layout, dtype, division, before, after, world)):
                return {"order": order, "padding": padding, "dtype": dtype,
                        "division": division}
    return None


PADDING_SAID = {
    "above": "you padded each chunk with zero rows above its rows; torch pads below them (its "
             "rows first, then zeros up to chunk 0's rows)",
    "none": "your chunks are not padded, so the rows differ in length and each rank's part "
            "starts elsewhere; torch pads every chunk with zero rows below it to chunk 0's rows",
    "row end": "you padded each row at its end instead of each chunk; torch pads every chunk "
               "below its rows to chunk 0's rows, so that each gradient's chunk starts at the "
               "same place in every row",
    "buffer end": "",
}


def buffer_said(found: dict, world: int, reduce_dtype, fp16: bool) -> str | None:
    """What is wrong with a buffer ``identify`` named, in the learner's terms; None if it is
    torch's."""
    if found["order"] == "whole":
        return ("your buffer holds the gradients whole, one after another (FSDP1's flat "
                "parameter)" + (", padded at its end" if found["padding"] != "none" else "")
                + "; torch's has one row per rank: row r holds chunk r of every gradient")
    if found["order"] == "this rank's rows":
        return ("every row of your buffer holds this rank's chunks (chunk(g, world_size, rank)); "
                "row r must hold rank r's, chunk(g, world_size, r), so that the sum of row r "
                "over the ranks reaches rank r")
    if found["order"] == "parameter-major":
        return ("your buffer is parameter-major: each gradient's chunks side by side, gradient "
                "after gradient; torch's is rank-major: row r holds chunk r of every gradient, "
                "so that the reduce-scatter hands rank r its chunk of each")
    if found["padding"] != "below":
        return PADDING_SAID[found["padding"]]
    if found["dtype"] != reduce_dtype:
        return (f"the buffer reached the collective in {dtype_name(found['dtype'])}; torch "
                f"reduces in reduce_dtype ({dtype_name(reduce_dtype)}): cast it before")
    before, after = torch_divide_factors(world, reduce_dtype)
    return {
        "torch's": None,
        "none": "in fp16 nothing was divided before the sum; torch divides the buffer by "
                f"before ({before}) first, to keep the sum in fp16's range",
        "after (the factors swapped)": f"the buffer was divided by after ({after}) before the "
                                       f"sum: the factors swapped; torch divides by before "
                                       f"({before}) first and by after once summed",
        "x 1/W": "the buffer was multiplied by 1/W before the sum (DDP's arithmetic); torch "
                 "sums, then divides" + (" by its factors" if fp16 else " by W"),
        "/ W": "the buffer was divided by W before the sum; torch " + (
            f"divides by before ({before}), sums, then divides by after ({after})" if fp16
            else "sums first, then divides by W"),
        "before, in fp32 then cast": "you divided by before in fp32, then cast to fp16; torch "
                                     "casts first, then divides in fp16, and the two round "
                                     "differently for the smallest gradients",
    }[found["division"]]


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")
