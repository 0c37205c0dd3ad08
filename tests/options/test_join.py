"""Uneven inputs (``miniddp.options.join``): ranks with fewer batches shadow the others, nobody
hangs, and every parameter is bit-identical to torch's DDP under the same join, after every
step.

Each rank trains miniddp's DDP inside ``join``, then torch's, on the same rank-dependent
batches, taking ``steps[rank]`` optimizer steps; the states after each of its steps and after
the join context (the final sync) are compared bit for bit (``checks.bits.bit_difference``). A hang
is the failure mode here: the ranks' process group times out after 20 s, the test after 60.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack, nullcontext
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from ddp_cases import (
    MLP,
    MODELS,
    batch,
    first_bucket_as_small_as,
    loss_of,
    make_optimizer,
    torch_bucket_layout,
)
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer

import miniddp
import miniddp.options.join
from miniddp.checks.bits import bit_difference

SMALL_CAP = 0.002  # MiB: several buckets even for the small models (3 ranks show the layout)


def build(model_name: str, bucket_cap_mb=SMALL_CAP, **ddp_kwargs):
    """The same architecture on every rank, from a rank-dependent seed; both DDPs around it."""
    torch.manual_seed(1234 + dist.get_rank())
    module = MLP() if model_name == "mlp" else MODELS[model_name]()
    if bucket_cap_mb is not None:  # None: the defaults (torch < 2.4 takes no None)
        ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
    with first_bucket_as_small_as(bucket_cap_mb):
        ours = miniddp.DistributedDataParallel(copy.deepcopy(module), **ddp_kwargs)
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(module), **ddp_kwargs)
    return ours, theirs


def bucket_layout(ddp) -> torch.Tensor:
    """The buckets' parameter indices, each bucket closed by -1 (for either DDP)."""
    if isinstance(ddp, miniddp.DistributedDataParallel):
        buckets = [info.param_indices for info in ddp.buckets]
    else:
        buckets = torch_bucket_layout(ddp)
    return torch.tensor([i for bucket in buckets for i in [*bucket, -1]])


def snapshot(ddp) -> dict[str, torch.Tensor | None]:
    """Parameters, gradients, buffers and the bucket layout (which the bits show only when
    three ranks or more contribute, and one that joined contributes zeros)."""
    state = {"bucket layout": bucket_layout(ddp)}
    state.update({f"param {n}": p.detach().clone() for n, p in ddp.module.named_parameters()})
    state.update({f"grad {n}": None if p.grad is None else p.grad.clone()
                  for n, p in ddp.module.named_parameters()})
    state.update({f"buffer {n}": b.clone() for n, b in ddp.module.named_buffers()})
    return state


def train(ddp, model_name: str, my_steps: int, micro_batches: int = 1, join=None,
          optimizer=None, steps_after: int = 0, **join_kwargs) -> list[dict]:
    """``my_steps`` steps inside ``join`` (default ``ddp.join(**join_kwargs)``), then
    ``steps_after`` steps on every rank after it. Returns the state after each step and after
    the context (index ``my_steps``: every rank synced from the last to join)."""
    rank = dist.get_rank()
    optimizer = optimizer or make_optimizer("sgd", ddp.parameters())
    states = []

    def one_step(step):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(micro_batches):
            args, kwargs, y = batch(model_name, step, micro, rank)
            with nullcontext() if micro == micro_batches - 1 else ddp.no_sync():
                loss_of(model_name, ddp(*args, **kwargs), y).backward()
        optimizer.step()
        states.append(snapshot(ddp))

    with join or ddp.join(**join_kwargs):
        for step in range(my_steps):
            one_step(step)
    states.append(snapshot(ddp))
    for step in range(steps_after):
        one_step(100 + step)
    return states


def differences(ours: list[dict], theirs: list[dict]) -> list[str]:
    problems = []
    for step, (a, b) in enumerate(zip(ours, theirs)):
        where = f"state {step}"
        for key in a:
            x, y = a[key], b[key]
            if (x is None) != (y is None):
                problems.append(f"{where} {key}: None on one side only")
            elif x is not None and x.shape != y.shape:
                problems.append(f"{where} {key}: {x.tolist()} != {y.tolist()}")
            elif x is not None and (difference := bit_difference(x, y)) is not None:
                problems.append(f"{where} {key}: {difference}")
    return problems[:8]


def same_on_every_rank(state: dict) -> bool:
    flat = torch.cat([t.reshape(-1).double() for k, t in state.items()
                      if k.startswith(("param", "buffer"))])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], other) for other in everyone)


def sabotaged(name: str | None):
    """A subtly wrong ``miniddp.options.join``, for the negative controls (``None``: the real
    one)."""
    hook = miniddp.options.join.DDPJoinHook
    if name == "divisor":  # the initial world size, whatever divide_by_initial_world_size says
        init = hook.__init__
        return mock.patch.object(hook, "__init__",
                                 lambda self, ddp, _divide=True: init(self, ddp, True))
    if name == "final_model":  # the model of a rank that joined early, not of the last one
        post = hook.post_hook
        return mock.patch.object(hook, "post_hook", lambda self, last: post(self, not last))
    if name == "used_flags":  # a joined rank sums in zeros, where torch's sums its last flags
        return mock.patch.object(
            miniddp.options.join, "_shadow_used_flags",
            lambda reducer: dist.all_reduce(torch.zeros_like(reducer.unused.locally_used),
                                            group=reducer.group))
    return nullcontext()


class Fp16HookForTest:
    """torch's ``fp16_compress_hook`` in place of the reducer's default reduction
    (``reducer.comm_hook``: ``launch`` returns a future, ``finish`` writes its value back)."""

    averages = True  # gradients enter the bucket unscaled

    def launch(self, bucket, _bucket_count):
        compressed = bucket.buffer.to(torch.float16).div_(dist.get_world_size())
        return dist.all_reduce(compressed, async_op=True).get_future()

    def finish(self, bucket):
        bucket.buffer.copy_(bucket.work.value()[0])


def compare_under_join(model_name: str, steps: list[int], micro_batches: int = 1,
                       sabotage: str | None = None, bucket_cap_mb=SMALL_CAP,
                       join_kwargs=None, fp16_hook: bool = False, steps_after: int = 0,
                       **ddp_kwargs) -> dict:
    """On one rank: miniddp under join, then torch's DDP under the same join; compare."""
    ours, theirs = build(model_name, bucket_cap_mb, **ddp_kwargs)
    if fp16_hook:
        ours.reducer.comm_hook = Fp16HookForTest()
        theirs.register_comm_hook(None, default_hooks.fp16_compress_hook)
    my_steps = steps[dist.get_rank()]
    with sabotaged(sabotage):
        mine = train(ours, model_name, my_steps, micro_batches, steps_after=steps_after,
                     **(join_kwargs or {}))
    reference = train(theirs, model_name, my_steps, micro_batches, steps_after=steps_after,
                      **(join_kwargs or {}))
    return {"problems": differences(mine, reference), "synced": same_on_every_rank(mine[my_steps])}


def run(ranks, world_size, *args, **kwargs) -> list[dict]:
    return ranks(world_size).run(compare_under_join, *args, timeout=60, **kwargs)


def assert_equal_to_torch(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert result["problems"] == [], f"rank {rank}: {result['problems']}"
        assert result["synced"], f"rank {rank}: the replicas differ after the join"


UNEVEN = {2: [5, 2], 3: [5, 2, 3]}  # optimizer steps per rank


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_divides_by_the_initial_world_size_as_torch(ranks, world_size):
    assert_equal_to_torch(run(ranks, world_size, "mlp", UNEVEN[world_size]))


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_with_a_bucket_per_parameter_as_torch(ranks, world_size):
    """A bucket per parameter: as many shadow all_reduces as buckets, in the same order."""
    for divide in (True, False):
        assert_equal_to_torch(run(ranks, world_size, "mlp", UNEVEN[world_size], micro_batches=2,
                                  bucket_cap_mb=0.00001,
                                  join_kwargs={"divide_by_initial_world_size": divide}))


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_divides_by_the_ranks_still_training_as_torch(ranks, world_size):
    assert_equal_to_torch(run(ranks, world_size, "mlp", UNEVEN[world_size],
                              join_kwargs={"divide_by_initial_world_size": False}))


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_with_no_sync_micro_batches_as_torch(ranks, world_size):
    for divide in (True, False):
        assert_equal_to_torch(run(ranks, world_size, "mlp", UNEVEN[world_size],
                                  micro_batches=3,
                                  join_kwargs={"divide_by_initial_world_size": divide}))


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_buffers_come_from_the_last_rank_training_as_torch(ranks, world_size):
    """Also after the context: a DDP that was joined keeps taking buffers from the highest
    rank, not rank 0 (torch keeps its join configuration, and so does miniddp)."""
    assert_equal_to_torch(run(ranks, world_size, "conv_bn", UNEVEN[world_size], steps_after=2))


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_with_find_unused_parameters_as_torch(ranks, world_size):
    for divide in (True, False):
        assert_equal_to_torch(run(ranks, world_size, "branchy", UNEVEN[world_size],
                                  find_unused_parameters=True,
                                  join_kwargs={"divide_by_initial_world_size": divide}))


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_with_gradient_as_bucket_view_as_torch(ranks, world_size):
    assert_equal_to_torch(run(ranks, world_size, "mlp", UNEVEN[world_size],
                              gradient_as_bucket_view=True,
                              join_kwargs={"divide_by_initial_world_size": False}))


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank0_joining_before_the_rebuild_gives_torch_buckets(ranks, world_size):
    """Rank 0 trains 0 or 1 steps: the rebuild happens while it shadows, in its order."""
    for first in (0, 1):
        steps = [first] + [4] * (world_size - 1)
        assert_equal_to_torch(run(ranks, world_size, "mlp", steps))
        assert_equal_to_torch(run(ranks, world_size, "big", steps, bucket_cap_mb=None))


@pytest.mark.parametrize("world_size", [2, 3])
def test_joined_ranks_shadow_a_comm_hook_by_running_it_as_torch(ranks, world_size):
    """An fp16 hook all_reduces fp16 tensors: a shadow of fp32 zeros would not match them."""
    for divide in (True, False):
        assert_equal_to_torch(run(ranks, world_size, "mlp", UNEVEN[world_size], fp16_hook=True,
                                  join_kwargs={"divide_by_initial_world_size": divide}))


def test_join_with_even_inputs_or_disabled_changes_nothing(ranks):
    assert_equal_to_torch(run(ranks, 3, "mlp", [3, 3, 3]))
    assert_equal_to_torch(run(ranks, 3, "mlp", [3, 3, 3], join_kwargs={"enable": False}))


@pytest.mark.parametrize("sabotage, world_size, kwargs", [
    ("divisor", 2, {"join_kwargs": {"divide_by_initial_world_size": False}}),
    ("final_model", 2, {}),
    ("used_flags", 3, {"find_unused_parameters": True, "model_name": "branchy"}),
])
def test_negative_controls_a_subtly_wrong_join_is_caught(ranks, sabotage, world_size, kwargs):
    kwargs = {"model_name": "mlp", **kwargs}
    results = ranks(world_size).run(compare_under_join, kwargs.pop("model_name"),
                                    UNEVEN[world_size], sabotage=sabotage, timeout=60,
                                    **kwargs)
    assert any(r["problems"] for r in results), f"{sabotage}: the comparison did not notice"


# ----- throw_on_early_termination -----

def first_error(ddp, model_name: str, my_steps: int) -> tuple[int, str]:
    """Train until an error; return the step and the error's first words."""
    optimizer = make_optimizer("sgd", ddp.parameters())
    step = -1
    try:
        with ddp.join(throw_on_early_termination=True):
            for step in range(my_steps):
                args, kwargs, y = batch(model_name, step, 0, dist.get_rank())
                loss_of(model_name, ddp(*args, **kwargs), y).backward()
                optimizer.step()
                optimizer.zero_grad()
    except RuntimeError as error:
        return step, str(error).split(".")[0]
    return step, "no error"


def throw_on_both(steps: list[int]) -> dict:
    ours, theirs = build("mlp")
    my_steps = steps[dist.get_rank()]
    mine = first_error(ours, "mlp", my_steps)
    reference = first_error(theirs, "mlp", my_steps)
    return {"ours": mine, "theirs": reference,
            "problems": differences([snapshot(ours)], [snapshot(theirs)])}


@pytest.mark.parametrize("world_size", [2, 3])
def test_throw_on_early_termination_raises_on_every_rank_as_torch(ranks, world_size):
    steps = UNEVEN[world_size]
    results = ranks(world_size).run(throw_on_both, steps, timeout=60)
    for rank, result in enumerate(results):
        assert result["ours"] == result["theirs"], f"rank {rank}: {result}"
        assert result["ours"][1] != "no error", f"rank {rank} did not raise"
        assert result["problems"] == [], f"rank {rank}: {result['problems']}"
    shortest = min(steps)
    for rank, (step, message) in enumerate(r["ours"] for r in results):
        if steps[rank] == shortest:  # out of data: raises when its loop ends
            assert (step, message) == (shortest - 1, f"Rank {rank} exhausted all inputs")
        else:  # still training: raises at the forward of the step the others lack
            assert (step, message) == (shortest, "Detected at least one rank that exhausted "
                                                 "inputs"), results


# ----- torch's Join with more than one joinable -----

def with_zero_optimizer(steps: list[int]) -> dict:
    ours, theirs = build("mlp")
    my_steps, states = steps[dist.get_rank()], []
    for ddp in (ours, theirs):
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.05,
                                       momentum=0.9)
        states.append(train(ddp, "mlp", my_steps, join=Join([ddp, zero]), optimizer=zero))
    return {"problems": differences(*states), "synced": same_on_every_rank(states[0][-1])}


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_join_with_ddp_and_zero_redundancy_optimizer_as_torch(ranks, world_size):
    assert_equal_to_torch(ranks(world_size).run(with_zero_optimizer, UNEVEN[world_size],
                                                timeout=60))


def authoritative_ranks(steps: dict[int, int], members: list[int]) -> dict:
    """Both DDPs on the group of ``members`` (global ranks), trained under join for
    ``steps[rank]`` steps: the rank each says the final model came from."""
    group = dist.new_group(members)  # every rank must create it
    out = {}
    for cls in (miniddp.DistributedDataParallel, nn.parallel.DistributedDataParallel):
        if dist.get_rank() not in members:
            continue
        torch.manual_seed(0)
        ddp = cls(nn.Linear(2, 2), process_group=group)
        with ddp.join():
            for _ in range(steps[dist.get_rank()]):
                ddp(torch.ones(1, 2)).sum().backward()
        out[cls.__module__.split(".")[0]] = (ddp._authoritative_rank,
                                             ddp._get_ddp_logging_data().get("join_uneven_inputs"))
    return out


@pytest.mark.parametrize("steps, members", [({0: 1, 1: 3, 2: 2}, [0, 1, 2]),
                                            ({1: 3, 2: 1}, [1, 2])])
def test_the_rank_the_model_came_from_and_the_logged_join_are_torchs(ranks, steps, members):
    """``ddp._authoritative_rank``: the last rank to join (its rank in the DDP's group, so 0
    for global rank 1 in the group of ranks 1 and 2), and ``join_uneven_inputs`` logged."""
    for rank, result in enumerate(ranks(3).run(authoritative_ranks, steps, members)):
        if rank in members:
            assert result["miniddp"] == result["torch"], result
            assert result["torch"][1], result


# ----- the hang that join prevents -----

def uneven_on_a_short_timeout(use_join: bool) -> str | None:
    """Rank 0 has one batch, the others two, in a group that gives up after 2 s."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(MLP(), process_group=group)
    error = None
    with ddp.join() if use_join else ExitStack():
        try:
            for step in range(1 if dist.get_rank() == 0 else 2):
                args, _, y = batch("mlp", step, 0, dist.get_rank())
                loss_of("mlp", ddp(*args), y).backward()
        except RuntimeError as caught:
            error = str(caught)
    dist.barrier()  # on the default group: the ranks of this test leave together
    dist.destroy_process_group(group)  # broken for good after a timeout
    return error


def test_without_join_the_ranks_still_training_time_out_and_join_prevents_it(ranks):
    errors = ranks(2).run(uneven_on_a_short_timeout, False, timeout=60)
    assert errors[0] is None, errors
    assert errors[1] is not None and "timed out" in errors[1].lower(), errors
    assert ranks(2).run(uneven_on_a_short_timeout, True, timeout=60) == [None, None]
