"""torch's full constructor on miniddp: each argument works as torch's, or is refused by name.

Also two things real training code relies on: parameters and buffers torch is told to ignore,
and a parameter unused in a step after a step with two backward passes.
Each equivalence test compares with torch's DDP bit for bit after every step
(``ddp_cases.compare_with_torch``), at 2 and 3 ranks.
"""

import inspect
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_cases import compare_with_torch
from torch import nn

import miniddp
from miniddp.checks.bits import same_bits
from miniddp.compat import arguments
from miniddp.reducer import Reducer

HAS = arguments.TORCH_DDP_SIGNATURE.parameters  # the installed torch's arguments


def needs(name):
    return pytest.mark.skipif(name not in HAS, reason=f"this torch has no {name} argument")


def assert_same_as_torch(results):
    for rank, result in enumerate(results):
        assert result["problems"] == [], f"rank {rank}: {result['problems']}"


# ----- the signature -----

def test_signature_is_the_installed_torchs():
    ours = inspect.signature(miniddp.DistributedDataParallel)
    theirs = inspect.signature(nn.parallel.DistributedDataParallel)
    assert list(ours.parameters) == list(theirs.parameters)
    assert [p.default for p in ours.parameters.values()] == [
        p.default for p in theirs.parameters.values()]


def test_another_releases_signature_is_followed_too():
    """The binding on an older torch, played with torch 2.1's signature: no init_sync, and
    broadcast_buffers=True and bucket_cap_mb=25 by default; and a future torch's argument."""
    def torch_2_1(self, module, device_ids=None, output_device=None, dim=0,
                  broadcast_buffers=True, process_group=None, bucket_cap_mb=25,
                  find_unused_parameters=False, check_reduction=False,
                  gradient_as_bucket_view=False, static_graph=False,
                  delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                  mixed_precision=None, device_mesh=None, from_the_future=False):
        pass

    received = {}

    def init(self, module, broadcast_buffers=None, init_sync=True, process_group=None,
             bucket_cap_mb=None, **others):
        received.update(broadcast_buffers=broadcast_buffers, process_group=process_group,
                        bucket_cap_mb=bucket_cap_mb, init_sync=init_sync)

    bound = arguments.takes_torchs_arguments(init, inspect.signature(torch_2_1))
    bound(None, "module", None, None, 0, False, "group")
    assert received == dict(broadcast_buffers=False, process_group="group", bucket_cap_mb=25,
                            init_sync=True)
    with pytest.raises(TypeError, match="init_sync"):
        bound(None, "module", init_sync=False)
    with pytest.raises(NotImplementedError, match="from_the_future"):
        bound(None, "module", from_the_future=True)
    bound(None, "module", from_the_future=False)  # left at its default: harmless


def positional_cap():
    position = list(HAS).index("bucket_cap_mb") - 1  # without self
    args = [p.default for p in list(HAS.values())[2:position + 1]]
    ddp = miniddp.DistributedDataParallel(nn.Linear(4, 4), *args, 0.5)
    try:
        miniddp.DistributedDataParallel(nn.Linear(4, 4), not_an_argument=1)
    except TypeError as e:
        return ddp.bucket_bytes_cap, str(e)


def test_positional_arguments_land_where_torch_puts_them(ranks):
    for cap, message in ranks(2).run(positional_cap):
        assert cap == 512 * 1024
        assert "not_an_argument" in message


def refusal(**kwargs):
    try:
        miniddp.DistributedDataParallel(nn.Linear(2, 2), **kwargs)
    except NotImplementedError as e:
        return str(e)


@pytest.mark.parametrize("name, value", [
    ("mixed_precision", "a _MixedPrecision"),
    ("delay_all_reduce_named_params", []),
    ("param_to_hook_all_reduce", "a parameter"),
])
def test_unimplemented_arguments_are_refused_by_name(ranks, name, value):
    if name not in HAS:
        pytest.skip(f"this torch has no {name} argument")
    for message in ranks(2).run(refusal, **{name: value}):
        assert message and name in message and "Leave" in message


def check_reduction_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        miniddp.DistributedDataParallel(nn.Linear(2, 2), check_reduction=True)
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


def test_check_reduction_warns_as_torch(ranks):
    for messages in ranks(2).run(check_reduction_warning):
        assert any("check_reduction" in m for m in messages)



def warnings_of_both(kwargs, set_static_graph_again):
    """The warnings torch's DDP and miniddp's give for the same construction."""
    out = []
    for cls in (nn.parallel.DistributedDataParallel, miniddp.DistributedDataParallel):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = cls(nn.Linear(2, 2), **kwargs)
            if set_static_graph_again:
                ddp._set_static_graph()
        out.append([str(w.message) for w in caught])
    return out


@pytest.mark.parametrize("kwargs, again", [
    ({"check_reduction": True}, False),
    ({"broadcast_buffers": False}, False),
    ({"broadcast_buffers": False, "forward_sync_buffers": True}, False),
    ({"static_graph": True}, True),
    ({"static_graph": True, "find_unused_parameters": True}, False),
], ids=["check_reduction", "broadcast_buffers", "both_buffer_flags", "static_graph_twice",
        "find_unused_with_static_graph"])
def test_warnings_carry_torchs_opening_words(ranks, kwargs, again):
    """Code that filters torch's warnings by their text filters miniddp's too: warning filters
    match a message from its start, so miniddp's begin with torch's opening words."""
    if any(name not in HAS for name in kwargs):
        pytest.skip("this torch lacks one of the arguments")
    if "broadcast_buffers" in kwargs and not arguments.BROADCAST_BUFFERS_DEPRECATED:
        pytest.skip("torch before 2.13 does not deprecate broadcast_buffers")
    theirs, ours = ranks(2).run(warnings_of_both, kwargs, again)[0]
    assert theirs, "torch gives no warning here: the case tests nothing"
    for message in theirs:
        assert any(mine.startswith(message[:50]) for mine in ours), (message, ours)


# ----- buffers: forward_sync_buffers and the deprecated broadcast_buffers -----

class Stats(nn.Module):
    """BatchNorm whose running stats start different on every rank."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
        with torch.no_grad():
            self.body[1].running_mean.fill_(float(dist.get_rank()))

    def forward(self, x):
        return self.body(x)


def buffers_case(**kwargs):
    """Train both DDPs; return torch-equality problems, and whether the running stats are
    equal across ranks after construction and after training."""
    torch.manual_seed(dist.get_rank())
    model = Stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ours = miniddp.DistributedDataParallel(_copy(model), **kwargs)
        theirs = nn.parallel.DistributedDataParallel(_copy(model), **kwargs)
    same = [_equal_everywhere(ours.module.body[1].running_mean)]
    problems = []
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        for ddp, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            opt.step()
        for (name, a), b in zip(_state(ours), [t for _, t in _state(theirs)]):
            if not same_bits(a, b):
                problems.append(f"step {step} {name}")
    for ddp in (ours, theirs):  # an eval forward broadcasts (or not) and changes no stats
        ddp.eval()
        ddp(x)
    for (name, a), b in zip(_state(ours), [t for _, t in _state(theirs)]):
        if not same_bits(a, b):
            problems.append(f"after the eval forward {name}")
    same.append(_equal_everywhere(ours.module.body[1].running_mean))
    return problems, same


def _copy(module):
    import copy
    return copy.deepcopy(module)


def _state(ddp):
    return list(ddp.module.named_parameters()) + list(ddp.module.named_buffers())


def _equal_everywhere(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return all(torch.equal(p, t) for p in parts)


@needs("forward_sync_buffers")
@pytest.mark.parametrize("world_size", [2, 3])
def test_forward_sync_buffers_false_syncs_at_construction_only(ranks, world_size):
    for problems, same in ranks(world_size).run(buffers_case, forward_sync_buffers=False):
        assert problems == []
        assert same == [True, False], "broadcast at construction, then each rank its own"


@pytest.mark.parametrize("world_size", [2, 3])
def test_broadcast_buffers_false_never_syncs_buffers(ranks, world_size):
    for problems, same in ranks(world_size).run(buffers_case, broadcast_buffers=False):
        assert problems == []
        assert same == [False, False]


def test_buffers_follow_rank0_by_default(ranks):
    for problems, same in ranks(2).run(buffers_case):
        assert problems == [] and same == [True, True]


def broadcast_buffers_warning(**kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = miniddp.DistributedDataParallel(nn.Linear(2, 2), **kwargs)
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    return messages, ddp.broadcast_buffers, ddp.forward_sync_buffers


@needs("forward_sync_buffers")
def test_broadcast_buffers_is_deprecated_as_in_torch(ranks):
    messages, alias, flag = ranks(2).run(broadcast_buffers_warning, broadcast_buffers=False)[0]
    assert any("forward_sync_buffers" in m for m in messages) and alias is flag is False
    messages, _, flag = ranks(2).run(broadcast_buffers_warning, forward_sync_buffers=False)[0]
    assert messages == [] and flag is False


# ----- gradients copied in bucket by bucket: batched_grad_copy -----

@needs("batched_grad_copy")
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("as_view", [False, True])
def test_batched_grad_copy_matches_torch(ranks, world_size, as_view):
    results = ranks(world_size).run(compare_with_torch, "mlp", steps=3, bucket_cap_mb=0.002,
                                    batched_grad_copy=True, gradient_as_bucket_view=as_view)
    assert_same_as_torch(results)


@needs("batched_grad_copy")
def test_batched_grad_copy_with_unused_parameters_and_no_sync_matches_torch(ranks):
    """Zeroed slots, stale gradients (set_to_none=False) and accumulation, at 3 ranks."""
    results = ranks(3).run(compare_with_torch, "branchy", steps=3, micro_batches=2,
                           set_to_none=False, find_unused_parameters=True,
                           batched_grad_copy=True)
    assert_same_as_torch(results)


def batched_with_reciprocal():
    """A subtly wrong batched copy: it multiplies the complete bucket by the reciprocal, as the
    default path does, instead of dividing it."""
    original = Reducer._scale_bucket
    Reducer._scale_bucket = lambda self, buffer: self._scale(buffer, buffer)
    try:
        return compare_with_torch("mlp", steps=2, bucket_cap_mb=0.002, batched_grad_copy=True)
    finally:
        Reducer._scale_bucket = original


@needs("batched_grad_copy")
def test_batched_grad_copy_comparison_catches_the_default_scaling(ranks):
    """Negative control: at 3 ranks, multiplying by 1/3 instead of dividing by 3 shows."""
    results = ranks(3).run(batched_with_reciprocal)
    assert any(r["problems"] for r in results)


# ----- bucket_cap_mb_list -----

@needs("bucket_cap_mb_list")
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("find_unused", [False, True])
def test_bucket_cap_mb_list_gives_torchs_buckets_and_bits(ranks, world_size, find_unused):
    model = "branchy" if find_unused else "mlp"
    results = ranks(world_size).run(compare_with_torch, model, steps=3,
                                    bucket_cap_mb_list=[0.0005, 0.002, 0.001],
                                    find_unused_parameters=find_unused)
    assert_same_as_torch(results)
    layouts = results[0]["layouts"]
    assert len(layouts[-1]) >= 3, "the list must make several buckets"


def test_bad_bucket_cap_list_is_refused(ranks):
    from test_ddp_behaviour import construction_error, small_linear
    if "bucket_cap_mb_list" not in HAS:
        pytest.skip("this torch has no bucket_cap_mb_list argument")
    # 0 is accepted, as torch accepts it (tests/engine/test_random_runs_found.py); a negative is not
    for message in ranks(2).run(construction_error, small_linear, bucket_cap_mb_list=[1, -1]):
        assert message and "bucket_cap_mb_list" in message


# ----- skip_all_reduce_unused_params -----

class NeverUsed(nn.Module):
    """``never`` takes no part on any rank in any step: torch's condition for skipping."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.trunk(x)))


def skipped_buckets(skip):
    from ddp_cases import MODELS
    MODELS["never_used"] = NeverUsed
    result = compare_with_torch("never_used", steps=3, bucket_cap_mb=0.00001,
                                find_unused_parameters=True, skip_all_reduce_unused_params=skip)
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(NeverUsed(), bucket_cap_mb=0.00001,
                                          find_unused_parameters=True,
                                          skip_all_reduce_unused_params=skip)
    F.mse_loss(ddp(torch.randn(4, 16)), torch.randn(4, 4)).backward()
    never = {i for i, (name, _) in enumerate(ddp.module.named_parameters()) if "never" in name}
    unused_only = sum(set(b.param_indices) <= never for b in ddp.buckets)
    return result["problems"], len(ddp.buckets), unused_only, ddp.allreduce_calls


@needs("skip_all_reduce_unused_params")
@pytest.mark.parametrize("world_size", [2, 3])
def test_skip_all_reduce_unused_params_skips_unused_buckets_only(ranks, world_size):
    for problems, buckets, unused_only, calls in ranks(world_size).run(skipped_buckets, True):
        assert problems == []
        assert unused_only >= 1 and calls == buckets - unused_only


@needs("skip_all_reduce_unused_params")
def test_without_skip_every_bucket_is_reduced(ranks):
    """Control for the test above: the count tells skipping from not skipping."""
    for problems, buckets, unused_only, calls in ranks(2).run(skipped_buckets, False):
        assert problems == [] and unused_only >= 1 and calls == buckets


# ----- device_mesh -----

def with_device_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    result = compare_with_torch("mlp", steps=2, bucket_cap_mb=0.002, device_mesh=mesh)
    ddp = miniddp.DistributedDataParallel(nn.Linear(2, 2), device_mesh=mesh)
    assert ddp.process_group is mesh.get_group(mesh_dim=0)
    try:
        miniddp.DistributedDataParallel(nn.Linear(2, 2), process_group=dist.group.WORLD,
                                        device_mesh=mesh)
    except RuntimeError as e:
        return result["problems"], str(e)


@needs("device_mesh")
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_one_dimensional_device_mesh_gives_its_group(ranks, world_size):
    for problems, message in ranks(world_size).run(with_device_mesh):
        assert problems == []
        assert "not both" in message


# ----- parameters and buffers torch is told to ignore -----

class WithIgnored(nn.Module):
    """A trunk DDP manages, and a ``local`` layer plus a buffer each rank keeps to itself."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.local = nn.Linear(16, 16)  # last, so both DDPs number the others alike
        self.register_buffer("count", torch.zeros(1))
        self.side = nn.Module()
        self.side.register_buffer("seen", torch.full((2,), float(dist.get_rank())))

    def forward(self, x):
        self.count += 1
        return self.head(torch.relu(self.trunk(x)) + self.local(x))


IGNORED = ["local.weight", "local.bias", "side.seen"]


def ignored_case():
    from ddp_cases import MODELS
    MODELS["with_ignored"] = WithIgnored
    original = WithIgnored.__init__

    def init_and_ignore(self):
        original(self)
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            self, IGNORED)
    WithIgnored.__init__ = init_and_ignore
    try:
        result = compare_with_torch("with_ignored", steps=3, bucket_cap_mb=0.002)
        torch.manual_seed(dist.get_rank())
        ddp = miniddp.DistributedDataParallel(WithIgnored())
    finally:
        WithIgnored.__init__ = original
    F.mse_loss(ddp(torch.randn(4, 16)), torch.randn(4, 4)).backward()
    m = ddp.module
    return (result["problems"], [name for info in ddp.buckets for name in info.names],
            _equal_everywhere(m.local.weight), _equal_everywhere(m.local.weight.grad),
            _equal_everywhere(m.side.seen), _equal_everywhere(m.trunk.weight.grad))


@pytest.mark.parametrize("world_size", [2, 3])
def test_ignored_parameters_and_buffers_are_left_alone_as_in_torch(ranks, world_size):
    for problems, reduced, weight, grad, buffer, trunk in ranks(world_size).run(ignored_case):
        assert problems == []
        assert not any(name.startswith("local") for name in reduced)
        assert (weight, grad, buffer) == (False, False, False), "ignored: not synchronized"
        assert trunk, "the rest is averaged"


def root_parameter_ignored():
    torch.manual_seed(dist.get_rank())
    model = nn.Linear(4, 2)
    miniddp.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["weight"])
    ddp = miniddp.DistributedDataParallel(model)
    x = torch.randn(3, 4) * (dist.get_rank() + 1)
    F.mse_loss(ddp(x), torch.zeros(3, 2)).backward()
    return (_equal_everywhere(model.weight.detach()), _equal_everywhere(model.weight.grad),
            _equal_everywhere(model.bias.grad))


def test_an_ignored_parameter_of_the_wrapped_module_itself_is_left_alone(ranks):
    """torch 2.13 does not broadcast it but still averages it (its reducer spells the name
    ".weight"); miniddp leaves it alone, as it does any other ignored parameter."""
    for weight, grad, bias_grad in ranks(2).run(root_parameter_ignored):
        assert (weight, grad, bias_grad) == (False, False, True)


# ----- the stale "used" flag after a second backward -----

class Sometimes(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.maybe = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x, use_maybe):
        h = torch.relu(self.trunk(x))
        return self.head(h + self.maybe(h) if use_maybe else h)


def after_two_backwards():
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(Sometimes(), find_unused_parameters=True)
    x, y = torch.randn(4, 16), torch.randn(4, 4)
    loss = F.mse_loss(ddp(x, True), y)
    loss.backward(retain_graph=True)
    loss.backward()  # after this forward's reduction: its hooks must not count as use
    ddp.zero_grad(set_to_none=True)
    F.mse_loss(ddp(x, False), y).backward()  # maybe: unused on every rank
    return ddp.module.maybe.weight.grad


def test_a_second_backward_leaves_no_stale_used_flag(ranks):
    """torch fails here with an internal assertion; miniddp keeps the unused .grad None."""
    assert ranks(2).run(after_two_backwards) == [None, None]


class LateBuffers(nn.Module):
    """A module whose buffers change after wrapping: ``late`` is None at construction and set
    in the first forward; ``extra`` (with ``with_buffer``) is registered in the first forward."""

    def __init__(self, with_buffer: bool):
        super().__init__()
        self.body = nn.Linear(4, 2)
        self.register_buffer("late", None)
        if with_buffer:
            self.register_buffer("existing", torch.zeros(2))

    def forward(self, x):
        if self.late is None:  # each rank its own value
            self.late = torch.full((2,), float(dist.get_rank()))
            if hasattr(self, "existing"):
                self.register_buffer("extra", torch.full((2,), float(dist.get_rank())))
        return self.body(x)


def late_buffers(with_buffer: bool):
    """The buffers after two forwards, gathered from every rank, for both DDPs."""
    found = {}
    for kind, cls in (("miniddp", miniddp.DistributedDataParallel),
                      ("torch", nn.parallel.DistributedDataParallel)):
        torch.manual_seed(0)
        ddp = cls(LateBuffers(with_buffer))
        for _ in range(2):
            ddp(torch.ones(3, 4)).sum().backward()
        found[kind] = {name: [p.tolist() for p in gathered_tensor(b)]
                       for name, b in ddp.module.named_buffers()}
    return found


def gathered_tensor(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return parts


@pytest.mark.parametrize("with_buffer", [False, True])
def test_buffers_that_appear_after_wrapping_are_synced_as_torch_syncs_them(ranks, with_buffer):
    """torch reads the buffers anew at each sync, but syncs none if there were none at
    construction: with another buffer there, the new ones follow rank 0; without, each rank
    keeps its own."""
    for found in ranks(2).run(late_buffers, with_buffer):
        assert found["miniddp"] == found["torch"]
        late = found["miniddp"]["late"]
        assert (late[0] == late[1]) is with_buffer, late


def buffers_around_join_and_hooks() -> dict:
    """For both DDPs: the late buffer after ``join()``'s final sync; how often a buffer comm
    hook runs, and with what, on modules without buffers at construction; the buffer lists
    torch keeps as attributes."""
    location = nn.parallel.distributed._BufferCommHookLocation
    found = {}
    for kind, cls in (("miniddp", miniddp.DistributedDataParallel),
                      ("torch", nn.parallel.DistributedDataParallel)):
        torch.manual_seed(0)
        ddp = cls(LateBuffers(with_buffer=False))
        with ddp.join():
            ddp(torch.ones(3, 4)).sum().backward()
        found[kind, "after join"] = [p.tolist() for p in gathered_tensor(ddp.module.late)]
        found[kind, "kept"] = (len(ddp.modules_buffers), sorted(ddp.named_module_buffers))
        for where in (location.PRE_FORWARD, location.POST_FORWARD):
            for module in (nn.Linear(4, 2), LateBuffers(False), LateBuffers(True)):
                calls = []
                ddp = cls(module)
                ddp._register_buffer_comm_hook(
                    None, lambda _state, buffers, calls=calls: calls.append(sorted(buffers)),
                    where)
                for _ in range(2):
                    ddp(torch.ones(3, 4)).sum().backward()
                found[kind, str(where), type(module).__name__, len(calls)] = calls
    return found


def test_join_and_buffer_hooks_see_the_buffers_torch_sees(ranks):
    """join's final sync reads the buffers anew (the late one follows the last joiner); a
    buffer hook runs only where torch's would (never without buffers at construction), with
    the buffers read anew; the kept lists are those of the last sync."""
    found = ranks(2).run(buffers_around_join_and_hooks)[0]
    ours = {k[1:]: v for k, v in found.items() if k[0] == "miniddp"}
    theirs = {k[1:]: v for k, v in found.items() if k[0] == "torch"}
    assert ours == theirs
    assert ours["after join",] == [[1.0, 1.0], [1.0, 1.0]]


def scripted(how: str):
    """A TorchScript module trained two steps by each DDP: the parameters' bits."""
    results = []
    for cls in (miniddp.DistributedDataParallel, nn.parallel.DistributedDataParallel):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        model = (torch.jit.script(model) if how == "script"
                 else torch.jit.trace(model, torch.randn(3, 4)))
        ddp = cls(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(2):
            g = torch.Generator().manual_seed(10 * step + dist.get_rank())
            opt.zero_grad()
            F.mse_loss(ddp(torch.randn(6, 4, generator=g)), torch.randn(6, 2, generator=g)
                       ).backward()
            opt.step()
        results.append([t.detach().clone() for t in [*model.parameters(), *model.buffers()]])
    return all(same_bits(a, b) for a, b in zip(*results)), len(results[0])


@pytest.mark.parametrize("how", ["script", "trace"])
def test_a_torchscript_module_trains_as_under_torchs_ddp(ranks, how):
    for same, count in ranks(2).run(scripted, how):
        assert same and count == 9  # 6 parameters, 3 BatchNorm buffers


def public_attributes() -> dict:
    """torch's public DDP attributes, read from both DDPs around the forwards that change them."""
    found = {}
    for kind, cls in (("miniddp", miniddp.DistributedDataParallel),
                      ("torch", nn.parallel.DistributedDataParallel)):
        for with_buffers in (False, True):
            torch.manual_seed(0)
            module = nn.Sequential(nn.Linear(4, 4), *([nn.BatchNorm1d(4)] if with_buffers else []))
            ddp = cls(module)
            seen = [ddp.device_type, ddp.is_multi_device_module, ddp.mixed_precision,
                    ddp.will_sync_module_buffers()]
            with ddp.no_sync():
                ddp(torch.ones(3, 4)).sum().backward()
            seen.append(ddp.will_sync_module_buffers())  # not right after a no_sync forward
            ddp(torch.ones(3, 4)).sum().backward()
            seen.append(ddp.will_sync_module_buffers())
            found[kind, with_buffers] = seen
    return found


def test_torchs_public_attributes_mean_what_they_mean_in_torch(ranks):
    found = ranks(2).run(public_attributes)[0]
    for with_buffers in (False, True):
        assert found["miniddp", with_buffers] == found["torch", with_buffers], with_buffers
    assert found["miniddp", True] == ["cpu", False, None, True, False, True]


def multi_device_with_an_ignored_parameter() -> bool:
    module = nn.Sequential(nn.Linear(4, 2))
    module.register_parameter("far", nn.Parameter(torch.zeros(2, device="meta")))
    miniddp.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ["far"])
    return miniddp.DistributedDataParallel(module).is_multi_device_module


def test_is_multi_device_module_leaves_ignored_parameters_out_as_torchs(ranks):
    """torch counts the devices of the parameters it manages (torch's own DDP cannot be built
    here: it refuses the meta parameter in its check of shapes across ranks)."""
    assert ranks(2).run(multi_device_with_an_ignored_parameter) == [False, False]
