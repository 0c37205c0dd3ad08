"""``copy.deepcopy(ddp)`` and pickling, as torch's DDP: the copy leaves the process group and
the reducer behind and builds its own; it trains, bit for bit as torch's copy does."""

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_cases import MLP, batch, torch_bucket_layout
from torch import nn

import miniddp
from miniddp.checks.bits import same_bits


def duplicate(ddp, how):
    return copy.deepcopy(ddp) if how == "deepcopy" else pickle.loads(pickle.dumps(ddp))


def train_step(ddp, opt, step):
    (x,), _, y = batch("mlp", step, 0, dist.get_rank())
    opt.zero_grad()
    F.mse_loss(ddp(x), y).backward()
    opt.step()


def copies_train_alike(how, sabotage=False, **ddp_kwargs):
    """Train both DDPs, copy both, then train originals and copies side by side; return every
    parameter or bucket layout that differs between miniddp's and torch's."""
    torch.manual_seed(1234 + dist.get_rank())
    module = MLP(32, 3)
    originals = [cls(copy.deepcopy(module), bucket_cap_mb=0.002, **ddp_kwargs) for cls in
                 (miniddp.DistributedDataParallel, nn.parallel.DistributedDataParallel)]
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
    opts = [sgd(m) for m in originals]
    for step in range(2):  # the originals have rebuilt their buckets
        for ddp, opt in zip(originals, opts):
            train_step(ddp, opt, step)
    copies = [duplicate(ddp, how) for ddp in originals]
    if sabotage:  # a subtly wrong copy: it keeps the original's rebuilt buckets
        reducer = copies[0].reducer
        reducer.lay_out_buckets([info.param_indices for info in originals[0].buckets])
        reducer.has_rebuilt = True
    copy_opts = [sgd(m) for m in copies]
    problems = []
    for step in range(2, 5):
        for pair, optimizers in ((originals, opts), (copies, copy_opts)):
            for ddp, opt in zip(pair, optimizers):
                train_step(ddp, opt, step)
            if [info.param_indices for info in pair[0].buckets] != torch_bucket_layout(pair[1]):
                problems.append(f"step {step}: bucket layout differs")
            for (name, a), b in zip(pair[0].module.named_parameters(), pair[1].module.parameters()):
                if not same_bits(a, b):
                    problems.append(f"step {step} {name}")
    copied_apart = not any(torch.equal(a, b) for a, b in
                           zip(copies[0].parameters(), originals[0].parameters()))
    return problems, copied_apart


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_trains_bit_for_bit_as_torchs_copy(ranks, world_size, how):
    for rank, (problems, copied_apart) in enumerate(ranks(world_size).run(copies_train_alike,
                                                                          how)):
        assert problems == [], f"rank {rank}: {problems[:5]}"
        assert copied_apart, "the copy must own its parameters"


def test_a_copy_with_gradients_as_bucket_views_trains_as_torchs(ranks):
    results = ranks(3).run(copies_train_alike, "deepcopy", gradient_as_bucket_view=True)
    assert all(problems == [] for problems, _ in results), results


def test_the_copy_comparison_catches_a_copy_that_keeps_the_rebuilt_buckets(ranks):
    """Negative control: torch's copy starts again from iteration 0's buckets."""
    results = ranks(3).run(copies_train_alike, "deepcopy", sabotage=True)
    assert all(problems for problems, _ in results)


def copies_process_groups(how):
    """The process group of a copy of each DDP: torch's copy takes the default group's."""
    module = nn.Linear(2, 2)
    found = {}
    for name, cls in (("miniddp", miniddp.DistributedDataParallel),
                      ("torch", nn.parallel.DistributedDataParallel)):
        ddp_copy = duplicate(cls(copy.deepcopy(module)), how)
        found[name] = ddp_copy.process_group
    return (found["miniddp"] is found["torch"], found["torch"] is dist.group.WORLD,
            repr(found["miniddp"]))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_keeps_the_default_process_group_as_torchs_copy_does(ranks, how):
    for same_as_torch, torch_keeps_world, mine in ranks(2).run(copies_process_groups, how):
        assert torch_keeps_world, "torch's copy no longer takes the default group: look again"
        assert same_as_torch, f"miniddp's copy has process_group {mine}, torch's the default group"


def ema_of_a_copy():
    """The usual EMA: a deep copy, never trained, following the model after each step."""
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(MLP())
    ema = copy.deepcopy(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        train_step(ddp, opt, step)
        with torch.no_grad():
            for e, p in zip(ema.parameters(), ddp.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)
    before = [p.clone() for p in ema.parameters()]
    with torch.no_grad():
        ema(torch.randn(2, 16))
    return (ddp.allreduce_calls, all(p.grad is None for p in ema.parameters()),
            all(torch.equal(a, b) for a, b in zip(before, ema.parameters())))


def test_an_ema_copy_stays_out_of_the_models_reduction(ranks):
    for calls, no_grads, unchanged in ranks(2).run(ema_of_a_copy):
        assert calls >= 1 and no_grads and unchanged


def copy_on_a_subgroup():
    group = dist.new_group([0, 1])
    ddp = miniddp.DistributedDataParallel(nn.Linear(2, 2), process_group=group)
    try:
        copy.deepcopy(ddp)
    except RuntimeError as e:
        return str(e)


def test_copying_a_ddp_on_another_group_is_refused_clearly(ranks):
    for message in ranks(2).run(copy_on_a_subgroup):
        assert message and "default process group" in message


def copied_logging_data(how):
    """``_get_ddp_logging_data()`` of a copy made after three steps and trained one more."""
    found = {}
    for kind, cls in (("miniddp", miniddp.DistributedDataParallel),
                      ("torch", nn.parallel.DistributedDataParallel)):
        for static_graph in (False, True):
            torch.manual_seed(0)
            ddp = cls(nn.Linear(4, 2), static_graph=static_graph)
            for _ in range(3):
                ddp(torch.ones(2, 4)).sum().backward()
            twin = duplicate(ddp, how)
            twin(torch.ones(2, 4)).sum().backward()
            data = twin._get_ddp_logging_data()
            found[kind, static_graph] = (data.get("iteration"), data.get("static_graph"))
    return found


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_logs_its_own_iterations_as_torchs_copy_does(ranks, how):
    found = ranks(2).run(copied_logging_data, how)[0]
    for static_graph in (False, True):
        assert found["miniddp", static_graph] == found["torch", static_graph], static_graph
    assert found["miniddp", False][0] == 0  # not the original's 3


def static_graph_copy_trains(how):
    """A copy of a static-graph DDP that has trained, trained on: as a fresh static-graph DDP
    made from the same weights, bit for bit, and the same on every rank (torch 2.13's copy
    carries its original's "first reduction queued" flag over and never averages again)."""
    torch.manual_seed(1234 + dist.get_rank())
    trained = miniddp.DistributedDataParallel(MLP(32, 3), static_graph=True)
    opt = torch.optim.SGD(trained.parameters(), lr=0.05)
    for step in range(3):
        train_step(trained, opt, step)
    the_copy = duplicate(trained, how)
    fresh = miniddp.DistributedDataParallel(copy.deepcopy(trained.module), static_graph=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (the_copy, fresh)]
    for step in range(3, 6):
        for ddp, o in zip((the_copy, fresh), opts):
            train_step(ddp, o, step)
    params = [p.detach().clone() for p in the_copy.parameters()]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, params)
    return (all(same_bits(a, b) for a, b in zip(params, fresh.parameters())),
            all(same_bits(a, b) for other in everyone for a, b in zip(params, other)))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_trained_static_graph_ddp_keeps_averaging(ranks, how):
    as_fresh, replicas_equal = ranks(2).run(static_graph_copy_trains, how)[0]
    assert replicas_equal, "the copy's replicas drifted apart: it stopped averaging"
    assert as_fresh, "the copy trains otherwise than a fresh static-graph DDP"
