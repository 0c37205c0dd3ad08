"""What miniddp's DDP promises besides equal bits: overlap, no_sync, buffers, names, errors."""

import copy
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_cases import MLP, Branchy, TiedFrozen, first_bucket_as_small_as
from torch import nn

import miniddp
from miniddp.baselines.naive import AllReduceBucketsAfterBackward
from miniddp.checks.bits import all_same_bits
from miniddp.compat.arguments import TORCH_DDP_SIGNATURE, device_ids_of
from miniddp.launch import spawn


def data(step=0, rank=None):
    rank = dist.get_rank() if rank is None else rank
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def gathered(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return parts


# ----- overlap -----

def backward_timeline(overlap=True):
    torch.manual_seed(0)
    cls = miniddp.DistributedDataParallel if overlap else AllReduceBucketsAfterBackward
    with first_bucket_as_small_as(0.01):
        ddp = cls(MLP(64, 6), bucket_cap_mb=0.01)
    for step in range(2):  # the second step runs on the rebuilt buckets
        x, y = data(step)
        ddp.reducer.timeline = []
        F.mse_loss(ddp(x), y).backward()
    events = ddp.reducer.timeline
    kinds = [e[0] for e in events]
    return {"buckets": len(ddp.buckets), "kinds": kinds,
            "first_launch": kinds.index("launch"),
            "last_ready": len(kinds) - 1 - kinds[::-1].index("ready")}


def test_first_bucket_launches_before_backward_ends(ranks):
    for result in ranks(2).run(backward_timeline):
        assert result["buckets"] >= 3
        assert result["first_launch"] < result["last_ready"], (
            "the first all_reduce must start while gradients are still being computed")
        assert result["kinds"].count("launch") == result["buckets"]


def test_without_overlap_nothing_launches_before_backward_ends(ranks):
    """Control for the test above: the instrumented order can tell the two apart."""
    for result in ranks(2).run(backward_timeline, overlap=False):
        assert result["first_launch"] > result["last_ready"]


# ----- synchronization semantics -----

def grads_after(mode):
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(MLP())
    x, y = data()
    if mode == "synced":
        F.mse_loss(ddp(x), y).backward()
    elif mode == "forward_in_no_sync":
        with ddp.no_sync():
            out = ddp(x)
        F.mse_loss(out, y).backward()
    elif mode == "backward_in_no_sync":
        out = ddp(x)
        with ddp.no_sync():
            F.mse_loss(out, y).backward()
    grad = ddp.module[0].weight.grad
    full = MLP()
    full.load_state_dict(ddp.module.state_dict())
    full.zero_grad()
    xs = torch.cat(gathered(x))
    ys = torch.cat(gathered(y))
    F.mse_loss(full(xs), ys).backward()  # the whole global batch in one process
    local = MLP()
    local.load_state_dict(ddp.module.state_dict())
    F.mse_loss(local(x), y).backward()
    return {"same_on_all_ranks": all(torch.equal(g, grad) for g in gathered(grad)),
            "equals_full_batch": torch.allclose(grad, full[0].weight.grad, atol=1e-6),
            "equals_local": torch.equal(grad, local[0].weight.grad)}


def test_synced_gradient_equals_the_full_batch_gradient(ranks):
    for r in ranks(3).run(grads_after, "synced"):
        assert r["same_on_all_ranks"] and r["equals_full_batch"]


def test_no_sync_is_decided_at_forward_time(ranks):
    for r in ranks(2).run(grads_after, "forward_in_no_sync"):
        assert r["equals_local"] and not r["same_on_all_ranks"]
    for r in ranks(2).run(grads_after, "backward_in_no_sync"):
        assert r["same_on_all_ranks"] and r["equals_full_batch"]


def used_only_inside_no_sync():
    """``sometimes`` gets a gradient on rank 0 in a no_sync micro-batch, and on no rank in the
    synced one: it still counts as used, so its gradient is averaged (rank 0's / world size).
    torch >= 2.4 does the same; older torch left it unsynchronized, so the replicas drifted."""
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(Branchy(), find_unused_parameters=True)
    x, y = data(0)
    with ddp.no_sync():
        F.mse_loss(ddp(x, use_branch=dist.get_rank() == 0), y).backward()
    local = ddp.module.sometimes.weight.grad
    local = torch.zeros(16, 16) if local is None else local.clone()
    F.mse_loss(ddp(x, use_branch=False), y).backward()
    grad = ddp.module.sometimes.weight.grad
    return {"grad": grad, "expected": sum(gathered(local)) / dist.get_world_size(),
            "never": ddp.module.never.weight.grad}


def test_a_parameter_used_only_inside_no_sync_is_averaged(ranks):
    results = ranks(2).run(used_only_inside_no_sync)
    for r in results:
        assert r["grad"] is not None, "the synced backward must give it the averaged gradient"
        assert torch.equal(r["grad"], r["expected"])
        assert torch.equal(r["grad"], results[0]["grad"]), "replicas must agree"
        assert r["never"] is None, "a parameter no rank ever used keeps no gradient"
    assert results[0]["grad"].abs().sum() > 0


def buffer_sync():
    """Rank-dependent inputs make the ranks' running stats differ; inputs equal on every rank
    (zeros) then update them equally, so equality afterwards shows whether a broadcast ran."""
    torch.manual_seed(dist.get_rank())
    ddp = miniddp.DistributedDataParallel(nn.Sequential(nn.Linear(16, 4), nn.BatchNorm1d(4)))
    stats = lambda: gathered(ddp.module[1].running_mean.clone())
    x, _ = data()
    zeros = torch.zeros_like(x)
    report = {"after_construction": stats()}
    with ddp.no_sync():
        ddp(x).sum().backward()
    ddp(zeros).sum().backward()  # right after a no_sync forward: no broadcast
    report["after_no_sync"] = stats()
    ddp(zeros).sum().backward()  # the previous forward was synced: broadcast first
    report["after_synced"] = stats()
    with torch.no_grad():
        ddp(x)  # updates each rank's stats its own way
    ddp(zeros).sum().backward()  # right after a no_grad forward: no broadcast
    report["after_no_grad"] = stats()
    ddp(zeros).sum().backward()
    report["after_synced_again"] = stats()
    return report


def test_buffers_follow_rank0_except_right_after_no_sync_or_no_grad(ranks):
    r = ranks(2).run(buffer_sync)[0]
    same = lambda ts: all(torch.equal(t, ts[0]) for t in ts)
    assert same(r["after_construction"])
    assert not same(r["after_no_sync"]), "broadcast right after a no_sync forward"
    assert same(r["after_synced"]), "no broadcast before a forward that follows a synced one"
    assert not same(r["after_no_grad"]), "broadcast right after a no_grad forward"
    assert same(r["after_synced_again"])


def two_forwards_one_backward():
    """A siamese loss through a model whose eval-mode BatchNorm saves its buffers for backward:
    the buffer broadcast before the second forward must not break the first one's backward.

    miniddp is checked against the plain module's gradients averaged by hand, on every torch,
    and against torch's DDP where that works: torch's raises here from 2.1 to 2.11 at least (its
    broadcast bumps the saved buffers' versions), not in 2.13."""
    torch.manual_seed(dist.get_rank())
    module = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).eval()
    x1, x2 = data(0)[0], data(1)[0]
    siamese = lambda m: (m(x1) - m(x2)).pow(2).mean()
    ours = miniddp.DistributedDataParallel(copy.deepcopy(module))
    plain = copy.deepcopy(ours.module)  # rank 0's weights and buffers, as every replica now
    siamese(plain).backward()
    expected = [p.grad for p in plain.parameters()]
    for g in expected:
        dist.all_reduce(g)
        g.div_(dist.get_world_size())
    siamese(ours).backward()
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(module))
    try:
        siamese(theirs).backward()
        torch_grads = [p.grad for p in theirs.parameters()]
    except RuntimeError as e:
        if "inplace" not in str(e):
            raise
        torch_grads = None
    return {"ours": [p.grad for p in ours.parameters()], "expected": expected,
            "torch": torch_grads}


def test_two_forwards_then_one_backward_with_saved_buffers(ranks):
    for r in ranks(2).run(two_forwards_one_backward):
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7)
                   for a, b in zip(r["ours"], r["expected"], strict=True))
        if r["torch"] is not None:
            assert all_same_bits(r["ours"], r["torch"])


def backward_of_a_graph_recorded_before_wrapping():
    """A loss computed before wrapping saves the weight; wrapping then overwrites it with rank
    0's values. Torch's construction counts that as an in-place edit (on rank 0 too), so the
    backward raises instead of using weights the forward never saw; so must miniddp's."""
    out = {}
    for cls in (miniddp.DistributedDataParallel, nn.parallel.DistributedDataParallel):
        torch.manual_seed(dist.get_rank())
        net = nn.Linear(4, 4)
        loss = net(torch.randn(3, 4, requires_grad=True)).pow(2).sum()  # saves the weight
        before = net.weight._version
        cls(net)
        try:
            loss.backward()
            error = None
        except RuntimeError as e:
            error = "modified by an inplace operation" in str(e)
        out[cls.__module__.split(".")[0]] = (net.weight._version > before, error)
    return out


def test_construction_counts_as_an_in_place_edit_as_torchs(ranks):
    for out in ranks(2).run(backward_of_a_graph_recorded_before_wrapping):
        assert out["miniddp"] == out["torch"] == (True, True), out


def names_and_buckets():
    torch.manual_seed(0)
    model = TiedFrozen()
    ddp = miniddp.DistributedDataParallel(model)
    ref = nn.parallel.DistributedDataParallel(TiedFrozen())
    names = [n for info in ddp.buckets for n in info.names]
    return {"keys": list(ddp.state_dict()), "torch_keys": list(ref.state_dict()),
            "module_is_model": ddp.module is model, "bucket_names": names}


def test_state_dict_prefix_and_tied_frozen_buckets(ranks):
    r = ranks(2).run(names_and_buckets)[0]
    assert r["keys"] == r["torch_keys"] and all(k.startswith("module.") for k in r["keys"])
    assert r["module_is_model"]
    # out.weight is embed.weight (tied: reduced once); frozen.weight is frozen (skipped)
    assert sorted(r["bucket_names"]) == ["embed.weight", "frozen.bias", "mix.bias", "mix.weight"]


def gradients_with_a_late_rank():
    """Rank 1 starts its backward 0.3 s after rank 0, whose all_reduces can finish only then:
    the end of rank 0's backward must wait for every one of them."""
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(MLP(32, 3), bucket_cap_mb=0.00001)
    for step in range(2):  # the second backward runs on the rebuilt buckets
        x, y = data(step)
        ddp.zero_grad()
        loss = F.mse_loss(ddp(x), y)
        dist.barrier()
        if dist.get_rank() == 1:
            time.sleep(0.3)
        loss.backward()
        grads = [p.grad.clone() for p in ddp.parameters()]  # as backward left them
    return [torch.stack([g.flatten() for g in gathered(grad)]) for grad in grads]


def test_backward_returns_only_once_every_bucket_is_averaged(ranks):
    for per_rank in ranks(2).run(gradients_with_a_late_rank)[0]:
        assert torch.equal(per_rank[0], per_rank[1]), "ranks left backward with other gradients"


# ----- what becomes of each .grad tensor, with a bucket per parameter -----
# (A reducer that replaced .grad by its bucket's tensor instead of copying into it, tried and
# withdrawn: docs/performance-notes.md, "Changes made to the engine", 9. These pin down what it must
# keep of torch's behaviour.)

def lone_gradient_tensors():
    """One bucket per parameter, all of them small: what becomes of each ``.grad`` tensor."""
    torch.manual_seed(0)
    model = MLP()
    with first_bucket_as_small_as(0.00001):
        ours = miniddp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.00001)
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.00001)

    def step(ddp, n, set_to_none=True):
        ddp.zero_grad(set_to_none=set_to_none)
        x, y = data(n)
        F.mse_loss(ddp(x), y).backward()

    out = {}
    for n in range(2):  # the second backward runs on the rebuilt buckets, one per parameter
        step(ours, n)
        step(theirs, n)

    out["kept"] = {}  # .grad kept from step to step (zeroed in place): written into, as torch's
    for name, ddp in (("ours", ours), ("torch", theirs)):
        step(ddp, 2, set_to_none=False)
        before = [p.grad for p in ddp.parameters()]
        step(ddp, 3, set_to_none=False)
        out["kept"][name] = [p.grad is g for p, g in zip(ddp.parameters(), before)]
    out["kept_bits"] = all_same_bits([p.grad for p in ours.parameters()],
                                     [p.grad for p in theirs.parameters()])

    saved = {"ours": [], "torch": []}  # what a post-accumulate-grad hook keeps: the average
    for name, ddp in (("ours", ours), ("torch", theirs)):
        for p in ddp.parameters():
            p.register_post_accumulate_grad_hook(lambda p, kept=saved[name]: kept.append(p.grad))
        step(ddp, 4)
    out["hook_kept_grad"] = {  # (saved in the order the gradients arrived)
        name: sorted(any(g is p.grad for p in ddp.parameters()) for g in saved[name])
        for name, ddp in (("ours", ours), ("torch", theirs))}
    out["hook_bits"] = all_same_bits(saved["ours"], saved["torch"])
    return out


def test_a_grad_that_existed_before_the_backward_is_written_into_as_torchs(ranks):
    for result in ranks(2).run(lone_gradient_tensors):
        assert all(result["kept"]["torch"]), "control: torch's DDP keeps .grad in place"
        assert all(result["kept"]["ours"]), ".grad was replaced: code holding it sees stale values"
        assert result["kept_bits"]


def test_a_grad_kept_by_a_post_accumulate_grad_hook_gets_the_average_as_torchs(ranks):
    for result in ranks(2).run(lone_gradient_tensors):
        assert result["hook_kept_grad"]["torch"] == [True] * 6, "control"
        assert result["hook_kept_grad"]["ours"] == [True] * 6, (
            "the .grad a hook kept is no longer the parameter's: it holds this rank's gradient")
        assert result["hook_bits"]


def hooks_registered_between_forward_and_backward(what):
    """A comm hook or a post-accumulate-grad hook registered after the forward is honoured in
    the backward that follows, as torch's are (a reducer deciding at the forward would not)."""
    torch.manual_seed(0)
    model = MLP()
    with first_bucket_as_small_as(0.00001):
        ours = miniddp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.00001)
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.00001)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    saved = {"ours": [], "torch": []}
    for name, ddp in (("ours", ours), ("torch", theirs)):
        for n in range(3):  # the third on the rebuilt buckets, one per parameter
            ddp.zero_grad()
            x, y = data(n)
            loss = F.mse_loss(ddp(x), y)
            if n == 2 and what == "comm_hook":
                ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            if n == 2 and what == "post_accumulate_grad_hook":
                for p in ddp.parameters():
                    p.register_post_accumulate_grad_hook(lambda p, k=saved[name]: k.append(p.grad))
            loss.backward()
    return {"bits": all_same_bits([p.grad for p in ours.parameters()],
                                  [p.grad for p in theirs.parameters()]),
            "kept": {name: sorted(any(g is p.grad for p in ddp.parameters()) for g in saved[name])
                     for name, ddp in (("ours", ours), ("torch", theirs))}}


@pytest.mark.parametrize("what", ["comm_hook", "post_accumulate_grad_hook"])
def test_hooks_registered_between_forward_and_backward_are_honoured(ranks, what):
    for result in ranks(2).run(hooks_registered_between_forward_and_backward, what):
        assert result["bits"], f"a {what} registered after the forward: gradients differ"
        if what == "post_accumulate_grad_hook":
            assert result["kept"]["torch"] == [True] * 6, "control"
            assert result["kept"]["ours"] == [True] * 6, "a hook's .grad was replaced after it"


# ----- clear errors, never a hang -----

def construction_error(build, *args, **ddp_kwargs):
    """``"<type>: <message>"`` of the ValueError or RuntimeError wrapping ``build(*args)`` raises
    on this rank, or None."""
    try:
        miniddp.DistributedDataParallel(build(*args), **ddp_kwargs)
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def shape_mismatch():
    width = 5 if dist.get_rank() == 2 else 4
    return nn.Sequential(nn.Linear(3, width), nn.Linear(width, 2))


def test_shape_mismatch_raises_on_every_rank_naming_parameter_shapes_ranks(ranks):
    messages = ranks(3).run(construction_error, shape_mismatch, timeout=30)
    for message in messages:
        assert message is not None, "every rank must raise"
        assert "'0.weight'" in message and "rank 2: 0.weight [5, 3]" in message
        assert "rank 0: 0.weight [4, 3]" in message
    # A RuntimeError, as torch's; and on the rank that differs from rank 0, torch's sentence
    assert all(m.startswith("ModelsDiffer") for m in messages)
    torchs = ("[2]: params[0] in this process with sizes [5, 3] appears not to match sizes of "
              "the same param in process 0")
    assert [torchs in m for m in messages] == [False, False, True], messages[2]


def count_mismatch():
    return nn.Sequential(*[nn.Linear(3, 3) for _ in range(1 + dist.get_rank())])


def test_parameter_count_mismatch_raises_on_every_rank(ranks):
    for message in ranks(2).run(construction_error, count_mismatch, timeout=30):
        assert message and "number of parameters differs" in message and "rank 1: 4" in message
        assert message.startswith("ModelsDiffer")  # a RuntimeError (and ValueError), as torch's


def unused_without_flag(cls=miniddp.DistributedDataParallel):
    torch.manual_seed(0)
    ddp = cls(Branchy())
    x, y = data()
    F.mse_loss(ddp(x, use_branch=False), y).backward()  # 'sometimes' and 'never' get no grad
    try:
        ddp(x, use_branch=False)
    except RuntimeError as e:
        return str(e)
    return None


def test_unused_parameters_without_the_flag_raise_at_next_forward(ranks):
    for message in ranks(2).run(unused_without_flag, timeout=30):
        assert message is not None
        assert "sometimes.weight" in message and "never.bias" in message
        assert "find_unused_parameters=True" in message
        assert "trunk.weight" not in message


def test_unused_parameters_message_opens_as_torchs(ranks):
    """What users search for, and code matches: torch's first two sentences, word for word."""
    ours = ranks(2).run(unused_without_flag, timeout=30)[0]
    theirs = ranks(2).run(unused_without_flag, nn.parallel.DistributedDataParallel,
                          timeout=30)[0]
    opening = theirs[:theirs.index("loss.") + len("loss.")]
    assert opening.startswith("Expected to have finished reduction") and "not used" in opening
    assert ours.startswith(opening), (ours, theirs)


class TrunkAndBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk, self.branch = nn.Linear(8, 4), nn.Linear(4, 4)

    def forward(self, x, use_branch: bool):
        h = self.trunk(x)
        return h + self.branch(h) if use_branch else h


def nothing_unused_warnings(cls, warn_always: bool):
    """What a DDP with ``find_unused_parameters=True`` prints about it on stderr over three
    synchronized steps (two whose outputs reach every parameter, then one that skips the
    branch), with Python warnings made errors: torch's reducer prints from C++, untouched by
    them, and so must miniddp."""
    from course.report import cpp_stderr
    from miniddp import errors as cpp_warnings
    from miniddp.options import unused
    cpp_warnings._printed.discard(unused.NOTHING_UNUSED)  # ranks live on across tests: start afresh
    before = torch.is_warn_always_enabled()
    torch.set_warn_always(warn_always)  # torch's once-per-process warning, every time
    try:
        ddp = cls(TrunkAndBranch(), find_unused_parameters=True)
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        per_step = []
        for use_branch in (True, True, False):
            printed = []
            with warnings.catch_warnings(), cpp_stderr(printed):
                warnings.simplefilter("error")
                F.mse_loss(ddp(x, use_branch=use_branch), y).backward()
            per_step.append([line[line.index("find_unused"):] for line in printed[0].splitlines()
                             if "find_unused_parameters=True was specified" in line])
        return per_step
    finally:
        torch.set_warn_always(before)


def test_find_unused_parameters_with_nothing_unused_warns_as_torch(ranks):
    """Torch's reducer warns when ``find_unused_parameters=True`` finds nothing unused (on
    stderr, from C++): every such step under ``set_warn_always``, never for a step that skips a
    parameter. miniddp prints at the same steps, opening with torch's sentence."""
    ours = ranks(2).run(nothing_unused_warnings, miniddp.DistributedDataParallel, True)[0]
    theirs = ranks(2).run(nothing_unused_warnings, nn.parallel.DistributedDataParallel,
                          True)[0]
    assert [len(step) for step in theirs] == [1, 1, 0], theirs
    assert [len(step) for step in ours] == [1, 1, 0], ours
    opening = theirs[0][0][:theirs[0][0].index("pass.") + len("pass.")]
    assert "did not find any unused parameters" in opening
    assert ours[0][0].startswith(opening), (ours, theirs)


def test_printed_warnings_follow_torchs_cpp_switches(monkeypatch, capsys):
    """``print_warning`` as torch's C++ warnings: once per process where asked, every time under
    ``torch.set_warn_always(True)``, nothing under ``TORCH_CPP_LOG_LEVEL=ERROR``."""
    from miniddp import errors as cpp_warnings
    message = "a warning of this test's own"
    cpp_warnings._printed.discard(message)
    before = torch.is_warn_always_enabled()
    try:
        torch.set_warn_always(False)
        cpp_warnings.print_warning(message, once=True)
        cpp_warnings.print_warning(message, once=True)
        assert capsys.readouterr().err.count(message) == 1
        torch.set_warn_always(True)
        cpp_warnings.print_warning(message, once=True)
        assert capsys.readouterr().err.count(message) == 1
        monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "ERROR")
        cpp_warnings.print_warning(message)
        assert capsys.readouterr().err == ""
    finally:
        torch.set_warn_always(before)


def test_nothing_unused_warning_comes_once_per_process(ranks):
    for per_step in ranks(2).run(nothing_unused_warnings, miniddp.DistributedDataParallel,
                                 False):
        assert [len(step) for step in per_step] == [1, 0, 0], per_step


def stride_mismatch():
    conv = nn.Conv2d(3, 4, 3)
    if dist.get_rank() == 1:
        conv = conv.to(memory_format=torch.channels_last)
    return conv


def test_parameter_strides_must_match_across_ranks(ranks):
    for message in ranks(2).run(construction_error, stride_mismatch, timeout=30):
        assert message and "'weight' differs across ranks" in message
        assert "strides [27, 9, 3, 1]" in message and "strides [27, 1, 9, 3]" in message
    assert "[1]: params[0] in this process with strides [27, 1, 9, 3] appears not to match " \
        "strides of the same param in process 0" in message  # (rank 1's)


def different_parameters_unused():
    """After a step using both branches (buckets rebuilt, one per tensor), rank 0 uses only
    branch a and rank 1 only branch b: one of them launched buckets the other never will."""
    torch.manual_seed(0)

    class Pick(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})

        def forward(self, x, branches):
            return sum(self.layers[name](x) for name in branches)

    ddp = miniddp.DistributedDataParallel(Pick(), bucket_cap_mb=0.00001)
    ddp(torch.randn(2, 4), "ab").sum().backward()
    ddp(torch.randn(2, 4), "a" if dist.get_rank() == 0 else "b").sum().backward()
    start = time.monotonic()
    try:
        ddp(torch.randn(2, 4), "ab")
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return None, 0.0


def test_unfinished_reduction_raises_at_once_on_every_rank():
    # Its own ranks: the half-launched collectives leave this process group unusable after.
    results = spawn(different_parameters_unused, 2, timeout=30, pg_timeout=20)
    assert "layers.b.weight" in results[0][0] and "layers.a.weight" in results[1][0]
    assert all(seconds < 5 for _, seconds in results), "must not wait for the other rank"


def backward_with_create_graph(complete_buckets_at_once=False):
    """``backward(create_graph=True)``: torch's DDP warns and reduces the gradients' values (the
    higher-order graph is not synchronized); miniddp does the same, with the same bits.

    ``complete_buckets_at_once``: the reducer's path on a GPU (forced here), with two parameters
    in one bucket, copied in when it is complete. torch's DDP raises there ("a leaf Variable
    that requires grad is being used in an in-place operation"), so miniddp runs alone and the
    answer is worked out by hand: each gradient scaled once, not twice. The second parameter's
    gradient is a constant (``d(5 q)/dq``), which does not require grad: the bucket holds both
    kinds, one that needs the graph-aware copy and one that the at-once copy takes."""
    import warnings

    class Cubes(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.ps = nn.ParameterList(nn.Parameter(torch.tensor(1.0 + i + dist.get_rank()))
                                       for i in range(n))

        def forward(self):
            return self.ps[0].pow(3) + sum(5 * p for p in self.ps[1:])

    from course.report import cpp_stderr
    grads, printed, python_warnings = {}, {}, []
    classes = [miniddp.DistributedDataParallel]
    if not complete_buckets_at_once:
        classes.append(nn.parallel.DistributedDataParallel)
    for cls in classes:
        name = cls.__module__.split(".")[0]
        module = Cubes(2 if complete_buckets_at_once else 1)
        ddp = cls(module)
        if cls is miniddp.DistributedDataParallel:
            ddp.reducer.copy_buckets_at_end(float("inf") if complete_buckets_at_once else -1)
        printed[name] = []
        for _ in range(2):  # torch's reducer prints its warning at every such backward
            captured = []
            with warnings.catch_warnings(record=True) as caught, cpp_stderr(captured):
                warnings.simplefilter("always")
                ddp().backward(create_graph=True)
            printed[name].append(" ".join(captured[0].split()))  # torch's has a double space
            python_warnings += [str(w.message) for w in caught]
        grads[name] = [p.grad.detach().clone() for p in module.ps]
    return grads, printed, python_warnings


def test_backward_with_create_graph_warns_and_runs_as_torch(ranks):
    """Both DDPs print the warning on stderr at every such backward (torch's from C++), and
    neither gives it as a Python warning (which ``-W error`` would turn into an error)."""
    for grads, printed, python_warnings in ranks(2).run(backward_with_create_graph):
        assert torch.equal(grads["miniddp"][0], grads["torch"][0]), grads
        assert grads["torch"][0].item() == 2 * 3.0  # p is rank 0's 1.0 after the broadcast
        for name in ("torch", "miniddp"):
            assert all("Using DistributedDataParallel with create_graph=True is not "
                       "well-supported" in step for step in printed[name]), printed
        assert not any("DistributedDataParallel" in m for m in python_warnings), python_warnings


def test_backward_with_create_graph_scales_once_when_buckets_are_copied_in_at_once(ranks):
    for grads, printed, _ in ranks(2).run(backward_with_create_graph, True):
        # p is rank 0's 1.0 after the broadcast: two backwards of 3 p^2 and of 5
        assert [g.item() for g in grads["miniddp"]] == [2 * 3.0, 2 * 5.0], grads
        assert all("create_graph=True is not well-supported" in step
                   for step in printed["miniddp"]), printed


def sparse_embedding():
    return nn.Sequential(nn.Embedding(10, 3, sparse=True))


def test_sparse_gradients_are_rejected_clearly(ranks):
    for message in ranks(2).run(construction_error, sparse_embedding):
        assert message and "sparse=False" in message and "0" in message


def mixed_devices():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].to("meta")
    return model


def lazy_module_refusals():
    refusals = {}
    for cls in (miniddp.DistributedDataParallel, nn.parallel.DistributedDataParallel):
        try:
            cls(nn.Sequential(nn.LazyLinear(3), nn.Linear(3, 2)))
        except RuntimeError as error:
            refusals[cls.__module__.split(".")[0]] = str(error)
    return refusals


def test_uninitialized_lazy_layers_are_refused_as_torch(ranks):
    for refusals in ranks(2).run(lazy_module_refusals):
        opening = refusals["torch"]
        assert opening.startswith("Modules with uninitialized parameters"), refusals
        assert refusals["miniddp"].startswith(opening) and "0.weight" in refusals["miniddp"]


def test_parameters_on_mixed_device_types_are_rejected(ranks):
    for message in ranks(2).run(construction_error, mixed_devices):
        assert message and "one kind of device" in message and "meta" in message


def frozen_module():
    return nn.Linear(3, 3).requires_grad_(False)


def test_module_without_trainable_parameters_is_rejected(ranks):
    for message in ranks(2).run(construction_error, frozen_module):
        assert message and "no parameter that requires grad" in message
        # torch's type and words (torch's own test_DistributedDataParallel_requires_grad)
        assert message.startswith("RuntimeError: DistributedDataParallel is not needed when a "
                                  "module doesn't have any parameter that requires a gradient")


def small_linear():
    return nn.Linear(3, 3)


@pytest.mark.parametrize("cap", [-1, -0.5])
def test_negative_bucket_cap_is_rejected(ranks, cap):
    """(0 is accepted, as torch accepts it: tests/engine/test_random_runs_found.py)"""
    for message in ranks(2).run(construction_error, small_linear, bucket_cap_mb=cap):
        assert message and "bucket_cap_mb must be a number of MiB >= 0" in message


def test_without_a_process_group_the_error_says_what_to_do():
    """A ValueError, as torch raises now, and a RuntimeError, as it raised before."""
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group") as raised:
        miniddp.DistributedDataParallel(nn.Linear(3, 3))
    assert isinstance(raised.value, RuntimeError)
    with pytest.raises((ValueError, RuntimeError)):  # torch's (RuntimeError in older ones)
        nn.parallel.DistributedDataParallel(nn.Linear(3, 3))


def hooks_after_drop_and_removal():
    import gc
    import weakref
    torch.manual_seed(0)
    model = MLP()
    first = miniddp.DistributedDataParallel(model)
    x, y = data()
    F.mse_loss(first(x), y).backward()
    old_reducer = weakref.ref(first.reducer)
    del first
    gc.collect()
    model.zero_grad()
    second = miniddp.DistributedDataParallel(model)
    calls = []
    second.reducer._hook = lambda index: calls.append(index)  # count what reaches it
    with second.no_sync():
        F.mse_loss(second(x), y).backward()
    fired = len(calls)
    second.reducer.remove_hooks()
    with second.no_sync():
        F.mse_loss(second(x), y).backward()
    return old_reducer() is None, fired, len(calls)


def test_a_dropped_wrapper_is_collected_and_removed_hooks_stay_removed(ranks):
    for collected, fired, after_removal in ranks(2).run(hooks_after_drop_and_removal):
        assert collected, "the dropped wrapper's reducer must be garbage collected"
        assert fired == 6 and after_removal == 6


class ListOfMine(list):
    def __init__(self, items, tag):  # a constructor a plain rebuild cannot call
        super().__init__(items)
        self.tag = tag


def layout(obj):
    """What an input is made of: container types, and each tensor's device."""
    from torch.nn.utils.rnn import PackedSequence
    if isinstance(obj, PackedSequence):
        return ("PackedSequence", obj.data.device.type, obj.batch_sizes.device.type)
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.device.type)
    if isinstance(obj, dict):
        return (type(obj).__name__, {k: layout(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [layout(x) for x in obj])
    return (type(obj).__name__, obj)


def test_inputs_are_moved_as_torchs_ddp_moves_them():
    """What ``device_ids`` makes DDP do to the inputs (on a GPU): torch's own mover and
    miniddp's give the same layout, here towards the "meta" device. A PackedSequence keeps its
    batch sizes on the CPU (RNNs need them there); containers change type as torch's do."""
    from collections import OrderedDict, namedtuple

    from torch.distributed.utils import _recursive_to
    from torch.nn.utils.rnn import pack_padded_sequence

    from miniddp.ddp import move_to
    pair = namedtuple("pair", "a b")
    packed = pack_padded_sequence(torch.randn(3, 2, 4), torch.tensor([3, 2]))
    inputs = [packed, (packed, 1), torch.ones(2), [torch.ones(1), "x", None],
              {"k": torch.ones(1), "n": [torch.zeros(1)]}, OrderedDict(a=torch.ones(1)),
              pair(torch.ones(1), (torch.ones(1),)), ListOfMine([torch.ones(1)], "t"),
              (), [], ((torch.ones(1), [2]),)]
    meta = torch.device("meta")
    for x in inputs:
        assert layout(move_to(x, meta)) == layout(_recursive_to(x, meta, False)[0]), x


def test_device_arguments_follow_torch():
    """torch's rules, checked without a GPU: ids kept as GPU indices, CPU modules take none."""
    check = device_ids_of
    cpu, gpu = {torch.device("cpu")}, {torch.device("cuda", 1)}
    assert check(None, None, cpu) == (None, None)
    assert check([1], None, gpu) == ([1], 1)
    assert check(["cuda:1"], torch.device("cuda", 1), gpu) == ([1], 1)
    with pytest.raises(ValueError, match="must be None for CPU or multi-device modules"):
        check([0], None, cpu)
    with pytest.raises(ValueError, match="only work for a module on one GPU"):
        check(None, 1, cpu)
    assert check(None, 0, cpu) == check([], 0, cpu) == (None, None)  # torch tests for truth
    with pytest.raises(ValueError, match="device_ids can only be None or contain a single"):
        check([0, 1], None, gpu)
    with pytest.raises(TypeError):  # torch takes len(device_ids) too
        check(0, None, gpu)
    with pytest.raises(ValueError, match="one kind of device"):
        check(None, None, cpu | gpu)
    # on a GPU module, as torch's helper reads them: a CPU output_device refused
    with pytest.raises(ValueError, match="cpu"):
        check([1], "cpu", gpu)
    with pytest.raises(ValueError, match="cpu"):
        check([1], torch.device("cpu"), gpu)
    assert check([1], 0.0, gpu) == ([1], None)


def cpu_device_arguments() -> dict:
    """What each DDP makes of device arguments on a CPU module: accepted, or the error."""
    found = {}
    for kind, cls in (("miniddp", miniddp.DistributedDataParallel),
                      ("torch", nn.parallel.DistributedDataParallel)):
        for name, kwargs in (("output_device=0", {"output_device": 0}),
                             ("output_device=1", {"output_device": 1}),
                             ("device_ids=[0, 1]", {"device_ids": [0, 1]}),
                             ("device_ids=0", {"device_ids": 0})):
            try:
                ddp = cls(nn.Linear(3, 3), **kwargs)
                found[kind, name] = ("accepted", ddp.device_ids, ddp.output_device)
            except (TypeError, ValueError) as error:
                found[kind, name] = (type(error).__name__,)
    return found


def test_device_arguments_on_a_cpu_module_as_torch(ranks):
    found = ranks(2).run(cpu_device_arguments)[0]
    for name in ("output_device=0", "output_device=1", "device_ids=[0, 1]", "device_ids=0"):
        assert found["miniddp", name] == found["torch", name], name
    assert found["miniddp", "output_device=0"] == ("accepted", None, None)


def positional_like_torch():
    import inspect
    ours = list(inspect.signature(miniddp.DistributedDataParallel).parameters)
    theirs = list(inspect.signature(nn.parallel.DistributedDataParallel).parameters)
    return ours, theirs


def test_arguments_are_torchs_in_torchs_order(ranks):
    """The installed torch's signature, names and order (miniddp.compat.arguments), on every
    release."""
    ours, theirs = ranks(2).run(positional_like_torch)[0]
    assert ours == theirs


def construction_sync(init_sync):
    torch.manual_seed(dist.get_rank())  # every rank starts from different weights
    ddp = miniddp.DistributedDataParallel(MLP(), init_sync=init_sync)
    weight = ddp.module[0].weight.detach()
    return all(torch.equal(w, weight) for w in gathered(weight))


@pytest.mark.skipif("init_sync" not in TORCH_DDP_SIGNATURE.parameters,
                    reason="this torch has no init_sync argument")
def test_construction_broadcasts_unless_init_sync_is_false(ranks):
    assert ranks(2).run(construction_sync, True) == [True, True]
    assert ranks(2).run(construction_sync, False) == [False, False]


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x, which):
        return self.a(x) if which == "a" else self.b(x)


def two_branch_forwards_one_backward() -> list[str]:
    """Two synchronized forwards through different branches, one backward of both outputs
    (find_unused_parameters: the first forward marks b unused, then b's gradient arrives)."""
    ddp = miniddp.DistributedDataParallel(TwoBranches(), find_unused_parameters=True)
    errors = []
    for step in range(2):
        x, y = data(step)
        try:
            F.mse_loss(ddp(x[:, :4], "a") + ddp(x[:, :4], "b"), y[:, :2]).backward()
        except RuntimeError as error:
            errors.append(str(error))
    return errors


def test_after_a_backward_that_raised_the_next_forward_says_so(ranks):
    """It said "got no gradient ... for these parameters: ." with an empty list."""
    for errors in ranks(2).run(two_branch_forwards_one_backward):
        assert len(errors) == 2 and "marked as ready twice" in errors[0], errors
        assert "the last synchronized backward raised an error before its gradients were " \
               "averaged" in errors[1], errors[1]
        assert "Expected to have finished reduction in the prior iteration" in errors[1]
