"""Two behaviours found by running miniddp beside torch's DDP on random training runs.

* ``bucket_cap_mb=0``: torch accepts it (every parameter closes its own bucket) and trains;
  miniddp does the same, bit for bit.
* A forward with grad enabled that no backward follows (validation without ``torch.no_grad()``),
  then a step whose first micro-batch runs in ``no_sync``, with ``find_unused_parameters=True``
  and a model output the loss ignores. torch's reducer still expects the hooks of the
  validation forward, so the ``no_sync`` micro-batch's backward *is* reduced, and torch routes
  every forward's outputs through its sink (inside ``no_sync`` too), so the parameters behind
  the ignored output are marked ready. miniddp follows the same rule
  (``Reducer.outputs_of_unsynced_forward``).

Each case runs the same schedule with torch's DDP and with miniddp's on every rank, and
compares every gradient after every micro-batch and every parameter after every step with
``torch.equal``; any exception is part of what is compared.
"""

import contextlib
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_cases import TwoHeads, compare_with_torch
from torch import nn

import miniddp
from miniddp.torch_versions import TORCH_AVERAGES_PARAMETERS_USED_ONLY_IN_NO_SYNC

# ----- bucket_cap_mb=0 -----

#: torch 2.11's DDP refuses the cap ("bucket_cap_mb should be set by now": a falsy test meant
#: for None); 2.1 and 2.13 accept it, and so does miniddp on every torch. Where torch refuses
#: it, torch gets a 1-byte cap instead, which also closes a bucket at every parameter.
TORCH_REFUSES_CAP_ZERO = "if not bucket_cap_mb:" in inspect.getsource(
    nn.parallel.DistributedDataParallel.__init__)



@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("case", [{}, {"find_unused_parameters": True, "model_name": "branchy"},
                                  {"gradient_as_bucket_view": True, "micro_batches": 2}])
def test_bucket_cap_zero_trains_bit_identical_to_torch(ranks, world_size, case):
    theirs = {"torch_bucket_cap_mb": 1 / 2**20} if TORCH_REFUSES_CAP_ZERO else {}
    results = ranks(world_size).run(compare_with_torch, steps=3, bucket_cap_mb=0, **theirs,
                                    **case)
    for rank, result in enumerate(results):
        assert result["problems"] == [], f"rank {rank}"
        assert result["layouts"][-1] == result["torch_layout"]
        assert all(len(bucket) == 1 for bucket in result["layouts"][-1]), (
            "a cap of 0 puts every parameter in a bucket of its own")


def test_bucket_cap_list_with_zero_trains_bit_identical_to_torch(ranks):
    if "bucket_cap_mb_list" not in miniddp.compat.arguments.TORCH_DDP_SIGNATURE.parameters:
        pytest.skip("this torch has no bucket_cap_mb_list (2.13)")
    for result in ranks(3).run(compare_with_torch, steps=3, bucket_cap_mb_list=[0, 0.002]):
        assert result["problems"] == [] and result["layouts"][-1] == result["torch_layout"]


# ----- a validation forward without no_grad, then no_sync -----


def uses_b(pattern: str, rank: int, step: int, micro: int) -> bool:
    """Whether the loss uses the second head: always, never, or on some ranks and
    micro-batches only."""
    if pattern in ("always", "never"):
        return pattern == "always"
    return (rank + step + micro) % 2 == 0  # "rank_dependent"


def _batch(step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)


def run_schedule(cls, pattern, validate_at, steps, sabotage=None, **ddp_kwargs):
    """Train ``steps`` steps of two micro-batches (the first in ``no_sync``), with a forward
    under grad and no backward (validation) before each step in ``validate_at``; return every
    gradient after every micro-batch, every parameter after every step, and the first error."""
    rank = dist.get_rank()
    torch.manual_seed(7)
    ddp = cls(TwoHeads(), **ddp_kwargs)
    if sabotage == "no_watch_in_no_sync":  # the pre-fix miniddp: only synced outputs watched
        ddp.reducer.outputs_of_unsynced_forward = lambda outputs: outputs
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    record = {"grads": [], "params": [], "error": None}
    try:
        for step in range(steps):
            if step in validate_at:
                x, _ = _batch(step, 9, rank)
                ddp(x)  # grad enabled, no backward
            opt.zero_grad()
            for micro in range(2):
                x, y = _batch(step, micro, rank)
                with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                    out = ddp(x)
                    loss = F.mse_loss(out["a"], y)
                    if uses_b(pattern, rank, step, micro):
                        loss = loss + F.mse_loss(out["b"], y)
                    loss.backward()
                record["grads"].append([None if p.grad is None else p.grad.clone()
                                        for p in ddp.parameters()])
            opt.step()
            record["params"].append([p.detach().clone() for p in ddp.parameters()])
    except RuntimeError as error:
        record["error"] = str(error).splitlines()[0]
    return record


def side_by_side(pattern, validate_at=(0, 2), steps=4, sabotage=None, **ddp_kwargs):
    """torch's DDP, then miniddp's, on this rank; the differences, in words."""
    theirs = run_schedule(nn.parallel.DistributedDataParallel, pattern, validate_at, steps,
                          **ddp_kwargs)
    ours = run_schedule(miniddp.DistributedDataParallel, pattern, validate_at, steps, sabotage,
                        **ddp_kwargs)
    problems = []
    if ours["error"] != theirs["error"]:
        problems.append(f"error: ours {ours['error']!r}, torch's {theirs['error']!r}")
    for kind in ("grads", "params"):
        if len(ours[kind]) != len(theirs[kind]):
            problems.append(f"{kind}: {len(ours[kind])} records, torch {len(theirs[kind])}")
        for k, (a_list, b_list) in enumerate(zip(ours[kind], theirs[kind])):
            for i, (a, b) in enumerate(zip(a_list, b_list)):
                if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                    problems.append(f"{kind} record {k}, parameter {i} differs")
    return {"problems": problems[:8], "torch_error": theirs["error"],
            "micro_batches_recorded": len(theirs["grads"])}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("pattern", ["never", "rank_dependent"])
def test_validation_forward_then_no_sync_with_an_ignored_output_matches_torch(
        ranks, world_size, pattern):
    if pattern == "rank_dependent" and not TORCH_AVERAGES_PARAMETERS_USED_ONLY_IN_NO_SYNC:
        pytest.skip("torch < 2.4 does not average a parameter used only inside no_sync (a bug "
                    "miniddp does not copy), and this schedule has such steps")
    results = ranks(world_size).run(side_by_side, pattern, find_unused_parameters=True,
                                    timeout=90)
    for rank, result in enumerate(results):
        assert result["torch_error"] is None, "torch's DDP trains through this schedule"
        assert result["micro_batches_recorded"] == 8
        assert result["problems"] == [], f"rank {rank} differs from torch's DDP"


def test_validation_forward_then_no_sync_without_unused_search_matches_torch(ranks):
    """Without find_unused_parameters the loss must use both heads; the no_sync backward after
    the validation forward is still reduced, in torch and in miniddp."""
    for result in ranks(3).run(side_by_side, "always", timeout=90):
        assert result["problems"] == [] and result["torch_error"] is None


def test_the_comparison_sees_outputs_left_unwatched_in_no_sync(ranks):
    """Negative control: miniddp without the watch on no_sync outputs differs from torch (its
    next forward raises "Expected to have finished reduction in the prior iteration")."""
    results = ranks(2).run(side_by_side, "never", sabotage="no_watch_in_no_sync",
                           find_unused_parameters=True, timeout=90)
    assert all(any("Expected to have finished reduction" in p for p in result["problems"])
               for result in results)
