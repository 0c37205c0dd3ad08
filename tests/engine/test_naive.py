"""The naive rungs give the engine's parameters bit for bit (world size 2) and count their calls."""

import copy

import pytest
import torch
import torch.distributed as dist
from ddp_cases import MLP, TiedFrozen, batch, first_bucket_as_small_as, loss_of

from miniddp.baselines.naive import STRATEGIES


def train_all_strategies(model_name, bucket_cap_mb, steps=3):
    torch.manual_seed(dist.get_rank())
    module = MLP(48, 4) if model_name == "mlp" else TiedFrozen()
    runs = {}
    for name, cls in STRATEGIES.items():
        with first_bucket_as_small_as(bucket_cap_mb):
            ddp = cls(copy.deepcopy(module), bucket_cap_mb=bucket_cap_mb)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        calls = []
        for step in range(steps):
            args, kwargs, y = batch(model_name, step, 0, dist.get_rank())
            opt.zero_grad()
            loss_of(model_name, ddp(*args, **kwargs), y).backward()
            calls.append(ddp.allreduce_calls)
            opt.step()
        runs[name] = {"params": [p.detach().clone() for p in ddp.parameters()],
                      "calls": calls, "buckets": len(ddp.buckets),
                      "trainable": sum(p.requires_grad for p in ddp.parameters())}
    return runs


@pytest.mark.parametrize("model_name", ["mlp", "tied_frozen"])
@pytest.mark.parametrize("cap", [None, 0.002])
def test_naive_rungs_match_the_engine_bit_for_bit(ranks, model_name, cap):
    for runs in ranks(2).run(train_all_strategies, model_name, cap):
        engine = runs["overlap"]["params"]
        for name in ("per_parameter", "buckets_after_backward"):
            assert all(torch.equal(a, b) for a, b in zip(runs[name]["params"], engine)), name


def calls_with_no_sync():
    ddp = STRATEGIES["overlap"](MLP(), bucket_cap_mb=0.002)
    calls = []
    for micro in range(3):
        args, kwargs, y = batch("mlp", 0, micro, dist.get_rank())
        if micro < 2:
            with ddp.no_sync():
                loss_of("mlp", ddp(*args), y).backward()
        else:
            loss_of("mlp", ddp(*args), y).backward()
        calls.append(ddp.allreduce_calls)
    return calls


def test_no_sync_micro_batches_make_no_calls(ranks):
    assert ranks(2).run(calls_with_no_sync)[0] == [0, 0, 1]


def test_each_rung_reports_its_all_reduce_calls(ranks):
    runs = ranks(2).run(train_all_strategies, "mlp", 0.002)[0]
    assert runs["per_parameter"]["calls"] == [runs["per_parameter"]["trainable"]] * 3 == [8] * 3
    bucketed = runs["buckets_after_backward"]
    assert bucketed["calls"][0] == 1, "iteration 0 uses one bucket"
    assert bucketed["calls"][1:] == [bucketed["buckets"]] * 2 and bucketed["buckets"] > 1
    assert runs["overlap"]["calls"] == bucketed["calls"]
