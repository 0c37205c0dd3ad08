"""torch's ``FSDPModule`` methods and ``register_fsdp_forward_method`` on miniddp's units,
beside torch's own on gloo: the same calls made on both models, then the bits compared.

Every public method of torch's class (enumerated from the installed torch) is miniddp's own, and
miniddp's units are instances of torch's class. Those that change the reduction (divide factor,
force-sum, unused parameters, all-reduce hook), recovery (``reset_iter_state``), micro-batches
(``set_is_last_backward``) and prefetching train bit for bit as torch's at 2 and 3 ranks; the one
that gloo cannot run (a divide factor that needs ``PREMUL_SUM``) is refused as torch's is.
Explicit prefetching moves the gathers, read from both profilers' traces: the same order as
torch's, and another order than without it.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
import torch.distributed as dist
from test_fsdp import (
    Case,
    Net,
    TorchPolicy,
    count_differences,
    device_mesh,
    make_optimizer,
    needs_torch_fsdp2,
    shard_model,
    torch_fully_shard,
)
from torch import nn
from torch.profiler import ProfilerActivity, profile

import miniddp

pytestmark = needs_torch_fsdp2


def _prefetch(model):
    model.set_modules_to_forward_prefetch([model.blocks[0]])
    model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1], model.blocks[2]])
    model.blocks[2].set_modules_to_backward_prefetch([model.blocks[1], model.blocks[0]])


class CountingAllGather:
    """torch's ``AllGather`` protocol: ``allocate`` the buffer, then the collective."""

    def __init__(self):
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                           async_op=async_op)


class CountingReduceScatter(CountingAllGather):
    """torch's ``ReduceScatter`` protocol, with the op FSDP passes (AVG for fp32)."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                          async_op=async_op)


def _custom_comms(model):
    model.comms = CountingAllGather(), CountingReduceScatter()
    for module in [*model.blocks, model]:
        module.set_custom_all_gather(model.comms[0])
        module.set_custom_reduce_scatter(model.comms[1])


def _each_unit(name, *args):
    def call(model):
        for module in [*model.blocks, model]:
            getattr(module, name)(*args)
    return call


#: What is done to both models after sharding, by name (the cases travel by pickle).
SETUPS = {
    "none": lambda model: None,
    "prefetch": _prefetch,
    "force_sum_factor_5": lambda m: (_each_unit("set_force_sum_reduction_for_comms", True)(m),
                                     _each_unit("set_gradient_divide_factor", 5.0)(m)),
    "factor_shard_size": lambda m: _each_unit("set_gradient_divide_factor",
                                              float(dist.get_world_size()))(m),
    "force_sum": _each_unit("set_force_sum_reduction_for_comms", True),
    "unused_params": lambda m: m.set_reduce_scatter_unused_params(True),
    "all_reduce_hook": _each_unit("set_all_reduce_hook", lambda row: row.mul_(2.0)),
    "no_unshard_in_backward": lambda m: m.blocks[0].set_unshard_in_backward(False),
    "not_last_backward": lambda m: m.set_is_last_backward(False),
    "reset_iter_state": lambda m: None,  # (the step is aborted below)
    "custom_comms": _custom_comms,
}


class Interrupted(Exception):
    pass


def _steps(setup: str, steps: int = 2, hsdp: bool = False) -> list[str]:
    torch.manual_seed(0)
    models = []
    for shard, policy in ((miniddp.fully_shard, miniddp.MixedPrecisionPolicy()),
                          (torch_fully_shard, TorchPolicy())):
        torch.manual_seed(0)
        model = Net()
        model.unused = nn.Linear(3, 3)  # in the root unit, never called
        mesh = ({"mesh": device_mesh("cpu", (2, 2))} if hsdp else
                {} if shard is miniddp.fully_shard else {"mesh": device_mesh("cpu")})
        models.append(shard_model(model, shard, policy, Case(), **mesh))
        SETUPS[setup](model)
    ours, theirs = models
    optimizers = [make_optimizer(m, "sgd") for m in models]
    problems: list[str] = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x = torch.randn(8, 12, generator=gen)
        for model in models:
            if setup == "reset_iter_state" and step == 1:  # an exception mid-backward
                loss = model(x).sum()
                loss.register_hook(lambda g: (_ for _ in ()).throw(Interrupted()))
                with pytest.raises(Interrupted):
                    loss.backward()
                model.reset_iter_state()
            model(x).pow(2).mean().backward()
        count_differences(f"step {step} grad", [(n, p.grad) for n, p in ours.named_parameters()],
                          [(n, p.grad) for n, p in theirs.named_parameters()], problems)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        count_differences(f"step {step} param", list(ours.named_parameters()),
                          list(theirs.named_parameters()), problems)
    if setup == "custom_comms":
        calls = [[c.calls for c in m.comms] for m in models]
        if calls[0] != calls[1] or 0 in calls[0]:
            problems.append(f"the custom collectives' calls, ours and torch's: {calls}")
    return problems


def _each(setups, hsdp: bool = False):
    torch.set_num_threads(1)
    return {s: _steps(s, hsdp=hsdp) for s in setups}


@pytest.mark.parametrize("world_size", [2, 3])
def test_methods_that_change_the_step_train_bit_for_bit_as_torchs(ranks, world_size):
    setups = list(SETUPS)
    for rank, by_setup in enumerate(ranks(world_size).run(_each, setups, timeout=180)):
        failing = {s: p[:3] for s, p in by_setup.items() if p}
        assert not failing, f"rank {rank}: {failing}"


def test_under_hsdp_the_reduction_settings_train_bit_for_bit_as_torchs(ranks):
    """On a 2 x 2 mesh: with a divide factor, force-sum sums across both groups and divides
    once after; the hook sees the row after the all-reduce across the replicas."""
    setups = ["force_sum", "force_sum_factor_5", "all_reduce_hook",
              "unused_params", "prefetch"]
    for rank, by_setup in enumerate(ranks(4).run(_each, setups, True, timeout=180)):
        failing = {s: p[:3] for s, p in by_setup.items() if p}
        assert not failing, f"rank {rank}: {failing}"


def _changes_something(setups):
    """Each setup changes the bits from the default's (so the test above tests something)."""
    torch.manual_seed(0)
    runs = {}
    for setup in ["none", *setups]:
        torch.manual_seed(0)
        model = Net()
        model.unused = nn.Linear(3, 3)
        shard_model(model, miniddp.fully_shard, miniddp.MixedPrecisionPolicy(), Case())
        SETUPS[setup](model)
        model(torch.randn(8, 12, generator=torch.Generator().manual_seed(dist.get_rank()))
              ).pow(2).mean().backward()
        runs[setup] = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    same = lambda a, b: all((x is None and y is None) or (x is not None and y is not None  # noqa
                                                          and torch.equal(x, y))
                            for x, y in zip(a, b))
    return [s for s in setups if same(runs[s], runs["none"])]


def test_the_reduction_settings_change_the_gradients_torchs_change(ranks):
    setups = ["force_sum_factor_5", "unused_params", "all_reduce_hook"]
    for rank, unchanged in enumerate(ranks(3).run(_changes_something, setups)):
        assert not unchanged, f"rank {rank}: these changed nothing: {unchanged}"


def _premul_refused() -> str:
    model = shard_model(Net(), miniddp.fully_shard, miniddp.MixedPrecisionPolicy(), Case())
    _each_unit("set_gradient_divide_factor", 3.0)(model)
    try:
        model(torch.randn(2, 12)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "not refused"


def test_a_divide_factor_that_needs_premul_sum_is_refused_on_gloo_as_torchs(ranks):
    for message in ranks(2).run(_premul_refused):
        assert "PREMUL_SUM" in message and "set_force_sum_reduction_for_comms" in message


# ----- the class and its methods -----

def torchs_public_methods() -> list[str]:
    from torch.distributed.fsdp._fully_shard import _fully_shard

    return sorted(name for name, value in vars(_fully_shard.FSDPModule).items()
                  if not name.startswith("_") and inspect.isfunction(value))


def _class_facts() -> dict:
    import torch.distributed.fsdp as torch_fsdp

    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    for layer in model:
        miniddp.fully_shard(layer)
    miniddp.fully_shard(model)
    torchs = torch_fsdp.FSDPModule
    facts = {"isinstance": all(isinstance(m, torchs) for m in (model, model[0], model[1])),
             "torchs": [n for n in torchs_public_methods()
                        if getattr(type(model), n) is getattr(torchs, n)],
             "missing": [n for n in torchs_public_methods() if not hasattr(model, n)],
             "sliced": type(model[0:1]).__name__}
    refused = {}
    for name, args in [("set_symm_mem_for_comm", ())]:
        try:
            getattr(model[0], name)(*args)
        except (RuntimeError, NotImplementedError) as e:
            refused[name] = str(e)
    facts["refused"] = refused
    handle = model[0].unshard(async_op=True)
    facts["before_wait"] = _held(model[0].weight)
    handle.wait()
    facts["after_wait"] = _held(model[0].weight)
    model[0].reshard()
    return facts


def test_every_public_method_of_torchs_fsdp_module_is_miniddps(ranks):
    assert len(torchs_public_methods()) >= 20, torchs_public_methods()
    for f in ranks(2).run(_class_facts):
        assert f["isinstance"], "miniddp's units are not torch's FSDPModule"
        assert f["missing"] == [] and f["torchs"] == [], f
        assert f["sliced"] == "Sequential"  # torch's __new__ picks the original class; so here
        assert "NCCL" in f["refused"]["set_symm_mem_for_comm"]
        assert set(f["refused"]) == {"set_symm_mem_for_comm"}
        assert f["before_wait"] == ("shard", 3, 4) and f["after_wait"] == ("whole", 6, 4)


def test_each_method_takes_torchs_arguments():
    """The same parameters, kinds and defaults as torch's, so that a call written for torch's
    binds the same way."""
    from torch.distributed.fsdp._fully_shard import _fully_shard

    def parameters(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    differing = [name for name in torchs_public_methods()
                 if parameters(getattr(_fully_shard.FSDPModule, name))
                 != parameters(getattr(miniddp.FSDPModule, name))]
    assert differing == []


# ----- register_fsdp_forward_method -----

class Doubler(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x):
        return self.lin(x)

    def double(self, x):
        return 2 * self.lin(x)


def _forward_method(register: str) -> dict:
    from torch.distributed.fsdp import register_fsdp_forward_method as torchs_register

    out = {}
    results = []
    for shard, policy, mesh in ((miniddp.fully_shard, miniddp.MixedPrecisionPolicy(), {}),
                                (torch_fully_shard, TorchPolicy(), {"mesh": device_mesh("cpu")})):
        torch.manual_seed(0)
        model = nn.Sequential(Doubler(), nn.Linear(6, 2))
        shard(model[0], mp_policy=policy, **mesh)
        shard(model, mp_policy=policy, **mesh)
        model(torch.randn(2, 4))  # the first forward picks the root
        if shard is torch_fully_shard:  # torch's model, always by torch's function
            torchs_register(model[0], "double")
        elif register != "none":
            (torchs_register if register == "torch's" else miniddp.fsdp.register_fsdp_forward_method
             )(model[0], "double")
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
        try:
            y = model[0].double(x)
        except RuntimeError as e:
            out["error"] = str(e)[:200]
            return out
        y.pow(2).sum().backward()
        results.append((y.detach(), [p.grad for p in model[0].parameters()],
                        tuple(model[0].lin.weight.to_local().shape
                              if hasattr(model[0].lin.weight, "to_local")
                              else model[0].lin.weight.shape)))
    (y1, g1, s1), (y2, g2, s2) = results
    problems: list[str] = []
    count_differences("output", [("y", y1)], [("y", y2)], problems)
    count_differences("grad", list(enumerate(g1)), list(enumerate(g2)), problems)
    out.update(problems=problems, resharded=(s1, s2))
    return out


@pytest.mark.parametrize("register", ["miniddp's", "torch's"])
def test_a_registered_forward_method_gathers_and_reshards_as_torchs(ranks, register):
    for f in ranks(2).run(_forward_method, register):
        assert f.get("error") is None and f["problems"] == [], f
        assert f["resharded"] == ((3, 4), (3, 4)), f  # resharded after it, as torch's


def test_an_unregistered_forward_method_meets_the_sharded_parameters(ranks):
    """The negative control: unregistered, the method computes with this rank's rows only."""
    for f in ranks(2).run(_forward_method, "none"):
        assert "error" in f or f["problems"], f


# ----- prefetching moves the gathers: both profilers' traces -----

def _gather_order(prefetch: bool) -> dict:
    """The order of FSDP's pre-forwards, pre-backwards and all-gathers in the second step's
    trace, each as (step, unit), for miniddp's model and torch's."""
    orders = {}
    for who, shard, policy, mesh in (
            ("ours", miniddp.fully_shard, miniddp.MixedPrecisionPolicy(), {}),
            ("torch's", torch_fully_shard, TorchPolicy(), {"mesh": device_mesh("cpu")})):
        torch.manual_seed(0)
        model = shard_model(Net(), shard, policy, Case(), **mesh)
        if prefetch:
            _prefetch(model)
        model(torch.randn(4, 12)).sum().backward()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(torch.randn(4, 12)).sum().backward()
        path = f"/tmp/miniddp-prefetch-{who[0]}-{dist.get_rank()}-{prefetch}.json"
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        seen = []
        orders[who + " prefetch spans"] = sorted(
            e["name"] for e in events if e["name"].startswith("FSDP::forward_prefetch"))
        for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            name = e["name"]
            step = name.split(" ")[0].removeprefix("FSDP::")
            if step not in ("pre_forward", "all_gather", "pre_backward"):
                continue
            unit = name[len("FSDP::" + step):].strip(" ()").split(",")[0]
            unit = unit.removeprefix("unit ").replace("root unit", "")
            seen.append(f"{step} {unit or 'root'}")
        orders[who] = seen
    return orders


#: The second step's trace with ``_prefetch``: root prefetches blocks.0 (gathered before its
#: pre-forward), blocks.0 prefetches blocks.1 and 2 (gathered inside its pre-forward), blocks.2's
#: pre-backward gathers blocks.1 and blocks.0 (by default: blocks.1 only, in blocks.2's, and
#: blocks.0 in blocks.1's).
PREFETCHED = ["pre_forward root", "all_gather root", "all_gather blocks.0",
              "pre_forward blocks.0", "all_gather blocks.1", "all_gather blocks.2",
              "pre_forward blocks.1", "pre_forward blocks.2",
              "pre_backward root", "all_gather blocks.2", "pre_backward blocks.2",
              "all_gather blocks.1", "all_gather blocks.0", "pre_backward blocks.1",
              "pre_backward blocks.0"]


def test_explicit_prefetch_moves_the_gathers_in_the_trace_as_torchs(ranks):
    """(The bits, with and without: ``prefetch`` in the test above.)"""
    without, with_ = ranks(2).run(_gather_order, False)[0], ranks(2).run(_gather_order, True)[0]
    assert without["ours"] == without["torch's"], without
    assert with_["ours"] == with_["torch's"], with_
    assert with_["ours"] == PREFETCHED, with_["ours"]
    assert with_["ours prefetch spans"] == [
        "FSDP::forward_prefetch (unit blocks.0)", "FSDP::forward_prefetch (unit blocks.1)",
        "FSDP::forward_prefetch (unit blocks.2)"], with_["ours prefetch spans"]
    assert without["ours prefetch spans"] == []
    assert without["ours"] != PREFETCHED and sorted(without["ours"]) == sorted(PREFETCHED)


def _held(param) -> tuple:
    """What a module holds: its shard (a DTensor: this rank's rows) or the whole parameter."""
    if hasattr(param, "to_local"):
        return ("shard", *param.to_local().shape)
    return ("whole", *param.shape)
