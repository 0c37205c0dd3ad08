"""The checks behind lessons/grade.py for exercise 18, HSDP's gradient path across two groups.

First the divisions, against torch's own function for shard and replicate groups of 1 to 4 ranks
(a wrong rule is named: ``DIVISION_RULES``). Then, on 2 nodes of 3, 3 of 2 and 2 of 2 ranks
beside torch's ``fully_shard`` on the same 2-D mesh, model and batches, with fp32, bf16 and fp16
reduction: every rank's shards, bit for bit. A solution whose shards are torch's passes, however
it got them. When they differ, the first words name the first place where the learner's run
leaves torch's, each recorded by the same spy (``timeline``): a collective of another form or
group, a buffer with other elements or bits, a shard. Then a known mistake is named when it
speaks of that place: which collectives the learner made, in which group and in what order (a
missing all-reduce across the replicas, the groups in the other order or swapped, a group of
every rank), then what was divided between them, matched exactly against candidates computed
from what the spy recorded.
"""

import math
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from course.grader import fsdp
from course.grader.checks import NotWritten, on_ranks
from course.grader.fsdp import DTYPES, Spy, fully_shard, located, smallest_difference
from course.grader.fsdp_verdicts import fp16_loop
from course.grader.timeline import ranks_of

MESHES = ((2, 3), (3, 2), (2, 2))  # (nodes, ranks per node): one division by W shows at 3 a node


def exercise():
    return sys.modules["exercise_18"]


# ----- the divisions -----

def torch_divisions(shards: int, replicas: int, dtype) -> tuple[float, float, float]:
    """(before, after the reduce-scatter, after the all-reduce) as torch's fully_shard divides on
    a 2-D mesh: its own function where this torch has it (AVG: a sum, then / the group's size)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            _get_gradient_divide_factors,
        )
        groups = [type("Group", (), {"size": lambda self, n=n: n})() for n in (shards, replicas)]
        pre, post, op, _ = _get_gradient_divide_factors(*groups, dtype)
    except (ImportError, TypeError):
        return (1, shards, replicas) if dtype != torch.float16 else _fp16(shards * replicas)
    if op == dist.ReduceOp.AVG:
        return 1, shards, replicas
    return pre or 1, 1, post or 1


def _fp16(world: int) -> tuple[float, float, float]:
    before, after = fp16_loop(world)
    return before, 1, after


#: Rules a learner may have followed instead, as functions of (S, R, dtype), each with what to
#: say of it
DIVISION_RULES = {
    "one division by every rank's count (W = S x R) after both sums: torch averages each sum "
    "where it is made, / S after the reduce-scatter and / R after the all-reduce (the same "
    "while S is a power of two, not at 3 ranks a node)":
        lambda s, r, d: (1, 1, s * r) if d != torch.float16 else _fp16(s * r),
    "the shard group's size only: the replicas' count R is never divided out":
        lambda s, r, d: (1, s, 1) if d != torch.float16 else _fp16(s * r),
    "the two sizes swapped: torch divides by the shard group's size S after the reduce-scatter "
    "(its sum is over S ranks) and by R after the all-reduce":
        lambda s, r, d: (1, r, s) if d != torch.float16 else _fp16(s * r),
    "fp16 split from the shard group's size only (exercise 17's factors of S), R after the "
    "all-reduce: torch splits every rank's count, S x R":
        lambda s, r, d: (1, s, r) if d != torch.float16 else (
            fp16_loop(s)[0], 1, fp16_loop(s)[1] * r),
    "fp16 averaged in each group as fp32 is: in fp16 a sum can leave its range, so torch "
    "divides a power of two of S x R before the sum and the rest after the all-reduce":
        lambda s, r, d: (1, s, r),
    "fp16's split applied to fp32 or bf16 too: those are averaged in each group, / S after the "
    "reduce-scatter and / R after the all-reduce":
        lambda s, r, d: _fp16(s * r),
}


def grade_divisions() -> str | None:
    shapes = sorted(((s, r, d) for s in range(1, 5) for r in range(1, 5) if s * r > 1
                     for d in DTYPES.values()), key=lambda k: (min(k[:2]) < 2, k[:2]))
    try:
        got = {k: tuple(exercise().divisions(*k)) for k in shapes}
    except NotImplementedError as todo:
        raise NotWritten(str(todo)) from None
    wrong = [k for k in shapes if not same(got[k], torch_divisions(*k))]
    if not wrong:
        return None
    s, r, d = wrong[0]
    shown = (f"with S = {s} ranks a node and R = {r} nodes, in {str(d)[6:]}, torch divides by "
             f"{torch_divisions(s, r, d)}, yours by {got[wrong[0]]}")
    for said, rule in DIVISION_RULES.items():
        if all(same(got[k], rule(*k)) for k in shapes):
            return f"{said}; {shown}"
    return f"could not tell which rule yours follows; {shown}"


def same(a, b) -> bool:
    return len(a) == 3 and all(math.isclose(x, y) for x, y in zip(a, b))


# ----- one backward beside torch's fully_shard on a 2-D mesh -----

#: This rank's 2-D meshes, one per shape: each makes process groups of its own, which costs more
#: than the backward it grades, so every dtype and solution graded on these ranks shares them
_meshes: dict = {}


def mesh_of(nodes: int):
    world = dist.get_world_size()
    if (nodes, world) not in _meshes:
        _meshes[nodes, world] = init_device_mesh("cpu", (nodes, world // nodes),
                                                 mesh_dim_names=("replicate", "shard"))
    return _meshes[nodes, world]


def hsdp_task(nodes: int, names: list[str]) -> list[tuple[str, list[dict]]]:
    """Each reduction dtype in turn, to the first where a rank found a problem (the ranks agree
    on it, so all stop together): the dtype, and one report per unit (each Linear)."""
    done = []
    for name in names:
        reports = unit_reports(nodes, name)
        done.append((name, reports))
        found = torch.tensor([float(any(r["problem"] for r in reports))])
        dist.all_reduce(found)
        if found.item():
            break
    return done


#: fsdp.torch_shards by (nodes, world size, dtype): it does not depend on the learner's file, so
#: it is computed once for every file graded on these ranks (every rank fills it in the same
#: call: torch's collectives stay matched)
_REFERENCES: dict[tuple[int, int, str], list] = {}


def torch_reference(nodes: int, dtype_name_: str) -> list[tuple[int, list, list, list]]:
    key = (nodes, dist.get_world_size(), dtype_name_)
    if key not in _REFERENCES:
        _REFERENCES[key] = fsdp.torch_shards(mesh_of(nodes), DTYPES[dtype_name_])
    return _REFERENCES[key]


def unit_reports(nodes: int, dtype_name_: str) -> list[dict]:
    """One report per unit (each Linear): what differs from torch's shards, and why."""
    mesh = mesh_of(nodes)
    groups = {"shard": mesh.get_group("shard"), "replicate": mesh.get_group("replicate")}
    return [{"unit": unit, "problem": learner_problem([g.clone() for g in grads], expected,
                                                      groups, DTYPES[dtype_name_], torch_calls)}
            for unit, grads, expected, torch_calls in torch_reference(nodes, dtype_name_)]


def learner_problem(grads, expected, groups, dtype, torch_calls) -> str | None:
    """What differs from torch's shards: first where the learner's collectives and shards leave
    torch's, then a known mistake's name when it speaks of that place."""
    error, got = None, []
    with Spy(exercise()) as spy:
        try:
            got = list(exercise().reduce_gradients([g.clone() for g in grads], groups["shard"],
                                                   groups["replicate"], dtype))
        except NotImplementedError:
            raise
        except Exception as e:  # reported after the collectives, which may name the cause
            error = f"{type(e).__name__}: {e}"
    if not error and equal(got, expected):
        return None
    names = {ranks_of(g): k for k, g in groups.items()}

    def where(known, about):
        return located(known, spy.calls, got, torch_calls, expected, names, about)
    said = collectives_problem(spy.calls, {k: ranks_of(g) for k, g in groups.items()})
    if said:
        return where(said + (f" (then reduce_gradients raised {error})" if error else ""),
                     ("collective",))
    if error:
        return where(f"reduce_gradients raised {error}", ("collective", "input", "shard"))
    if [t.shape for t in got] != [t.shape for t in expected] or any(
            a.dtype != b.dtype for a, b in zip(got, expected)):
        return where(None, ())
    return where(division_problem(spy.calls, grads, got, expected, dtype, groups),
                 ("input", "shard"))


def equal(got, expected) -> bool:
    return len(got) == len(expected) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
        for a, b in zip(got, expected))


def collectives_problem(calls: list[dict], ranks: dict) -> str | None:
    """The learner's collectives against torch's: one reduce-scatter inside the shard group,
    then one all-reduce across the replicate group. None when they were those."""
    seen = [("reduce-scatter" if c["name"] != "all_reduce" else "all-reduce",
             next((k for k, r in ranks.items() if r == c["ranks"]), "every rank"))
            for c in calls]
    if seen == [("reduce-scatter", "shard"), ("all-reduce", "replicate")]:
        return None
    listed = ", ".join(f"{kind} in the {where} group" if where != "every rank"
                       else f"{kind} over every rank" for kind, where in seen) or "none"
    if any(where == "every rank" for _, where in seen):
        return (f"a collective over every rank (you made: {listed}): pass the group, "
                "shard_group for the reduce-scatter and replicate_group for the all-reduce")
    if ("all-reduce", "replicate") not in seen and ("reduce-scatter", "replicate") not in seen:
        return (f"no all-reduce across the replicate group (you made: {listed}): each node then "
                "keeps its own node's average and the replicas drift apart; all_reduce this "
                "rank's reduce-scattered row across replicate_group, the one collective that "
                "crosses nodes")
    if seen[:2] == [("all-reduce", "replicate"), ("reduce-scatter", "shard")]:
        return (f"the groups in the other order (you made: {listed}): torch reduce-scatters "
                "inside the shard group first, then all-reduces only this rank's row across the "
                "replicate group; all-reducing the whole buffer first sums in another order and "
                "sends S times the bytes across the slow links")
    if ("reduce-scatter", "replicate") in seen or ("all-reduce", "shard") in seen:
        return (f"the groups swapped (you made: {listed}): the reduce-scatter runs inside the "
                "shard group (the node's ranks, which share the cut), the all-reduce across "
                "the replicate group (the ranks holding the same rows)")
    return (f"you made {listed}; torch makes one reduce-scatter in the shard group, then one "
            "all-reduce in the replicate group, for all of a unit's gradients at once")


def division_problem(calls, grads, got, expected, dtype, groups) -> str:
    """The collectives were torch's: what was divided, where. Each candidate divides what the
    spy recorded as torch would not, and is matched exactly against the learner's result."""
    from course.grader.fsdp_verdicts import laid_out

    shards, replicas = (dist.get_world_size(groups[k]) for k in ("shard", "replicate"))
    before, middle, after = torch_divisions(shards, replicas, dtype)
    scatter, reduce = calls
    torchs_in = laid_out([g.float() for g in grads], shards, "rank-major", "below").to(dtype)
    if not torch.equal(scatter["given"], torchs_in / before if before != 1 else torchs_in):
        return ("the buffer handed to the reduce-scatter is not the layout cast to "
                f"reduce_dtype and divided by before ({before})" + (
                    ": cast first, then divide, in reduce_dtype" if dtype == torch.float16
                    else ""))
    row, summed = scatter["out"], reduce["out"]
    between = [(middle, None)] + [(n, said) for n, said in (
        (1, "nothing was divided between the two sums"),
        (shards * replicas, "you divided by every rank's count W after the reduce-scatter"),
        (replicas, "you divided by R after the reduce-scatter (the sizes swapped)")) if n != middle]
    found = next((said for n, said in between if torch.equal(reduce["given"], row / n)), "?")
    if found == "?":
        return smallest_difference(got, expected, "could not tell what was divided after the "
                                                  "reduce-scatter; ")
    if found:
        return f"{found}; torch divides the reduce-scatter's sum by {middle:g} there"
    for n, said in ((1, "nothing was divided after the all-reduce"),
                    (shards * replicas, "you divided by every rank's count W after the "
                                        "all-reduce too"),
                    (shards, "you divided by S after the all-reduce (the sizes swapped)")):
        if n != after and same_shards(summed / n, got, grads, shards, groups):
            return f"{said}; torch divides the all-reduce's sum by {after:g}"
    return smallest_difference(got, expected, "the collectives and the division between them "
                                              "were torch's; ")


def same_shards(row, got, grads, shards, groups) -> bool:
    mine = exercise().shards_of(row, grads, shards, dist.get_rank(groups["shard"]))
    return equal(got, mine)


def first_problem(results: dict) -> str | None:
    for (nodes, world, name), reports in results.items():
        for rank, units in enumerate(reports):
            for r in units:
                if r["problem"]:
                    return (f"{nodes} nodes of {world // nodes} ranks, {name} reduction, unit "
                            f"{r['unit']}, rank {rank}: {r['problem']}")
    return None


def grade_18():
    if fully_shard is None:
        yield (False, "torch's FSDP2 (fully_shard), to grade against",
               f"torch {torch.__version__} has no fully_shard: exercise 18 needs torch 2.4 or "
               "later")
        return
    problem = grade_divisions()
    yield (problem is None, "divisions: torch's places for the averaging, shard and replicate "
           "groups of 1 to 4 ranks, fp32, bf16 and fp16", problem)
    if problem:
        return
    problem = None
    for nodes, per_node in MESHES:  # to the first mesh and dtype that differ
        by_rank = on_ranks(nodes * per_node, hsdp_task, nodes, list(DTYPES))
        problem = first_problem({(nodes, nodes * per_node, name): [done[i][1] for done in by_rank]
                                 for i, (name, _) in enumerate(by_rank[0])})
        if problem:
            break
    yield (problem is None, "2 nodes of 3, 3 of 2 and 2 of 2 ranks: every rank's gradient shards "
           "equal torch's fully_shard on the 2-D mesh bit for bit (fp32, bf16 and fp16)", problem)
