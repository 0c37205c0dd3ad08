"""The checks behind lessons/grade.py for exercise 17b: the life of one FSDP unit.

The learner's ``Unit`` is driven by hooks that call its four methods where torch FSDP2's own
hooks act (``Driven``), on the model torch's ``fully_shard`` shards beside it: two inner units
and the root, which owns the first and last layers. Five runs, each at 2 and 3 ranks. What is
observed, in the order it is judged: what the learner's optimizer holds; whether a unit's
parameters were gathered whenever its forward or backward ran (the hooks check, so a freed unit
fails with its name, not with torch's "data is not allocated"); which units hold their full
parameters after forward (torch's, seen on its modules) and after backward, and whether a full
parameter keeps a full-size gradient; every collective the learner's code makes in each unit's
methods (``EveryCollective``: the given methods' and its own), a gather of a unit that holds its
parameters being an extra one; the gradients handed to each reduce-scatter
(beside this rank's own gradients of each backward, from a plain copy of the model: a lost or
stale gradient is named so); every gradient shard and parameter shard against torch's, bit for
bit.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from course.data import make_dataset
from course.grader.checks import EveryCollective, kind_of, on_ranks
from course.grader.fsdp import fully_shard
from course.grader.unit_verdicts import (
    bits_problem,
    count_problem,
    held_problem,
    optimizer_problem,
)
from course.tools import load_lesson

OPTIONS = load_lesson("17_fsdp_options")
WORLDS, STEPS, ADAM = (2, 3), 2, {"lr": 0.01}
INNER, ROOT_LAYERS = OPTIONS.INNER, OPTIONS.ROOT  # the layers that are inner units; the root's
#: In this order: the first runs show most mistakes, and with two backwards per step the
#: gradients of each are kept to name a lost or a left-over one. ZeRO-2's evaluation forward
#: (no_grad, after each step) leaves units gathered for the next forward: one gathered again
#: there is an extra all-gather. The frozen weight is its unit's first parameter, not its last.
RUNS = {"two backwards per step": {"micro": 2},
        "a backward without sync, then one with": {"micro": 2, "no_sync": True},
        "ZeRO-3": {}, "ZeRO-2 with an evaluation forward after each step":
        {"zero2": True, "evaluate": True},
        "a frozen bias in one unit, a frozen weight in the other": {"frozen": True}}


def exercise():
    return sys.modules["exercise_17b"]


class Unfed(Exception):
    """A unit's forward or backward was about to run with its parameters freed."""


def make_model(frozen: bool) -> nn.Module:
    """Lesson 17, part 2's model: two inner units and the root's first and last layers; frozen,
    the lesson's frozen bias (its unit's last parameter) and the other unit's weight (its
    first)."""
    model = OPTIONS.make_model(frozen)
    if frozen:
        model[INNER[1]].weight.requires_grad_(False)
    return model


class Driven:
    """The learner's units on ``model``, called where torch's hooks act. Every collective the
    learner's code makes while a unit's method runs is counted for that unit, per window (a
    backward, or an evaluation forward), with the gathers made while the unit was gathered
    already; every reduce-scatter's input is kept."""

    def __init__(self, model: nn.Module, unit_class, zero2: bool):
        self.model, self.current = model, None
        self.units = {f"unit {i}": unit_class(list(model[i].parameters()),
                                              reshard_after_forward=not zero2) for i in INNER}
        self.units["the root"] = unit_class([p for i in ROOT_LAYERS for p in model[i].parameters()],
                                            reshard_after_forward=True, is_root=True)
        self.start_window()
        for name, unit in self.units.items():
            module = model if name == "the root" else model[int(name.split()[1])]
            self._keep_inputs(name, unit)
            self._hook(name, unit, module)

    def collective(self, name: str) -> None:
        """``EveryCollective``'s call: one collective of the unit whose method is running."""
        if self.current is not None:
            self.counts[self.current][kind_of(name)] += 1

    def _keep_inputs(self, name: str, unit) -> None:
        reduce_scatter = unit.reduce_scatter

        def kept_reduce_scatter(grads):
            out = reduce_scatter(grads)
            self.reduced.setdefault(name, []).append((clones(grads), clones(out)))
            return out
        unit.reduce_scatter = kept_reduce_scatter

    def _called(self, name: str, unit, method: str) -> None:
        """``unit.method()``, its collectives counted; a gather it makes while the unit holds
        its parameters already is an extra one."""
        was_gathered, before = bool(unit.gathered), self.counts[name]["gathers"]
        self.current = name
        try:
            getattr(unit, method)()
        finally:
            self.current = None
        made = self.counts[name]["gathers"] - before
        if made > (0 if was_gathered else 1):
            self.extra[name].append(method)

    def _hook(self, name: str, unit, module: nn.Module) -> None:
        def fed(when: str, needed: str):
            if not unit.gathered:
                raise Unfed(f"{name}'s {needed} was about to run with its parameters freed: "
                            f"{when} must gather them (self.gather()) when they are not")

        def before_forward(_module, _args):
            self._called(name, unit, "before_forward")
            fed("before_forward", "forward")

        def before_backward(grad):
            self._called(name, unit, "before_backward")
            fed("before_backward", "backward")
            return grad

        def after_forward(_module, _args, output):
            self._called(name, unit, "after_forward")
            if output.requires_grad:
                output.register_hook(before_backward)
            return output

        waiting = [p for p in unit.full if p.requires_grad]
        arrived = []

        def gradient_arrived(_param):
            arrived.append(1)
            if len(arrived) == len(waiting):
                arrived.clear()
                self._called(name, unit, "after_backward")
        module.register_forward_pre_hook(before_forward)
        module.register_forward_hook(after_forward)
        for p in waiting:
            p.register_post_accumulate_grad_hook(gradient_arrived)

    def held(self) -> dict[str, bool]:
        return {name: bool(unit.gathered) for name, unit in self.units.items()}

    def full_gradients(self) -> dict[str, int]:
        """Each unit's elements of full-size gradient still held in its full parameters' .grad."""
        return {name: sum(p.grad.numel() for p in unit.full if p.grad is not None)
                for name, unit in self.units.items()}

    def start_window(self) -> None:
        self.counts = {name: Counter({"gathers": 0, "reduce-scatters": 0}) for name in self.units}
        self.extra = {name: [] for name in self.units}  # the methods that gathered again
        self.reduced = {}

    def start_backward(self, sync: bool) -> None:
        for unit in self.units.values():
            unit.requires_gradient_sync = sync
        self.start_window()


def clones(tensors) -> list:
    return [None if t is None else t.detach().clone() for t in tensors]


def torch_model(frozen: bool, zero2: bool) -> nn.Module:
    model, mesh = make_model(frozen), init_device_mesh("cpu", (dist.get_world_size(),))
    for i in INNER:
        fully_shard(model[i], mesh=mesh, reshard_after_forward=not zero2)
    return fully_shard(model, mesh=mesh)


def torch_held(model: nn.Module) -> dict[str, bool]:
    """Which of torch's units hold full parameters now (a sharded one is a DTensor)."""
    full = lambda layer: not hasattr(model[layer].weight, "to_local")  # noqa: E731
    return {**{f"unit {i}": full(i) for i in INNER}, "the root": full(ROOT_LAYERS[0])}


def local(t):
    """A copy of ``t``'s local values (a DTensor's are its shard): later backwards add to
    ``t`` in place."""
    return None if t is None else (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def shards_in_model_order(model: nn.Module, driven: Driven) -> list[nn.Parameter]:
    by_id = {id(f): s for u in driven.units.values() for f, s in zip(u.full, u.shards)}
    return [by_id[id(p)] for p in model.parameters()]


def own_gradients(plain: nn.Module, theirs: nn.Module, x, y) -> dict[int, torch.Tensor]:
    """This rank's gradient of each parameter (by id of the plain model's) for (x, y), from a
    plain copy holding torch's current parameters."""
    with torch.no_grad():
        for p, q in zip(plain.parameters(), theirs.parameters()):
            p.copy_(q.full_tensor())
    plain.zero_grad()
    F.mse_loss(plain(x), y).backward()
    return [None if p.grad is None else p.grad.clone() for p in plain.parameters()]


def batches(run: str) -> list[list[tuple[bool, torch.Tensor, torch.Tensor]]]:
    """Each step's backwards of ``run`` on this rank: (with sync, inputs, targets)."""
    config = RUNS[run]
    micro = config.get("micro", 1)
    x_all, y_all = make_dataset(n=8 * micro * STEPS, seed=dist.get_rank()).tensors
    xs, ys = x_all.split(8), y_all.split(8)
    return [[(not (config.get("no_sync") and k < micro - 1), xs[micro * step + k],
              ys[micro * step + k]) for k in range(micro)] for step in range(STEPS)]


#: torch's side of each run, by (world size, run): what its units held after each forward, its
#: gradients after each backward (and this rank's own, from a plain copy), its parameters after
#: each step. It does not depend on the learner's file, so it is trained once for every file
#: graded on these ranks (every rank fills it in the same call: torch's collectives stay matched)
_REFERENCES: dict[tuple[int, str], dict] = {}


def torch_reference(run: str) -> dict:
    key = (dist.get_world_size(), run)
    if key not in _REFERENCES:
        config = RUNS[run]
        frozen, micro = config.get("frozen", False), config.get("micro", 1)
        theirs, plain = torch_model(frozen, config.get("zero2", False)), make_model(frozen)
        optimizer = torch.optim.Adam(theirs.parameters(), **ADAM)
        reference = _REFERENCES[key] = {"backwards": [], "params": []}
        for step in batches(run):
            for sync, x, y in step:
                own = own_gradients(plain, theirs, x, y) if micro > 1 else None
                theirs.set_requires_gradient_sync(sync)
                loss = F.mse_loss(theirs(x), y)
                held = torch_held(theirs)
                loss.backward()
                reference["backwards"].append(
                    {"held": held, "own": own,
                     "grads": [local(p.grad) for p in theirs.parameters()]})
            optimizer.step()
            reference["params"].append([local(p) for p in theirs.parameters()])
            optimizer.zero_grad()
    return _REFERENCES[key]


def unit_task(run: str) -> dict:
    config = RUNS[run]
    mine = make_model(config.get("frozen", False))
    driven = Driven(mine, exercise().Unit, config.get("zero2", False))
    report = {"run": run, "optimizer": None, "backwards": [], "evaluations": [], "unfed": None,
              "params_differ": None, "names": [name for name, _ in mine.named_parameters()]}
    reference = torch_reference(run)
    try:
        with EveryCollective(exercise(), driven.collective):
            train(run, mine, driven, reference, report)
    except Unfed as unfed:
        report["unfed"] = str(unfed)
    return report


def train(run: str, mine: nn.Module, driven: Driven, reference: dict, report: dict) -> None:
    """The learner's units through ``run``'s steps, beside torch's: what was seen, in
    ``report``."""
    shards = shards_in_model_order(mine, driven)
    optimizer = None  # made after the first backward: the methods' instructions come first
    torchs = iter(reference["backwards"])  # one per backward, in the order they are made
    for step, backwards in enumerate(batches(run)):
        for k, (sync, x, y) in enumerate(backwards):
            torch_side = next(torchs)
            driven.start_backward(sync)
            seen = {"step": step, "micro": k, "sync": sync, "torch_after_forward":
                    torch_side["held"], "own": torch_side["own"], "world": dist.get_world_size()}
            my_loss = F.mse_loss(mine(x), y)
            seen["after_forward"] = driven.held()
            my_loss.backward()
            seen.update(after_backward=driven.held(), full_grads=driven.full_gradients(),
                        counts=driven.counts, extra=driven.extra, reduced=driven.reduced,
                        unit_params=unit_param_order(mine, driven),
                        grads=[local(s.grad) for s in shards], torch_grads=torch_side["grads"])
            report["backwards"].append(seen)
        if optimizer is None:
            optimizer = exercise().make_optimizer(list(driven.units.values()),
                                                  torch.optim.Adam, **ADAM)
            report["optimizer"] = optimizer_holds(optimizer, shards, driven)
            if report["optimizer"]:
                return
        optimizer.step()
        differ = [i for i, (s, p) in enumerate(zip(shards, reference["params"][step]))
                  if not torch.equal(s.detach(), p)]
        if differ and report["params_differ"] is None:
            report["params_differ"] = (step, differ)
        optimizer.zero_grad()
        if RUNS[run].get("evaluate"):
            driven.start_window()
            with torch.no_grad():
                mine(backwards[0][1])
            report["evaluations"].append({"step": step, "counts": driven.counts,
                                          "extra": driven.extra})


def unit_param_order(model: nn.Module, driven: Driven) -> dict[str, list[int]]:
    """Each unit's full parameters, as positions in ``model.parameters()``."""
    position = {id(p): i for i, p in enumerate(model.parameters())}
    return {name: [position[id(p)] for p in u.full] for name, u in driven.units.items()}


def optimizer_holds(optimizer, shards, driven: Driven) -> str | None:
    """None when the optimizer steps exactly the shards (frozen ones may be left out)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return f"make_optimizer returned a {type(optimizer).__name__}, not a torch optimizer"
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    full = {id(p) for u in driven.units.values() for p in u.full}
    needed = {id(s) for s in shards if s.requires_grad}
    if held & full:
        return ("your optimizer holds the module's full parameters: their memory is freed "
                "between steps, and each rank steps only its rows of them, the units' shards")
    if not needed <= held or not held <= {id(s) for s in shards}:
        return (f"your optimizer holds {len(held)} tensors; this rank's shards are "
                f"{len(needed)} (unit.shards of every unit, the root's too)")
    return None


def grade_17b():
    if fully_shard is None:
        yield (False, "torch's FSDP2 (fully_shard), to grade against",
               f"torch {torch.__version__} has no fully_shard: exercise 17b needs torch 2.4 or "
               "later")
        return
    results = {}
    for world, run in ((world, run) for world in WORLDS for run in RUNS):
        results[(world, run)] = on_ranks(world, unit_task, run)
        if any(first(results, find) for _, find in CHECKS):
            break  # judged on the runs so far: a wrong solution shows itself in the first ones
    for what, find in CHECKS:
        problem = first(results, find)
        yield problem is None, what, problem
        if problem is not None and what.startswith(("make_optimizer", "each unit's")):
            return


CHECKS = (
            ("make_optimizer: an optimizer over this rank's shards of every unit",
             optimizer_problem),
            ("each unit's parameters are gathered whenever its forward or its backward runs",
             lambda r: r["unfed"]),
            ("after forward only the root holds its full parameters (with ZeRO-2 every unit); "
             "after backward none does, nor a full-size gradient after a backward with sync",
             held_problem),
            ("all-gathers: one for a unit's forward, one more for its backward unless it kept "
             "its parameters (the root, ZeRO-2), none while it holds them; one reduce-scatter "
             "per unit in each backward with sync, none without; every collective of your "
             "code counted", count_problem),
            ("2 and 3 ranks: every gradient shard and parameter shard equals torch's "
             "fully_shard bit for bit, after every backward and step", bits_problem))


def first(results: dict, find) -> str | None:
    for (world, run), reports in results.items():
        for rank, report in enumerate(reports):
            problem = find(report)
            if problem:
                return f"{world} ranks, {run}, rank {rank}: {problem}"
    return None
