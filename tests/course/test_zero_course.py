"""Lesson 15 (ZeRO stage 1 by hand; part 2, ZeRO-2) and exercise 15 (the sharded step): what
they prove holds, and fails when it should not.

The lesson's pieces against torch: its partition against torch's ``ZeroRedundancyOptimizer``,
its ``ShardedOptimizer`` bit for bit against torch's (each with a control that must differ), its
reduce-scatter against all_reduce then slicing. Then the lesson broken from outside
(``tests/support/breakage``): a broadcast that sends nothing, and each small breakage of miniddp's
``ZeroRedundancyOptimizer`` (and of ``fully_shard``'s ZeRO-2) applied in a pool of ranks to the
part of the lesson that teaches it. Last, exercise 15's wrong solutions, each failing first the
check that names its mistake, and other right ones passing, in one grader run. (The lesson's
plain run is ``tests/course/test_lessons.py``'s; the exercise as shipped and its solution are graded
in ``tests/course/test_grade.py``.)
"""

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lesson_modules import LESSONS_DIR, load_lesson
from test_grade import problems_in_one_run
from test_lesson_breakage import failure_with_the_library_broken, run_broken
from test_lessons import last_line, learner_env
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from warm_python import LESSON_PRELOAD, warm_python

from course.data import make_dataset

zero = load_lesson("15")
stage_two = load_lesson("15_sharded_optimizer_stage_2")
needs_fsdp2 = pytest.mark.skipif(stage_two.torch_fully_shard is None,
                                 reason=f"torch {torch.__version__} has no FSDP2 (fully_shard)")


def layers() -> nn.Module:
    """Equal and unequal parameters: ties in the partition, and a rank with several."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                             nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


# ----- the partition -----

def random_sizes(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    choices = torch.tensor([1, 2, 7, 64, 65, 300])
    count = int(torch.randint(1, 14, (), generator=g))
    return choices[torch.randint(0, len(choices), (count,), generator=g)].tolist()


def partitions_against_torch(rule: str = "lesson"):
    """For 30 parameter lists: (the lesson's owners or a control's, torch's owners)."""
    world = dist.get_world_size()
    pairs = []
    for seed in range(30):
        params = [nn.Parameter(torch.zeros(n)) for n in random_sizes(seed)]
        share = {id(p) for p in TorchZeRO(params, torch.optim.SGD, lr=0.1).optim.param_groups[0][
            "params"]}
        theirs = torch.tensor([dist.get_rank() if id(p) in share else -1 for p in params])
        dist.all_reduce(theirs, op=dist.ReduceOp.MAX)
        ours = (zero.partition(params, world) if rule == "lesson"
                else [i % world for i in range(len(params))])
        pairs.append((ours, theirs.tolist()))
    return pairs


@pytest.mark.parametrize("world", [2, 3])
def test_lesson_partition_is_torchs(ranks, world):
    pairs = ranks(world).run(partitions_against_torch)[0]
    assert all(ours == theirs for ours, theirs in pairs), pairs


def test_control_round_robin_is_not_torchs_partition(ranks):
    pairs = ranks(3).run(partitions_against_torch, "round robin")[0]
    assert any(ours != theirs for ours, theirs in pairs)


# ----- the sharded step -----

def sharded_against_torch(send_back, optimizer_name: str, steps: int = 4) -> bool:
    """The lesson's ShardedOptimizer beside torch's DDP and ZeroRedundancyOptimizer: equal
    after every step, and holding the same state on this rank."""
    cls, defaults = zero.OPTIMIZERS[optimizer_name]
    ours, theirs = TorchDDP(layers()), TorchDDP(layers())
    mine = zero.ShardedOptimizer(ours.parameters(), cls, send_back, **defaults)
    reference = TorchZeRO(theirs.parameters(), cls, **defaults)
    x_all, y_all = make_dataset(n=16 * steps, seed=dist.get_rank()).tensors
    equal = True
    for s in range(steps):
        for model, optimizer in ((ours, mine), (theirs, reference)):
            optimizer.zero_grad()
            F.mse_loss(model(x_all[16 * s:16 * (s + 1)]), y_all[16 * s:16 * (s + 1)]).backward()
            optimizer.step()
        equal &= all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    same_state = zero.state_bytes(mine.local) == zero.state_bytes(reference.optim)
    return equal and same_state


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("send_back", ["broadcast", "all_gather"])
@pytest.mark.parametrize("optimizer_name", ["SGD with momentum", "Adam"])
def test_sharded_step_by_hand_equals_torchs_zero_bit_for_bit(ranks, world, send_back,
                                                             optimizer_name):
    assert all(ranks(world).run(sharded_against_torch, send_back, optimizer_name))


@pytest.mark.parametrize("world", [2, 3])
def test_control_a_step_that_sends_nothing_back_differs(ranks, world):
    assert not any(ranks(world).run(sharded_against_torch, None, "Adam"))


# ----- ZeRO-2: the reduce-scatter -----

def reduce_scatter_against_all_reduce(dtype: str, wrong_sizes: bool = False) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    sizes = [1000, 7, 300, 1][:world] + [5] * max(0, world - 4)
    t = (torch.randint(-10**6, 10**6, (sum(sizes),), generator=g) if dtype == "int"
         else torch.randn(sum(sizes), generator=g))
    summed = t.clone()
    dist.all_reduce(summed)
    cut = sizes[::-1] if wrong_sizes else sizes  # the control cuts the chunks elsewhere
    mine, sent = stage_two.ring_reduce_scatter(t.clone(), cut)
    start = sum(sizes[:rank])
    return torch.equal(mine, summed[start:start + sizes[rank]]) and sent == sum(cut) - cut[rank]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_reduce_scatter_by_hand_is_all_reduce_then_slicing_on_integers(ranks, world):
    assert all(ranks(world).run(reduce_scatter_against_all_reduce, "int"))


def test_reduce_scatter_by_hand_is_all_reduce_then_slicing_bit_for_bit_at_2_ranks(ranks):
    assert all(ranks(2).run(reduce_scatter_against_all_reduce, "float"))


def test_control_reduce_scatter_with_other_chunks_is_not_this_ranks_slice(ranks):
    assert not all(ranks(3).run(reduce_scatter_against_all_reduce, "int", True))


# ----- the lesson, whole -----

@pytest.mark.lesson
def test_lesson_runs_at_3_ranks(tmp_path):
    # from an interpreter that has imported torch already, as tests/course/test_lessons.py runs
    # lessons
    done = warm_python(LESSON_PRELOAD).run([sys.executable, zero.__file__, "--nproc", "3"],
                                 env=learner_env(tmp_path), cwd=LESSONS_DIR.parent, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert last_line(done).startswith("OK: on 3 ranks"), done.stdout[-3000:]


@pytest.mark.lesson
def test_lesson_fails_when_broadcast_sends_nothing(tmp_path):
    done = run_broken("15_sharded_optimizer", "broadcast_does_nothing", tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "by hand, broadcast differs from the unsharded optimizer" in output, output[-3000:]
    assert "OK:" not in done.stdout


# ----- exercise 15, graded (as shipped and its solution: tests/course/test_grade.py) -----

OWNERS = "owners: torch's ZeroRedundancyOptimizer's partition"
SORT = "sorted(range(len(params)), key=lambda i: params[i].numel(), reverse=True)"
LOAD = "load[result[i]] += params[i].numel()"
SEND = "dist.broadcast(p, src=owner)"
SEND_LOOP = ("        for p, owner in zip(self.params, self.owners):\n"
             "            dist.broadcast(p, src=owner)\n")

# Each wrong solution: (exercise, edits of the solution, the first check that must fail, words
# its reason must hold, words it must not hold); graded with the right ones in one run
WRONG = {
    "every rank steps every parameter": (
        "15", [("self.local = optimizer_class(mine, **defaults)",
                "self.local = optimizer_class(self.params, **defaults)")],
        "each rank's optimizer holds its share only", ["holds all 14 parameters"], []),
    "the local step is never taken": (
        "15", [("        self.local.step()\n", "")], "each rank's optimizer holds its share only",
        ["self.local never stepped"], []),
    "nothing is sent back": (
        "15", [("        for p, owner in zip(self.params, self.owners):\n"
                "            dist.broadcast(p, src=owner)\n", "")],
        "2 ranks: parameters equal torch's", ["nothing brought their new values here"], []),
    "sent from rank 0": ("15", [(SEND, "dist.broadcast(p, src=0)")],
                         "every broadcast sends a parameter from its owner",
                         ["but rank 1 owns it"], []),
    "sent from this rank": ("15", [(SEND, "dist.broadcast(p, src=self.rank)")],
                            "every broadcast sends a parameter from its owner",
                            ["named different sources"], []),
    "only the owner takes part": (
        "15", [("            dist.broadcast(p, src=owner)",
                "            if owner == self.rank:\n"
                "                dist.broadcast(p, src=owner)")],
        "every broadcast sends a parameter from its owner",
        ["every rank must take part in the broadcast of every parameter"], []),
    "dealt round robin": (
        "15", [("    result, load = [0] * len(params), [0] * world_size\n",
                "    return [i % world_size for i in range(len(params))]\n")],
        OWNERS, ["you dealt the parameters out in turn"], []),
    "model order": ("15", [(SORT, "range(len(params))")], OWNERS, ["in model order"], []),
    "equal sizes reversed": (
        "15", [(SORT, "sorted(range(len(params)), key=lambda i: params[i].numel())[::-1]")],
        OWNERS, ["equal sizes came out in reverse"], []),
    # rows (shape[0]) where torch counts elements: named as rows, not as a share
    "balanced and sorted by rows": (
        "15", [(SORT, SORT.replace("numel()", "shape[0]")),
               (LOAD, "load[result[i]] += params[i].shape[0]")],
        OWNERS, ["you balanced rows (shape[0]) instead of elements"], ["optimizer holds"]),
    "balanced by rows": ("15", [(LOAD, "load[result[i]] += len(params[i])")], OWNERS,
                         ["load in rows (shape[0])", "torch counts elements"], []),
    "sorted by rows": ("15", [(SORT, SORT.replace("numel()", "shape[0]"))], OWNERS,
                       ["you sorted by rows (shape[0])"], ["load"]),
    "ties to the highest rank": (
        "15", [("result[i] = load.index(min(load))",
                "result[i] = world_size - 1 - load[::-1].index(min(load))")],
        OWNERS, ["on a tie you chose a higher rank"], []),
    "another rank's share": (
        "15", [("if owner == self.rank]", "if owner == (self.rank + 1) % self.world_size]")],
        "each rank's optimizer holds its share only", ["it holds rank 1's share"], []),
    "the parameters all_reduced": (
        "15", [(SEND_LOOP, "        for p in self.params:\n            dist.all_reduce(p)\n")],
        "2 ranks: parameters equal torch's", ["all_reduced them", "adds up every rank's copy"],
        []),
    "the gradients broadcast": (
        "15", [(SEND, "dist.broadcast(p.grad, src=owner)")],
        "2 ranks: parameters equal torch's", ["broadcast the gradients, not the parameters"],
        []),
    "sorted by the last dimension": (
        "15", [(SORT, SORT.replace("numel()", "shape[-1]"))], OWNERS,
        ["could not tell which rule yours follows", "The smallest case"], []),
}
RIGHT = {
    "the others' copies zeroed, then summed": ("15", [(SEND_LOOP, (
        "        for p, owner in zip(self.params, self.owners):\n"
        "            if owner != self.rank:\n                p.zero_()\n"
        "            dist.all_reduce(p)\n"))]),
    "the least-loaded rank from a sorted list of pairs": ("15", [(
        "result[i] = load.index(min(load))",
        "result[i] = sorted((size, rank) for rank, size in enumerate(load))[0][1]")]),
    "a stable sort written as a key with the index": ("15", [(
        SORT, "sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))")]),
    "the elements counted with nelement()": ("15", [(LOAD, "load[result[i]] += "
                                                            "params[i].nelement()")]),
}


@pytest.mark.slow
def test_exercise_names_each_mistake_and_passes_other_right_solutions(tmp_path):
    problems = problems_in_one_run(WRONG, RIGHT, tmp_path)
    assert not problems, "\n\n".join(problems)


# ----- the library broken: the part of lesson 15 that teaches the mechanism fails -----

# breakage -> (the lesson part, its arguments after rank, world and device, the message)
LIBRARY = {
    "zero_ties_reversed": ("equal_sizes_and_a_schedule", (),
                           "with equal sizes, miniddp's ZeroRedundancyOptimizer gives this rank"),
    "zero_lr_never_forwarded": ("equal_sizes_and_a_schedule", (),
                                "with the learning rate changed every 3 steps, miniddp's"),
    "zero_partition_in_model_order": ("equal_sizes_and_a_schedule", (),
                                      "with equal sizes, miniddp's ZeroRedundancyOptimizer"),
    "zero_partition_by_count": ("sharded_step", ("SGD with momentum",),
                                "miniddp's ZeroRedundancyOptimizer keeps"),
    "zero_steps_every_parameter": ("sharded_step", ("SGD with momentum",),
                                   "miniddp's ZeroRedundancyOptimizer keeps"),
    "zero_broadcasts_from_rank_0": ("sharded_step", ("SGD with momentum",),
                                    "miniddp's ZeroRedundancyOptimizer differs from the "
                                    "unsharded optimizer"),
    "zero_never_sends": ("sharded_step", ("SGD with momentum",),
                         "miniddp's ZeroRedundancyOptimizer differs from the unsharded"),
}


def lesson_part(name: str, *args):
    return getattr(zero, name)(dist.get_rank(), dist.get_world_size(), torch.device("cpu"),
                               *args)


@pytest.mark.slow
@pytest.mark.parametrize("breakage", sorted(LIBRARY))
def test_lesson_fails_where_it_teaches_what_the_library_broke(ranks, breakage):
    part, args, message = LIBRARY[breakage]
    said = failure_with_the_library_broken(ranks, 2, breakage, lesson_part, part, *args)
    assert message in said, said[-3000:]


@pytest.mark.slow
@needs_fsdp2
def test_part_2_fails_when_zero2_frees_the_parameters_after_forward(ranks):
    said = failure_with_the_library_broken(ranks, 2, "fsdp_zero2_ignored", part_2_zero2)
    assert "ZeRO-2 keeps the parameters gathered until backward" in said, said[-3000:]


def part_2_zero2():
    return stage_two.library_zero2(dist.get_rank(), dist.get_world_size())
