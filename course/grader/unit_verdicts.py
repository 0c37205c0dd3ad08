"""What exercise 17b's grader says of a report (``fsdp_unit.unit_task``), and its hints.

Each ``*_problem`` takes one rank's report of one run and returns the first thing it finds wrong,
in the learner's terms (which unit, which of its four methods, what torch does instead), or
None. A difference in bits that none of the named causes explains is said plainly, with the
smallest difference shown.
"""

from __future__ import annotations

import torch

from course.grader.checks import shown


def optimizer_problem(report: dict) -> str | None:
    return report["optimizer"]


def where(seen: dict) -> str:
    micro = f", backward {seen['micro'] + 1}" if seen["micro"] or not seen["sync"] else ""
    return f"step {seen['step']}{micro}{'' if seen['sync'] else ' (without sync)'}"


def held_problem(report: dict) -> str | None:
    for seen in report["backwards"]:
        for name, held in seen["after_forward"].items():
            torchs = seen["torch_after_forward"][name]
            if held == torchs:
                continue
            said = f"in {where(seen)}, after forward {name} "
            if name == "the root":
                return said + ("had freed its parameters; torch keeps the root's gathered from "
                               "forward to backward, which needs them first: after_forward "
                               "frees nothing on the root (self.is_root)")
            if torchs:
                return said + ("had freed its parameters; with reshard_after_forward False "
                               "(ZeRO-2) a unit keeps them from forward to backward: "
                               "after_forward frees only when reshard_after_forward is True")
            return said + ("still held its full parameters: after_forward frees them (ZeRO-3), "
                           "so that a rank holds one unit's full parameters at a time, besides "
                           "the root's")
        kept = [name for name, held in seen["after_backward"].items() if held]
        if kept:
            return (f"in {where(seen)}, after backward {' and '.join(kept)} still held "
                    "full parameters: after_backward frees them, with sync or without")
        left = {name: n for name, n in seen["full_grads"].items() if n}
        if seen["sync"] and left:
            name, n = next(iter(left.items()))
            return (f"in {where(seen)}, after backward {name}'s full parameters still held "
                    f"full-size gradients in .grad ({n} elements on this rank): the memory "
                    "sharding saves. Once reduce-scattered, set each full parameter's .grad to "
                    "None (zeroing it keeps the memory)")
    return None


def count_problem(report: dict) -> str | None:
    windows = [(f"in {where(seen)}", seen) for seen in report["backwards"]]
    windows += [(f"in the evaluation forward after step {e['step']}", e)
                for e in report["evaluations"]]
    windows.sort(key=lambda w: (w[1]["step"], "evaluation" in w[0]))
    for when, seen in windows:
        for name, counts in seen["counts"].items():
            said = f"{when}, {name} "
            extra = seen["extra"][name]
            if extra:
                gathers = counts["gathers"]
                return said + (f"was gathered {gathers} times, torch's {gathers - len(extra)}: "
                               f"its {extra[0]} gathered the parameters though they were "
                               "gathered already, an extra all-gather of the whole unit. "
                               "Gather only when they are not (self.gathered)")
            other = {kind: n for kind, n in counts.items()
                     if kind not in ("gathers", "reduce-scatters") and n}
            if other:
                kind, n = next(iter(other.items()))
                return said + (f"made {n} {kind} call{'s' if n > 1 else ''}: a unit's life "
                               "makes only all-gathers and reduce-scatters, each one a given "
                               "method")
            if "evaluation" in when:
                continue
            reductions = counts["reduce-scatters"]
            if reductions and not seen["sync"]:
                return said + ("made a reduce-scatter in a backward without sync: with "
                               "requires_gradient_sync False no collective is made, the full "
                               "gradients stay for the next backward to add to")
            if seen["sync"] and reductions != 1:
                return said + (f"made {reductions} reduce-scatters in one backward with sync "
                               "(every collective counts, the given method's and your own); "
                               "torch makes one per unit, of all its gradients at once")
    return None


def bits_problem(report: dict) -> str | None:
    since, before = [], []  # the backwards since the last one with sync; all before those
    for seen in report["backwards"]:
        since.append(seen)
        if not seen["sync"]:
            continue
        for i, (mine, torchs) in enumerate(zip(seen["grads"], seen["torch_grads"])):
            if not same(mine, torchs):
                said = gradient_problem(seen, since, before, i, mine, report["names"][i])
                return f"in {where(seen)}, {said}"
        before, since = before + since, []
    if report["params_differ"]:
        step, differ = report["params_differ"]
        names = ", ".join(report["names"][i] for i in differ)
        return (f"every gradient matched torch's, but after step {step} the shards of {names} "
                "differ: the optimizer must step each shard once, with the defaults given")
    return None


def same(a, b) -> bool:
    return (a is None) == (b is None) and (a is None or (a.shape == b.shape and
                                                          torch.equal(a, b)))


def gradient_problem(seen: dict, since: list[dict], before: list[dict], i: int, mine,
                     name: str) -> str:
    unit = next(unit for unit, members in seen["unit_params"].items() if i in members)
    what = f"the shard of {name} ({unit})"
    if mine is None:
        return (f"{what} has no .grad after the backward: after_backward puts each reduced "
                "gradient in its shard's .grad")
    position = seen["unit_params"][unit].index(i)
    calls = seen["reduced"].get(unit, [])
    if calls and position < len(calls[-1][0]) and position < len(calls[-1][1]):
        given, out = calls[-1][0][position], calls[-1][1][position]
        wrong_input = since[0]["own"] and input_problem(
            given, [s["own"][i] for s in since], [s["own"][i] for s in before if s["own"]])
        if wrong_input:
            return f"{what}: {wrong_input}"
        earlier = [s["grads"][i] for s in since[:-1] if s["sync"]]
        if len(since) > 1 or seen["micro"] > 0:
            if same(mine, out):
                return (f"{what} holds this backward's reduced gradient alone: it replaced "
                        "what the backward before it left in .grad. Add to a shard's .grad "
                        "when there is one (two backwards before a step accumulate)")
        if earlier and same(mine, earlier[-1]):
            return (f"{what} kept the earlier backward's gradient: add this backward's "
                    "reduced gradient to it")
        scaled = (scale_of(mine, out, seen["world"]) if not earlier and seen["micro"] == 0
                  else None)
        if scaled:
            return (f"{what} holds the reduced gradient times {scaled}: reduce_scatter returns "
                    "the average over the ranks already; put it in .grad as it is")
    return could_not_tell(what, mine, seen["torch_grads"][i])


def scale_of(mine: torch.Tensor, out: torch.Tensor, world: int) -> str | None:
    """The factor ``mine`` is ``out`` times, said as the learner wrote it, if it is one of the
    usual ones (W, 1 / W)."""
    if mine.shape != out.shape or not out.abs().max() > 0:
        return None
    for factor, said in ((world, "the world size"), (1 / world, "1 / the world size")):
        if torch.allclose(mine, out * factor, rtol=1e-5, atol=0):
            return said
    return None


def total(grads: list):
    out = grads[0].clone()
    for g in grads[1:]:
        out += g
    return out


def input_problem(given, own: list, earlier: list) -> str | None:
    """What is wrong with the gradient handed to the reduce-scatter, if it is not the sum of
    this rank's own gradients of the backwards since the last one with sync (``own``);
    ``earlier``: this rank's own gradients of every backward before those."""
    if given is None or any(g is None for g in own + earlier):
        return None
    expected = total(own)
    if torch.equal(given, expected):
        return None
    close = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-7)  # noqa: E731
    if len(own) > 1 and close(given, own[-1]):
        return ("the reduce-scatter got this backward's gradient only: the one of the backward "
                "without sync before it was lost. Without sync leave the full parameters' "
                ".grad as it is (autograd adds the next backward's to it)")
    if earlier and any(close(given, total(earlier[k:] + own)) for k in range(len(earlier))):
        return ("the reduce-scatter got this backward's gradient plus an earlier backward's: "
                "the full parameters' .grad still held it. Set it to None once "
                "reduce-scattered")
    return None


def could_not_tell(what: str, mine: torch.Tensor, torchs: torch.Tensor) -> str:
    if mine.shape != torchs.shape:
        return (f"{what} has shape {tuple(mine.shape)}, torch's {tuple(torchs.shape)}: could "
                "not tell what went wrong")
    differ = (mine != torchs).nonzero()
    at = tuple(differ[0].tolist())
    return (f"{what} differs from torch's in {len(differ)} of {mine.numel()} elements; could "
            f"not tell what went wrong. The first: at {list(at)} "
            f"{shown(mine[at].item(), torchs[at].item())}")
