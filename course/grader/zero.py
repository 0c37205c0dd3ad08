"""The checks behind lessons/grade.py for exercise 15, the sharded optimizer step (ZeRO stage 1).

Root causes first: the partition (torch's rule, on 40 parameter lists: ``partition``), then
what each rank's optimizer holds, then where every parameter is sent from (a spy standing in for
``dist.broadcast`` has the ranks compare each call before it is made, so a wrong source fails
with a message instead of a hang), and last the parameters after every step, bit for bit,
against torch's ``ZeroRedundancyOptimizer`` beside torch's DDP.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from course.data import make_dataset
from course.grader.checks import Waited, many_layers, on_ranks
from course.grader.partition import grade_partition, partition_task, torch_owners

OPTIMIZERS = {"SGD with momentum": (torch.optim.SGD, {"lr": 0.2, "momentum": 0.9}),
              "Adam": (torch.optim.Adam, {"lr": 0.01})}
STEPS = 3
WORLDS = (2, 3)


def exercise():
    return sys.modules["exercise_15"]


def positions(params, chosen) -> list[int]:
    ids = {id(p) for p in chosen}
    return [i for i, p in enumerate(params) if id(p) in ids]


# ----- the partition (course.grader.partition) -----

def owners_task():
    return partition_task(exercise().owners)


# ----- the step -----

class Disagreement(Exception):
    """The ranks were about to make different collective calls."""


class BroadcastSpy:
    """Stands in for dist.broadcast during the learner's step.

    Before each call the ranks compare (one small all_gather) which parameter they send, from
    which rank: calls that would not match fail with a message instead of a hang. A source
    that is not the parameter's owner is recorded.
    """

    END = -2  # "my step is over", compared like a call

    def __init__(self, params, owners):
        self.original = dist.broadcast
        self.index = {p.data_ptr(): i for i, p in enumerate(params)}
        self.owners, self.calls, self.wrong = owners, 0, []
        self.works: list[dict] = []  # each asynchronous broadcast's record: waited for or not
        self.foreign: list[int] = []  # where the tensors sent that are no parameter live
        self.order: list[str] = []  # "broadcast" and "step" (the local optimizer's), as called

    def _agree(self, row: list[int]) -> None:
        rows = [torch.empty(3, dtype=torch.long) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, torch.tensor(row))
        rows = [r.tolist() for r in rows]
        if all(r == rows[0] for r in rows):
            return
        described = "; ".join(f"rank {k}: " + ("its step was over" if r[0] == self.END else
                                               f"parameter {r[0]} from rank {r[1]}")
                              for k, r in enumerate(rows))
        if any(r[0] == self.END for r in rows) or len({r[0] for r in rows}) > 1:
            why = ("every rank must take part in the broadcast of every parameter, in the same "
                   "order: the owner sending, the others receiving into their copy")
        else:
            why = ("the ranks named different sources: all must name the parameter's owner "
                   "(self.owners), not themselves")
        raise Disagreement(f"broadcast {self.calls + 1} of the step did not match across the "
                           f"ranks ({described}): {why}")

    def __call__(self, tensor, src=None, *args, **kwargs):
        index = self.index.get(tensor.data_ptr(), -1)
        if index < 0:
            self.foreign.append(tensor.data_ptr())
        self._agree([index, -1 if src is None else int(src), tensor.numel()])
        if index >= 0 and src != self.owners[index]:
            self.wrong.append((index, src, self.owners[index]))
        self.calls += 1
        self.order.append("broadcast")
        work = self.original(tensor, src, *args, **kwargs)
        if not (kwargs.get("async_op") or (len(args) > 1 and args[1])):
            return work
        self.works.append({"waited": False})
        return Waited(work, self.works[-1])

    def unwaited(self) -> int:
        return sum(not w["waited"] for w in self.works)

    def finish(self) -> None:
        self._agree([self.END, self.END, self.END])


def noted(function, order: list, what: str):
    """``function``, appending ``what`` to ``order`` at each call."""
    def call(*args, **kwargs):
        order.append(what)
        return function(*args, **kwargs)
    return call


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x_all, y_all = make_dataset(n=16 * STEPS, seed=rank).tensors
    return list(zip(x_all.chunk(STEPS), y_all.chunk(STEPS)))


#: torch's DDP + ZeroRedundancyOptimizer, by (world size, optimizer): the parameters after
#: every step and the bytes of state its optimizer keeps on this rank after the first. The
#: same for every file graded on these ranks, so trained once (every rank fills it in the same
#: call, so the collectives it takes stay matched)
_TORCH_STEPS: dict[tuple[int, str], tuple[list[list[torch.Tensor]], int]] = {}


def torch_steps(name: str) -> tuple[list[list[torch.Tensor]], int]:
    key = (dist.get_world_size(), name)
    if key not in _TORCH_STEPS:
        cls, defaults = OPTIMIZERS[name]
        theirs = TorchDDP(many_layers())
        reference = TorchZeRO(list(theirs.parameters()), cls, **defaults)
        after, state = [], None
        for x, y in batches(dist.get_rank()):
            reference.zero_grad()
            F.mse_loss(theirs(x), y).backward()
            reference.step()
            after.append([p.detach().clone() for p in theirs.parameters()])
            state = state_bytes(reference.optim) if state is None else state
        _TORCH_STEPS[key] = after, state
    return _TORCH_STEPS[key]


def sharded_task(name: str):
    cls, defaults = OPTIMIZERS[name]
    rank, world = dist.get_rank(), dist.get_world_size()
    torch_after, torch_state = torch_steps(name)
    ours = TorchDDP(many_layers())
    params = list(ours.parameters())
    owners = torch_owners(list(many_layers().parameters()))
    mine = exercise().ShardedOptimizer(ours.parameters(), cls, **defaults)
    local = getattr(mine, "local", None)
    report = {"local": type(local).__name__, "count": len(params), "share": None,
              "torch_share": [i for i, owner in enumerate(owners) if owner == rank],
              "state": None, "torch_state": None, "disagreement": None, "wrong": [],
              "mismatch": None, "unwaited": None, "defaults": defaults, "options": None,
              "sent_first": False, "steps_taken": 0, "owners": owners, "summed": 0,
              "sent_gradients": 0}
    if isinstance(local, torch.optim.Optimizer):
        report["options"] = {key: local.defaults.get(key) for key in defaults}
        report["share"] = positions(params, [p for g in local.param_groups for p in g["params"]])
    calls: list[str] = []  # this step's broadcasts and local steps, in order
    if isinstance(local, torch.optim.Optimizer):
        local.step = noted(local.step, calls, "step")
    for s, (x, y) in enumerate(batches(rank)):
        before = [p.detach().clone() for p in params]
        mine.zero_grad()
        F.mse_loss(ours(x), y).backward()
        spy = BroadcastSpy(params, owners)
        calls.clear()
        spy.order = calls
        dist.broadcast, all_reduce = spy, dist.all_reduce
        dist.all_reduce = noted(all_reduce, calls, "all_reduce")
        grads = {p.grad.data_ptr() for p in params if p.grad is not None}
        try:
            mine.step()
            spy.finish()
        except Disagreement as error:
            report["disagreement"] = str(error)
            return report
        finally:
            dist.broadcast, dist.all_reduce = spy.original, all_reduce
        report["summed"] += calls.count("all_reduce")
        report["sent_gradients"] += sum(ptr in grads for ptr in spy.foreign)
        report["wrong"] += spy.wrong
        report["steps_taken"] = max(report["steps_taken"], calls.count("step"))
        if "broadcast" in calls and "step" in calls:
            report["sent_first"] |= calls.index("broadcast") < calls.index("step")
        if spy.unwaited() and report["unwaited"] is None:
            report["unwaited"] = (s, spy.unwaited(), len(spy.works))
        if s == 0 and isinstance(local, torch.optim.Optimizer):
            report["state"], report["torch_state"] = state_bytes(local), torch_state
        their_params = torch_after[s]
        differ = [i for i, (a, b) in enumerate(zip(params, their_params)) if not torch.equal(a, b)]
        if differ and report["mismatch"] is None:
            report["mismatch"] = {
                "step": s, "differ": differ,
                "stale": [i for i in differ if torch.equal(params[i], before[i])],
                "owned": [i for i in differ if owners[i] == rank],
                "diff": max((params[i] - their_params[i]).abs().max().item() for i in differ)}
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    replicas = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(replicas, flat)
    report["ranks_agree"] = all(torch.equal(r, flat) for r in replicas)
    return report


def state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values()
               for t in s.values() if torch.is_tensor(t))


def share_problem(rank: int, r: dict) -> str | None:
    if r["share"] is None:
        return (f"self.local is a {r['local']}: it must be the optimizer_class built over this "
                "rank's share of the parameters")
    if r["share"] == list(range(r["count"])):
        return (f"rank {rank}'s optimizer holds all {r['count']} parameters: each rank's must "
                "hold only those it owns, or every rank keeps the whole state, which is what "
                "sharding is for")
    if r["share"] != r["torch_share"]:
        whose = [k for k in range(max(r["owners"]) + 1)
                 if r["share"] == [i for i, o in enumerate(r["owners"]) if o == k]]
        said = (f"it holds rank {whose[0]}'s share" if whose else
                "it holds every parameter but its own" if sorted(r["share"] + r["torch_share"])
                == list(range(r["count"])) else "")
        return (f"rank {rank}'s optimizer holds the parameters {r['share']}; torch's gives it "
                f"{r['torch_share']}{': ' + said if said else ''} (self.owners[i] == self.rank "
                "picks this rank's own)")
    if r["options"] != r["defaults"]:
        return (f"rank {rank}'s optimizer was built with {r['options']}, not the defaults "
                f"given, {r['defaults']}: pass them on, optimizer_class(share, **defaults)")
    if r["state"] == 0 < r["torch_state"]:
        return (f"after one step rank {rank}'s optimizer holds no state, torch's "
                f"{r['torch_state']} bytes: self.local never stepped")
    if r["state"] != r["torch_state"]:
        return (f"after one step rank {rank} keeps {r['state']} bytes of optimizer state, "
                f"torch's {r['torch_state']}")
    return None


def send_problem(rank: int, r: dict) -> str | None:
    if r["disagreement"]:
        return r["disagreement"]
    if r["unwaited"]:
        step, unwaited, works = r["unwaited"]
        return (f"in step {step}, {unwaited} of the {works} works that broadcast(async_op=True) "
                "returned were never waited for: a parameter may still be arriving when step "
                "returns, and the next forward read it half-written. Wait for every work "
                "(work.wait()) before step returns, or use a blocking broadcast")
    if r["wrong"]:
        index, src, owner = r["wrong"][0]
        return (f"parameter {index} was broadcast from rank {src}, but rank {owner} owns it: "
                "only the owner stepped it, so only the owner holds its new value")
    return None


def bits_problem(rank: int, r: dict) -> str | None:
    m = r["mismatch"]
    if r["disagreement"]:
        return "not checked: the step stopped at a broadcast the ranks disagreed on (above)"
    if m is None:
        return None
    where = f"after step {m['step']} on rank {rank}"
    if r["summed"]:
        return (f"{where} the parameters {m['differ']} differ: step all_reduced them, which "
                "adds up every rank's copy. Each parameter's new value is its owner's: "
                "broadcast it from there")
    if r["sent_gradients"]:
        return (f"{where} the parameters {m['differ']} differ: step broadcast the gradients, "
                "not the parameters. The owners' updated parameters are what the others lack")
    if r["steps_taken"] > 1:
        return (f"{where} the parameters {m['differ']} differ: self.local.step() ran "
                f"{r['steps_taken']} times in one step. Step once, then send")
    if r["sent_first"]:
        return (f"{where} the parameters {m['differ']} differ: the broadcasts ran before "
                "self.local.step(), so the owners sent the values from before the step. Step "
                "first, then send")
    own_stale = [i for i in m["stale"] if i in m["owned"]]
    if own_stale:
        return (f"{where} this rank's own parameters {own_stale} did not move: step the local "
                "optimizer before sending")
    if m["stale"] == m["differ"] and not m["owned"] and not r["ranks_agree"]:
        return (f"{where} the parameters {m['stale']} kept their old values: other ranks own "
                "and stepped them, and nothing brought their new values here. After the local "
                "step, every parameter must be sent from its owner to every rank")
    if m["stale"] == m["differ"] and r["ranks_agree"]:
        return (f"{where} the parameters {m['stale']} kept their old values on every rank: "
                "they were sent from a rank that had not stepped them, not from their owner")
    return (f"{where} the parameters {m['differ']} differ from torch's by up to "
            f"{m['diff']:.3g}: each must be stepped once, by its owner's optimizer, then sent "
            "to every rank")


def first_problem(results: dict, find) -> str | None:
    for (world, name), reports in results.items():
        for rank, r in enumerate(reports):
            problem = find(rank, r)
            if problem:
                return f"{world} ranks, {name}: {problem}"
    return None


def grade_15():
    why = grade_partition(on_ranks, owners_task, WORLDS)
    ok = why is None
    yield (ok, "owners: torch's ZeroRedundancyOptimizer's partition of 40 parameter lists, of "
           "1-D and 2-D shapes, of one dtype and of mixed dtypes, at 2 and 3 ranks", why)
    if not ok:
        return
    results = {(world, name): on_ranks(world, sharded_task, name)
               for world in WORLDS for name in OPTIMIZERS}
    problem = first_problem(results, share_problem)
    yield (problem is None, "each rank's optimizer holds its share only, and the state torch's "
           "keeps on that rank", problem)
    problem = first_problem(results, send_problem)
    yield (problem is None, "every broadcast sends a parameter from its owner, every rank "
           "taking part, and is finished when step returns", problem)
    for world in WORLDS:
        problem = first_problem({key: value for key, value in results.items()
                                 if key[0] == world}, bits_problem)
        yield (problem is None, f"{world} ranks: parameters equal torch's DDP + "
               "ZeroRedundancyOptimizer bit for bit after every step (SGD with momentum, Adam)",
               problem)
