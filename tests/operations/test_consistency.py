"""Replicas that drift and ranks out of step are caught, named, and explained (issue #12, 1-2).

Each misuse runs on real ranks and the message is checked: which rank, which step or
parameter, what to change. The out-of-step cases run in a fresh group with a 3 s timeout
(a timed-out gloo group cannot be reused), each rank catching its own error and returning it,
so that every rank's words can be checked. With the checks off, nothing may run on the hot path:
that is counted, not timed.
"""

import os
import re
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, wait

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_cases import MLP, compare_with_torch
from torch import nn

import miniddp
from miniddp.checks import consistency
from miniddp.checks import out_of_step as out_of_step_messages
from miniddp.checks.bits import all_same_bits
from miniddp.checks.consistency import check_replicas
from miniddp.launch import RankGroup

SHORT_TIMEOUT = 3.0


def data(step, rank=None):
    rank = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def make_ddp(every=None, detail=False, depth=3, **kwargs):
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(MLP(depth=depth), **kwargs)
    if every:
        ddp.check_every(every, detail=detail)
    return ddp


def train_step(ddp, opt, step, sync=True, backward=True):
    x, y = data(step)
    opt.zero_grad()
    if sync:
        loss = F.mse_loss(ddp(x), y)
    else:
        with ddp.no_sync():
            loss = F.mse_loss(ddp(x), y)
    if backward:
        loss.backward()
    opt.step()


def caught(fn, *args, **kwargs):
    """Run ``fn`` on this rank; return ``(error type name, message, seconds)`` or None."""
    start = time.monotonic()
    try:
        fn(*args, **kwargs)
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - start
    return None


def in_short_group(world_size, fn, *args):
    """Run ``fn`` in a fresh group with a short timeout, then discard the group."""
    group = RankGroup(world_size, pg_timeout=SHORT_TIMEOUT)
    try:
        return group.run(fn, *args, timeout=60)
    finally:
        group.close(kill=True)


#: The out-of-step cases in which a rank waits out SHORT_TIMEOUT (the others raise at once):
#: (world size, case, mode) of :func:`out_of_step`.
WAITED_OUT = {"skip_backward-off": (2, "skip_backward", "off"),
              "no_sync-off": (2, "no_sync", "off"),
              "fewer-off": (2, "fewer", "off"),
              "fewer-detail": (2, "fewer", "detail"),
              "skip_backward-info": (2, "skip_backward", "info")}


@pytest.fixture(scope="module")
def waited_out():
    """``waited_out(name)``: what each rank of a :data:`WAITED_OUT` case returned. The cases run
    at once, each in a fresh group of its own, so the timeout is waited out once, not once per
    case; a case that failed raises its error in its own test."""
    groups = {name: RankGroup(world_size, pg_timeout=SHORT_TIMEOUT)
              for name, (world_size, _, _) in WAITED_OUT.items()}
    try:
        with ThreadPoolExecutor(len(groups)) as pool:
            futures = {name: pool.submit(groups[name].run, out_of_step, case, mode, timeout=60)
                       for name, (_, case, mode) in WAITED_OUT.items()}
            wait(futures.values())
    finally:
        for group in groups.values():
            group.close(kill=True)
    return lambda name: futures[name].result()


# ----- 1. a second backward after the gradients were averaged -----

def second_backward(every):
    ddp = make_ddp(every)
    x, y = data(0)
    loss = F.mse_loss(ddp(x), y)
    loss.backward(retain_graph=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        error = caught(loss.backward, retain_graph=True)
        caught(loss.backward)  # a third: still one warning
    return {"error": error, "warnings": [str(w.message) for w in seen]}


def test_a_second_backward_warns_once_naming_the_parameter(ranks):
    for r in ranks(2).run(second_backward, None):
        assert r["error"] is None
        assert len(r["warnings"]) == 1, r["warnings"]
        message = r["warnings"][0]
        assert re.search(r"parameter '\d\.(weight|bias)' got a gradient after", message)
        assert "call backward once" in message and "TORCH_DISTRIBUTED_DEBUG=INFO" in message


def test_a_second_backward_raises_when_the_checks_are_on(ranks):
    for r in ranks(2).run(second_backward, 100):
        kind, message, _ = r["error"]
        assert kind == "LateGradient" and re.search(r"'\d\.(weight|bias)' got a gradient", message)


def accumulate_through_the_module(every):
    """Micro-batches through ``ddp.module`` (a common alternative to no_sync), the last one
    through ``ddp``: legitimate, averaged by the synced step, so no warning and no error."""
    torch.manual_seed(0)
    ddp = make_ddp(every)
    theirs = nn.parallel.DistributedDataParallel(MLP())
    theirs.module.load_state_dict(ddp.module.state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, theirs)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(3):
            for model, opt in zip((ddp, theirs), optimizers):
                opt.zero_grad()
                for micro in range(2):
                    x, y = data(10 * step + micro)
                    F.mse_loss(model.module(x), y).backward()
                x, y = data(10 * step + 2)
                F.mse_loss(model(x), y).backward()
                opt.step()
    same = all_same_bits(ddp.parameters(), theirs.parameters())
    return {"same": same, "warnings": [str(w.message) for w in seen
                                       if "got a gradient after" in str(w.message)]}


@pytest.mark.parametrize("every", [None, 1])
def test_accumulating_through_ddp_module_is_not_a_second_backward(ranks, every):
    for r in ranks(2).run(accumulate_through_the_module, every):
        assert r["warnings"] == [] and r["same"]


# ----- 1. replicas that drift apart -----

def edit_on_one_rank(every, explicit=False):
    """Rank 1 nudges one weight in place after step 1; the check must name it and rank 1."""
    ddp = make_ddp(every)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    train_step(ddp, opt, 0)
    before = caught(check_replicas, ddp, step=1)
    if dist.get_rank() == 1:
        with torch.no_grad():
            ddp.module[2].weight[3, 5] += 1e-6
    if explicit:
        return {"before": before, "after": caught(check_replicas, ddp, step=1)}
    return {"before": before, "after": caught(train_step, ddp, opt, 1)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_parameter_edited_on_one_rank_is_named_at_the_next_checked_step(ranks, world_size):
    for r in ranks(world_size).run(edit_on_one_rank, 1):
        assert r["before"] is None
        kind, message, _ = r["after"]
        assert kind == "ReplicasDiverged", message
        assert "replicas differ at synchronized step 2" in message
        others = "[0]" if world_size == 2 else "[0, 2]"
        assert f"1 of 6 parameters are not the same on every rank: '2.weight' differs on " \
               f"ranks [1] from ranks {others}" in message
        assert "in-place edit" in message


def test_check_replicas_on_demand_names_the_parameter_and_the_step(ranks):
    for r in ranks(3).run(edit_on_one_rank, None, explicit=True):
        assert r["before"] is None
        kind, message = r["after"][:2]
        assert kind == "ReplicasDiverged" and "replicas differ at step 1" in message
        assert "'2.weight' differs on ranks [1] from ranks [0, 2]" in message


def test_checksums_see_a_one_bit_change_and_nothing_else():
    t = torch.randn(100, 7)
    base = consistency.parameter_checksums([t, t.half(), t.double()])
    assert base == consistency.parameter_checksums([t.clone(), t.half(), t.double()])
    for dtype, bits in ((torch.float32, torch.int32), (torch.float16, torch.int16),
                        (torch.float64, torch.int64)):
        u = t.to(dtype).clone()
        u.view(bits).view(-1)[123] ^= 1  # the lowest bit (torch 2.1 has no nextafter for fp16)
        assert (u != t.to(dtype)).sum() == 1
        assert consistency.parameter_checksums([u]) != consistency.parameter_checksums(
            [t.to(dtype)])


def no_sync_at_different_steps():
    """Accumulating two micro-batches, rank 1 one forward later: every bucket all_reduce still
    meets one on the other rank, so nothing hangs and torch's DDP drifts silently."""
    ddp = make_ddp(every=100)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def run():
        for step in range(4):
            train_step(ddp, opt, step, sync=(step + dist.get_rank()) % 2 == 1)

    return caught(run)


def test_no_sync_at_different_steps_on_different_ranks_is_named(ranks):
    for kind, message, _ in in_short_group(2, no_sync_at_different_steps):
        assert kind == "OutOfStep", message
        assert "ranks out of step at synchronized step 1" in message
        assert "rank 0: in synchronized forward 2, after running forward(s) [1] inside " \
               "no_sync()" in message
        assert "rank 0 differs from rank 1 (in synchronized forward 1)" in message, message
        assert "Rank 0 and rank 1 disagree on which forwards synchronize: use no_sync() for " \
               "the same " \
               "forwards on every rank" in message


def agreed_irregularities():
    """What every rank does alike is no error: a forward without backward, no_sync, a
    siamese forward, a frozen rebuild."""
    ddp = make_ddp(every=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    train_step(ddp, opt, 0)
    train_step(ddp, opt, 1, backward=False)
    train_step(ddp, opt, 2, sync=False)
    train_step(ddp, opt, 3)
    x, y = data(4)
    (F.mse_loss(ddp(x), y) + F.mse_loss(ddp(x + 1), y)).backward()
    check_replicas(ddp, step=4)
    steps = [ddp.reducer.consistency.step]
    ddp.check_every(None)
    train_step(ddp, opt, 5)
    ddp.check_every(1, detail=True)  # on again: its records start afresh
    train_step(ddp, opt, 6)
    train_step(ddp, opt, 7)
    return steps + [ddp.reducer.consistency.step]


def test_what_every_rank_does_alike_passes_the_checks(ranks):
    assert ranks(3).run(agreed_irregularities) == [[5, 2]] * 3


# ----- 2. ranks out of step -----

def out_of_step(case, mode, steps=4):
    """Rank 1 misbehaves at step 2 (``case``); every rank returns its error."""
    if mode == "env":
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    try:
        ddp = make_ddp(every=1 if mode in ("info", "detail") else None, detail=mode == "detail")
    finally:
        os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    odd = dist.get_rank() == 1

    def run():
        for step in range(steps - 1 if case == "fewer" and odd else steps):
            train_step(ddp, opt, step, sync=not (case == "no_sync" and odd and step == 2),
                       backward=not (case == "skip_backward" and odd and step == 2))

    return caught(run)


def test_without_debug_a_timeout_says_a_rank_may_have_skipped_a_step_and_who_waited(waited_out):
    results = waited_out("skip_backward-off")
    kind, message, took = results[0]
    assert kind == "CollectiveStalled", message
    assert "rank 0: the all_reduce of bucket 0 in the backward of forward 4 did not complete" \
           in message
    assert "A rank may have skipped a step" in message
    assert "rank 0 in the backward of forward 4 (synchronized forward 4)" in message
    assert "Rank 1 did not report waiting" in message  # rank 1 finished: it ran ahead
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in message
    assert results[1] is None  # rank 1's steps all paired with someone's: it never noticed


def test_without_debug_no_sync_on_one_rank_is_named_as_not_arriving(waited_out):
    results = waited_out("no_sync-off")
    kind, message, _ = results[0]
    assert "A rank may have skipped a step" in message
    assert "rank 0 in the backward of forward 4 (synchronized forward 4)" in message
    assert "Rank 1 did not report waiting: it may have run fewer steps, skipped this " \
           "backward or run it inside no_sync()" in message
    assert results[1] is None


def test_a_stall_report_names_the_rank_at_another_forward():
    waiting = {0: {"forward": 6, "synced": 6, "bucket": 0},
               1: {"forward": 7, "synced": 6, "bucket": 0},
               2: {"forward": 6, "synced": 6, "bucket": 0}}
    text = out_of_step_messages.stalled(waiting, 4)
    assert "rank 1 in the backward of forward 7 (synchronized forward 6), bucket 0" in text
    assert "Rank 3 did not report waiting" in text
    assert "The ranks are at different forwards: rank 1 ran a forward inside no_sync() or " \
           "skipped a backward" in text


def test_without_debug_a_rank_with_one_step_fewer_is_named_as_not_arriving(waited_out):
    results = waited_out("fewer-off")
    kind, message, took = results[0]
    assert "Rank 1 did not report waiting: it may have run fewer steps" in message
    assert results[1] is None


@pytest.mark.parametrize("mode", ["detail", "env"])
def test_debug_mode_names_a_rank_that_skipped_a_backward_at_once(mode):
    for rank, (kind, message, took) in enumerate(in_short_group(2, out_of_step,
                                                                "skip_backward", mode)):
        assert kind == "OutOfStep", message
        assert took < SHORT_TIMEOUT, "a mismatch must raise at once, not at the timeout"
        assert f"rank {rank}: ranks out of step at collective" in message
        assert "rank 1 differs from rank 0 (about to launch the all_reduce of bucket 0" \
               in message
        assert "rank 1: about to launch the all_reduce of bucket 0" in message
        assert "having run no backward after synchronized forward(s) [3]" in message
        assert "call backward() after a synchronized forward on every rank or on none" \
               in message


def test_debug_mode_names_a_rank_that_ran_no_sync_alone_at_once():
    for kind, message, took in in_short_group(3, out_of_step, "no_sync", "detail"):
        assert kind == "OutOfStep" and took < SHORT_TIMEOUT, message
        assert "rank 1 differs from ranks 0, 2 (about to launch the all_reduce of bucket 0" \
               in message
        assert "after running forward(s) [3] inside no_sync()" in message
        assert "use no_sync() for the same forwards on every rank" in message


def test_a_rank_whose_last_record_is_its_error_is_described_by_it():
    """A rank that raised (and went on, as a script catching errors may) has its error as its
    last record; a report that waits for it describes it by that error (it raised KeyError)."""
    from miniddp.checks import out_of_step
    message = out_of_step.missing("synchronized step 3", {0: {"forward": 3}}, [1],
                                  {1: {"message": "rank 1: ranks out of step at ..."}}, 2.0)
    assert "rank 1's last record: it had stopped with this error: rank 1: ranks out" in message


def test_debug_mode_names_a_rank_that_ran_one_step_fewer(waited_out):
    results = waited_out("fewer-detail")
    kind, message, took = results[0]
    assert kind == "OutOfStep", message
    assert "rank 1 did not reach collective" in message
    assert "rank 1's last record: about to launch the all_reduce of bucket 0" in message
    assert "in forward 3" in message and "run fewer steps than the others" in message
    assert results[1] is None


def test_the_checks_without_detail_name_a_skipped_backward_when_a_collective_fails(waited_out):
    results = waited_out("skip_backward-info")
    kind, message, _ = results[1]
    assert kind == "OutOfStep", message
    assert "having run no backward after synchronized forward(s) [3]" in message
    kind, message, _ = results[0]  # rank 0 times out in the next all_reduce, and quotes it
    assert kind == "OutOfStep" and "The cause, found by the consistency check: rank 1:" \
           in message


def test_the_checks_without_detail_name_a_rank_that_ran_no_sync_alone_at_once():
    for kind, message, took in in_short_group(3, out_of_step, "no_sync", "info"):
        assert kind == "OutOfStep" and took < SHORT_TIMEOUT, message
        assert "ranks out of step at synchronized step 3: rank 1 differs from ranks 0, 2 " \
               "(in synchronized forward 3)" in message
        assert "rank 1: in synchronized forward 4, after running forward(s) [3] inside " \
               "no_sync()" in message


# ----- switches, cost and equivalence -----

def test_bad_environment_values_are_refused(monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "LOUD")
    with pytest.raises(ValueError, match="use OFF, INFO or DETAIL"):
        consistency.debug_mode()
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "info")
    monkeypatch.setenv("MINIDDP_CHECK_EVERY", "0")
    with pytest.raises(ValueError, match="MINIDDP_CHECK_EVERY='0'"):
        consistency.checks_from_environment(None)


CHECK_MODULES = ("consistency.py", "fingerprints.py", "ledger.py", "out_of_step.py")


def calls_per_step(every, depth, detail=False):
    """Python calls into the checks' modules during two steps, after two warm-up steps."""
    ddp = make_ddp(every, detail, depth=depth)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(2):
        train_step(ddp, opt, step)
    counted = []

    def profile(frame, event, _arg):
        path = frame.f_code.co_filename
        if event == "call" and os.path.basename(os.path.dirname(path)) == "checks" \
                and path.endswith(CHECK_MODULES):
            counted.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        for step in range(2, 4):
            train_step(ddp, opt, step)
    finally:
        sys.setprofile(None)
    watch = {"listen", "late_gradient", "failed_wait"}
    return {"calls": len([c for c in counted if c not in watch]),
            "watch_calls": len([c for c in counted if c in watch]),
            "buckets": len(ddp.buckets), "allreduce_calls": ddp.allreduce_calls}


def test_with_the_checks_off_nothing_runs_on_the_hot_path(ranks):
    """Off, not even the second-backward watch runs (it listens to the reducer's
    ``late_gradient`` event, which a plain step never emits), whatever the number of
    parameters; no collective."""
    for depth in (3, 12):
        for r in ranks(2).run(calls_per_step, None, depth):
            assert r["calls"] == 0, "with the checks off, no check code may run"
            assert r["watch_calls"] == 0, "the watch runs only at a second backward"
            assert r["allreduce_calls"] == r["buckets"], "and no collective is added"
    # the counter can see the checks: on, they run (the control for the assertion above)
    assert all(r["calls"] > 0 for r in ranks(2).run(calls_per_step, 100, 3))


def test_with_the_checks_on_the_work_per_step_does_not_grow_with_the_parameters(ranks):
    small = ranks(2).run(calls_per_step, 100, 3)[0]["calls"]
    large = ranks(2).run(calls_per_step, 100, 12)[0]["calls"]
    assert small == large > 0
    # with fingerprints, the work grows with the buckets (one check each), not the parameters
    detail = ranks(2).run(calls_per_step, 100, 12, detail=True)[0]
    assert detail["calls"] > large


def compare_with_checks_on(detail, **kwargs):
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL" if detail else "INFO"
    os.environ["MINIDDP_CHECK_EVERY"] = "1"
    try:
        return compare_with_torch(**kwargs)["problems"]
    finally:
        os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        os.environ.pop("MINIDDP_CHECK_EVERY", None)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("detail", [False, True])
def test_with_the_checks_on_the_bits_stay_torchs(ranks, world_size, detail):
    for case in (dict(model_name="mlp", bucket_cap_mb=0.001, micro_batches=2),
                 dict(model_name="mlp", bucket_cap_mb=0.00001),  # a bucket per parameter
                 dict(model_name="branchy", find_unused_parameters=True),
                 dict(model_name="conv_bn", gradient_as_bucket_view=True)):
        for problems in ranks(world_size).run(compare_with_checks_on, detail, **case):
            assert problems == [], (case, problems)
    # negative control: the comparison still sees a subtly wrong reducer
    results = ranks(3).run(compare_with_checks_on, detail, sabotage="divide")
    assert any(results)


def module_with_buffers_out_of_step():
    """BatchNorm buffers are broadcast before forward: those broadcasts are checked too."""
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(nn.Sequential(nn.Linear(16, 4), nn.BatchNorm1d(4)))
    ddp.check_every(1, detail=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    odd = dist.get_rank() == 1

    def run():
        for step in range(3):
            x, _ = data(step)
            loss = ddp(x).sum()
            if not (odd and step == 1):
                loss.backward()
            opt.step()

    return caught(run)


def test_debug_mode_checks_buffer_broadcasts_too():
    for kind, message, took in in_short_group(2, module_with_buffers_out_of_step):
        assert kind == "OutOfStep" and took < SHORT_TIMEOUT, message
        assert "the broadcast of buffers" in message


def checks_under_join(detail):
    """Uneven inputs under join with the checks on: ranks run different numbers of steps."""
    ddp = make_ddp(every=1, detail=detail)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    steps = 3 + 2 * dist.get_rank()  # rank 1 trains two steps more
    with ddp.join():
        for step in range(steps):
            train_step(ddp, opt, step)
    for step in range(steps, steps + 2):  # and afterwards, in step again
        train_step(ddp, opt, step)
    return [p.detach().clone() for p in ddp.parameters()]


@pytest.mark.parametrize("detail", [False, True])
def test_the_checks_do_not_mistake_join_for_ranks_out_of_step(ranks, detail):
    first, second = ranks(2).run(checks_under_join, detail, timeout=60)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
