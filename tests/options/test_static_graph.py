"""``static_graph=True``: bit-identical to torch's DDP, and a changed graph is an error.

Each rank trains miniddp's DDP and torch's side by side from the same weights on the same
rank-dependent data, both with ``static_graph=True``, and compares every gradient, every
parameter and the bucket layout after every micro-batch bit for bit (``bits``). Small buckets
make the rebuilt layout several buckets, so at 3 ranks the bits depend on when and in which
order the buckets are rebuilt (after the *second* synchronized backward here, not the first).
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_cases import MLP, first_bucket_as_small_as, torch_bucket_layout
from torch import nn
from torch.utils.checkpoint import checkpoint

import miniddp
from miniddp.checks.bits import same_bits
from miniddp.torch_versions import TORCH_RELEASE

CAP_MB = 0.002  # about 2 KB: the rebuilt layouts below have three to five buckets


class CheckpointTwice(nn.Module):
    """One block applied twice, each time under reentrant checkpointing: the block is
    differentiated in two inner backward passes, so its parameters' hooks fire twice. Its
    gradients are ready at the second firing, after ``middle``'s: that order is the rebuilt
    buckets' order. (Without reentrancy, each hook fires once: the plain case.)"""

    def __init__(self, use_reentrant: bool = True):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.embed = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
        self.middle = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x, times: int = 2):
        h = torch.relu(self.embed(x))
        h = checkpoint(self.block, h, use_reentrant=self.use_reentrant)
        h = torch.tanh(self.middle(h))
        for _ in range(times - 1):
            h = checkpoint(self.block, h, use_reentrant=self.use_reentrant)
        return self.head(h)


class WithUnused(nn.Module):
    """``unused`` takes no part in the loss, on every rank and in every iteration."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.unused = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x, use_all: bool = False):
        h = torch.relu(self.trunk(x))
        return self.head(h + self.unused(h) if use_all else h)


class TwoOutputs(WithUnused):
    """Returns two outputs; the loss uses only the first, so ``unused`` is reached from an
    output yet gets no gradient."""

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return self.head(h), self.unused(h)


MODELS = {"checkpoint_twice": CheckpointTwice, "with_unused": WithUnused,
          "mlp": lambda: MLP(32, 3),
          "checkpoint_twice_not_reentrant": lambda: CheckpointTwice(use_reentrant=False),
          "two_outputs": TwoOutputs}


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
        elif a.grad is not None and not same_bits(a.grad, b.grad):
            found.append(f"{tag} grad {name}")
        if not same_bits(a, b):
            found.append(f"{tag} param {name}")
    return found


def train_side_by_side(model_name: str, steps: int = 5, micro_batches: int = 1,
                       forwards: int = 1, sabotage: str | None = None, **kwargs) -> dict:
    """Train both DDPs; return the bit differences and the layout differences separately.

    The first step is always a single synchronized micro-batch (torch's DDP cannot start a
    static graph inside ``no_sync``). ``forwards`` forwards share each backward (torch
    supports several forwards before a backward with a static graph). ``sabotage`` makes
    miniddp subtly wrong on purpose: ``"rebuild_early"`` records the ready order in the first
    backward, so the buckets are rebuilt one iteration early (when the ordinary reducer would
    rebuild them).
    """
    kwargs = {"static_graph": True, "bucket_cap_mb": CAP_MB, **kwargs}
    ours, theirs = build_pair(model_name, **kwargs)
    if not kwargs["static_graph"]:  # turned on after construction, as older scripts do
        ours._set_static_graph()
        theirs._set_static_graph()
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
                    sum(F.mse_loss(ddp(x + k), y) for k in range(forwards)).backward()
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
@pytest.mark.parametrize("model_name", ["checkpoint_twice", "with_unused", "mlp",
                                        "checkpoint_twice_not_reentrant"])
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
def test_bit_identical_with_two_forwards_per_backward(ranks, model_name):
    check(ranks(3).run(train_side_by_side, model_name, forwards=2))


@pytest.mark.parametrize("model_name", ["checkpoint_twice", "with_unused"])
def test_bit_identical_with_gradient_as_bucket_view(ranks, model_name):
    check(ranks(3).run(train_side_by_side, model_name, gradient_as_bucket_view=True))


def test_find_unused_parameters_is_not_needed_but_allowed(ranks):
    """torch builds its first buckets as for a static graph and warns; so does miniddp."""
    results = ranks(3).run(train_with_warnings, "with_unused", find_unused_parameters=True)
    check(results)
    for result in results:  # torch's DDP and miniddp's warn alike, in torch's words
        said = [w for w in result["warnings"] if w.startswith(
            "You passed find_unused_parameters=true to DistributedDataParallel, "
            "`_set_static_graph` will detect unused parameters automatically")]
        assert len(said) == 2, result["warnings"]


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


def test_static_graph_set_after_construction_matches_torch(ranks):
    """``_set_static_graph()`` after construction keeps the first buckets of
    ``find_unused_parameters=True`` (torch's rule), then rebuilds as a static graph."""
    results = ranks(3).run(train_with_warnings, "with_unused", static_graph=False,
                           find_unused_parameters=True)
    check(results)
    assert len(results[0]["torch_layouts"][0]) > 1


# ----- a graph that changes -----

def run_until_error(ddp, change: str):
    """Three steps; the third changes the graph. Return the error, or None."""
    try:
        for step in range(4):
            x, y = data(step, 0)
            if change == "first_in_no_sync" and step == 0:
                with ddp.no_sync():
                    F.mse_loss(ddp(x), y).backward()
            kwargs = {}
            if step == 2:
                kwargs = {"use_unused": {"use_all": True}, "block_once": {"times": 1},
                          "block_thrice": {"times": 3}}.get(change, {})
            out = ddp(x, **kwargs)
            F.mse_loss(out[0] if change == "ignored_output" else out, y).backward()
    except RuntimeError as e:
        return f"step {step}: {e}"
    return None


def errors_on_changed_graph(change: str) -> dict:
    model_name = {"use_unused": "with_unused", "ignored_output": "two_outputs"}.get(
        change, "checkpoint_twice")
    ours, theirs = build_pair(model_name, static_graph=True, bucket_cap_mb=CAP_MB)
    return {"ours": run_until_error(ours, change), "torch": run_until_error(theirs, change)}


@pytest.mark.parametrize("change, ours_says", [
    ("use_unused", r"step 2: the gradient of 'unused.bias' arrived more often in this "
                   r"backward than in the first, where it arrived 0 time"),
    ("block_thrice", r"step 2: the gradient of 'block.2.bias' arrived more often in this "
                     r"backward than in the first, where it arrived 2 time"),
    ("block_once", r"step 3: Expected to have finished reduction in the prior iteration .*"
                   r"block.0.weight, block.0.bias, block.2.weight, block.2.bias\. "
                   r"static_graph=True is set"),
    # the first forward's outputs are watched, so a parameter behind an ignored output fires
    # (without a gradient); later outputs are not, so it stops firing: a changed graph
    ("ignored_output", r"step 2: Expected to have finished reduction in the prior iteration .*"
                       r"unused.weight, unused.bias\. static_graph=True is set"),
    ("first_in_no_sync", r"step 0: with static_graph=True the first backward must follow a "
                         r"synchronized forward"),
])
def test_a_changed_graph_is_an_error_as_in_torch(ranks, change, ours_says):
    for result in ranks(2).run(errors_on_changed_graph, change):
        assert result["torch"] is not None, "torch's DDP accepts this: the test is wrong"
        assert result["torch"].split(":")[0] == ours_says.split(":")[0], result["torch"]
        assert result["ours"] is not None and re.match(ours_says, result["ours"]), result


def set_static_graph_after_first_forward():
    ours, theirs = build_pair("mlp")
    errors = []
    for ddp in (ours, theirs):
        x, y = data(0, 0)
        F.mse_loss(ddp(x), y).backward()
        with pytest.raises(RuntimeError) as caught:
            ddp._set_static_graph()
        errors.append(str(caught.value))
    return errors


def test_static_graph_cannot_be_set_after_training_started(ranks):
    ours, _ = ranks(2).run(set_static_graph_after_first_forward)[0]
    assert "static_graph can only be turned on before the first forward" in ours


def checkpoint_twice_without_static_graph():
    ours, theirs = build_pair("checkpoint_twice")
    x, y = data(0, 0)
    errors = []
    for ddp in (ours, theirs):
        with pytest.raises(RuntimeError) as caught:
            F.mse_loss(ddp(x), y).backward()
        errors.append(str(caught.value))
    return errors


def test_without_static_graph_a_layer_checkpointed_twice_is_refused(ranks):
    """The reason static_graph exists: both DDPs refuse, and miniddp says what to do."""
    ours, theirs = ranks(2).run(checkpoint_twice_without_static_graph)[0]
    assert "pass static_graph=True" in ours
    # torch's own tests match its opening and its "Parameter at index i with name n"
    assert theirs.startswith("Expected to mark a variable ready only once.")
    assert ours.startswith("Expected to mark a variable ready only once.")
    which = re.search(r"Parameter at index \d+ with name \S+ has been marked as ready twice",
                      theirs)
    assert which and which.group(0) in ours, (ours, theirs)


# ----- a first iteration that bypasses the static-graph DDP (docs/differences.md) -----

TORCH_2_13 = TORCH_RELEASE == (2, 13)


def first_iteration_bypassing_ddp(how: str) -> dict:
    """Step 0 does not go through DDP's forward (``ddp.module(x)``) or takes its gradients with
    ``torch.autograd.grad``; the steps after it are ordinary. What becomes of the averaging?"""
    out = {}
    for name, ddp in zip(("ours", "torch"), build_pair("mlp", static_graph=True)):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        equal_across_ranks, error = [], None
        try:
            for step in range(4):
                x, y = data(step, 0)
                opt.zero_grad()
                if step == 0 and how == "autograd_grad":
                    torch.autograd.grad(F.mse_loss(ddp(x), y), list(ddp.parameters()))
                    continue
                F.mse_loss(ddp.module(x) if step == 0 else ddp(x), y).backward()
                if step > 0:
                    g = torch.cat([p.grad.flatten() for p in ddp.parameters()])
                    both = [torch.empty_like(g) for _ in range(dist.get_world_size())]
                    dist.all_gather(both, g)
                    equal_across_ranks.append(same_bits(both[0], both[1]))
                opt.step()
        except RuntimeError as e:
            error = str(e)
        out[name] = {"averaged": equal_across_ranks, "error": error}
    return out


def test_a_first_backward_outside_the_forward_does_not_stop_the_averaging(ranks):
    result = ranks(2).run(first_iteration_bypassing_ddp, "module_called_directly")[0]
    assert result["ours"] == {"averaged": [True, True, True], "error": None}, result["ours"]
    if TORCH_2_13:  # what the README says of torch 2.13 (and the check's control: it can fail)
        assert result["torch"]["averaged"][-1] is False, "torch 2.13 stops averaging"


def test_a_first_iteration_through_autograd_grad_is_refused_at_the_next_backward(ranks):
    result = ranks(2).run(first_iteration_bypassing_ddp, "autograd_grad")[0]
    assert result["ours"]["averaged"] == [] and "graph has changed" in result["ours"]["error"]
    if TORCH_2_13:  # what the README says of torch 2.13
        assert result["torch"]["error"] is None and result["torch"]["averaged"][-1] is False, (
            "torch 2.13 goes on without averaging")
