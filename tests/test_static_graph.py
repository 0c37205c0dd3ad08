"""``static_graph=True``: bit-identical to torch's DDP, and a changed graph is an error.

Each rank trains miniddp's DDP and torch's side by side from the same weights on the same
rank-dependent data, both with ``static_graph=True``, and compares every gradient, every
parameter and the bucket layout after every micro-batch with ``torch.equal``. Small buckets
make the rebuilt layout several buckets, so at 3 ranks the bits depend on when and in which
order the buckets are rebuilt (after the *second* synchronized backward here, not the first).
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_cases import MLP, first_bucket_as_small_as, torch_bucket_layout
from torch import nn
from torch.utils.checkpoint import checkpoint

import miniddp

CAP_MB = 0.002  # about 2 KB: the rebuilt layouts below have three to five buckets


class CheckpointTwice(nn.Module):
    """One block applied twice, each time under reentrant checkpointing: the block is
    differentiated in two inner backward passes, so its parameters' hooks fire twice. Its
    gradients are ready at the second firing, after ``middle``'s: that order is the rebuilt
    buckets' order."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
        self.middle = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.embed(x))
        h = checkpoint(self.block, h, use_reentrant=True)
        h = torch.tanh(self.middle(h))
        h = checkpoint(self.block, h, use_reentrant=True)
        return self.head(h)


class WithUnused(nn.Module):
    """``unused`` takes no part in the loss, on every rank and in every iteration."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.unused = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.relu(self.trunk(x)))


MODELS = {"checkpoint_twice": CheckpointTwice, "with_unused": WithUnused,
          "mlp": lambda: MLP(32, 3)}


def data(step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    return torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)


def build_pair(model_name: str, **kwargs):
    """miniddp's and torch's DDP around copies of one module (rank-dependent init: the
    construction broadcast is exercised)."""
    torch.manual_seed(7 + dist.get_rank())
    module = MODELS[model_name]()
    with first_bucket_as_small_as(kwargs.get("bucket_cap_mb")):
        ours = miniddp.DistributedDataParallel(copy.deepcopy(module), **kwargs)
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(module), **kwargs)
    return ours, theirs


def _differences(tag, ours, theirs):
    found = []
    for (name, a), b in zip(ours.module.named_parameters(), theirs.module.parameters()):
        if (a.grad is None) != (b.grad is None):
            found.append(f"{tag} grad {name}: None on one side only")
        elif a.grad is not None and not torch.equal(a.grad, b.grad):
            found.append(f"{tag} grad {name}")
        if not torch.equal(a, b):
            found.append(f"{tag} param {name}")
    return found


def train_side_by_side(model_name: str, steps: int = 5, micro_batches: int = 1,
                       sabotage: str | None = None, **kwargs) -> dict:
    """Train both DDPs; return the bit differences and the layout differences separately.

    The first step is always a single synchronized micro-batch (torch's DDP cannot start a
    static graph inside ``no_sync``). ``sabotage`` makes miniddp subtly wrong on purpose:
    ``"rebuild_early"`` records the ready order in the first backward, so the buckets are
    rebuilt one iteration early (when the ordinary reducer would rebuild them).
    """
    kwargs = {"static_graph": True, "bucket_cap_mb": CAP_MB, **kwargs}
    ours, theirs = build_pair(model_name, **kwargs)
    if sabotage == "rebuild_early":
        _record_order_in_first_backward(ours.reducer)
    both = [(ours, torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)),
            (theirs, torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9))]
    bits, layouts, layout_seen = [], [], []
    for step in range(steps):
        micros = 1 if step == 0 else micro_batches
        for _, opt in both:
            opt.zero_grad()
        for micro in range(micros):
            x, y = data(step, micro)
            for ddp, _ in both:
                sync = micro == micros - 1
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    F.mse_loss(ddp(x), y).backward()
            if [b.param_indices for b in ours.buckets] != torch_bucket_layout(theirs):
                layouts.append(f"step {step} micro {micro}: bucket layout differs")
        bits += _differences(f"step {step} after backward", ours, theirs)
        for _, opt in both:
            opt.step()
        bits += _differences(f"step {step} after the optimizer", ours, theirs)
        layout_seen.append(torch_bucket_layout(theirs))
    unused_grads = [p.grad is None for p in ours.module.parameters()]
    return {"bits": bits[:8], "layouts": layouts[:4], "torch_layouts": layout_seen,
            "grad_is_none": unused_grads}


def _record_order_in_first_backward(reducer):
    static = reducer.static_graph
    counting_firing = static.final_firing

    def final_firing(index, expect_hooks):
        if static.counting and index not in reducer.ready_order:
            reducer.ready_order.append(index)
        return counting_firing(index, expect_hooks)

    static.final_firing = final_firing


def check(results):
    for rank, result in enumerate(results):
        assert not result["bits"] and not result["layouts"], (
            f"rank {rank}: {result['bits'] + result['layouts']}")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("model_name", ["checkpoint_twice", "with_unused", "mlp"])
def test_bit_identical_to_torch_with_static_graph(ranks, world_size, model_name):
    results = ranks(world_size).run(train_side_by_side, model_name)
    check(results)
    layouts = results[0]["torch_layouts"]
    assert len(layouts[1]) == 1 and len(layouts[2]) > 1, (
        "torch keeps one bucket for two iterations, then rebuilds into several: "
        f"{layouts}")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("model_name", ["checkpoint_twice", "with_unused"])
def test_bit_identical_with_no_sync(ranks, world_size, model_name):
    check(ranks(world_size).run(train_side_by_side, model_name, micro_batches=3))


@pytest.mark.parametrize("model_name", ["checkpoint_twice", "with_unused"])
def test_bit_identical_with_gradient_as_bucket_view(ranks, model_name):
    check(ranks(3).run(train_side_by_side, model_name, gradient_as_bucket_view=True))


def test_find_unused_parameters_is_not_needed_but_allowed(ranks):
    """torch builds its first buckets as for a static graph and warns; so does miniddp."""
    results = ranks(3).run(train_with_warnings, "with_unused", find_unused_parameters=True)
    check(results)
    for result in results:
        assert any("find_unused_parameters=True is not needed" in w for w in result["warnings"])


def train_with_warnings(model_name, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train_side_by_side(model_name, **kwargs)
    result["warnings"] = [str(w.message) for w in caught]
    return result


def test_a_parameter_unused_everywhere_keeps_no_grad(ranks):
    for result in ranks(2).run(train_side_by_side, "with_unused", steps=3):
        assert result["grad_is_none"] == [False, False, True, True, False, False]


# ----- negative control -----

def test_comparison_catches_buckets_rebuilt_one_iteration_early(ranks):
    """At 3 ranks, rebuilding after the first backward (as without static_graph) changes
    the bits of the second step, not only the layout: the comparison sees both."""
    results = ranks(3).run(train_side_by_side, "checkpoint_twice", steps=3,
                           sabotage="rebuild_early")
    assert any(r["layouts"] for r in results), "the early rebuild went unnoticed"
    assert any(r["bits"] for r in results), "at 3 ranks the early rebuild must change bits"
