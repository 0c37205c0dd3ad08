"""Optimizers applied in backward (torch's ``_apply_optimizer_in_backward``) under miniddp's DDP.

torch's DDP takes the per-parameter optimizer hooks over at its first forward: it sums each
bucket, divides it by the world size, and steps the optimizers, then leaves ``.grad`` None
(``miniddp.compat.optimizer_in_backward``). The reference here is what that means written out:
a DDP with a communication hook that sums and divides, and one optimizer per parameter stepped
after backward; by torch's DDP and by miniddp's, bit for bit, at 3 ranks (where dividing the
sum and averaging on the way in give different bits). torch's own tests of it are ported in
test_torch_ddp_suite.py (its class needs a GPU there).
"""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward

import miniddp
from miniddp.checks.bits import all_same_bits


def sum_then_divide(group, bucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    dist.all_reduce(buffer, group=group)
    buffer.div_(dist.get_world_size(group))
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 2))


def train(gradient_as_bucket_view: bool, after_wrapping: bool) -> dict:
    """miniddp with optimizers in backward, and the references, over steps with ``no_sync``."""
    kwargs = dict(bucket_cap_mb=0.001, gradient_as_bucket_view=gradient_as_bucket_view)
    optim_kwargs = dict(lr=0.05, momentum=0.9, weight_decay=0.01)
    in_backward = make_model()
    if not after_wrapping:
        _apply_optimizer_in_backward(torch.optim.SGD, in_backward.parameters(), optim_kwargs)
    in_backward = miniddp.DistributedDataParallel(in_backward, **kwargs)
    if after_wrapping:
        _apply_optimizer_in_backward(torch.optim.SGD, in_backward.parameters(), optim_kwargs)
    references, optimizers = {}, {}
    for name, wrap in (("miniddp", miniddp.DistributedDataParallel),
                       ("torch", nn.parallel.DistributedDataParallel)):
        references[name] = wrap(make_model(), **kwargs)
        references[name].register_comm_hook(None, sum_then_divide)
        optimizers[name] = [torch.optim.SGD([p], **optim_kwargs)  # one per parameter, as there
                            for p in references[name].parameters()]
    torch.manual_seed(1 + dist.get_rank())
    grads_none = []
    for _ in range(4):
        x, accumulated = torch.randn(8, 6), torch.randn(8, 6)
        for model in [in_backward, *references.values()]:
            with model.no_sync():  # in no_sync nothing steps: gradients accumulate
                model(accumulated).pow(2).sum().backward()
            model(x).pow(2).sum().backward()
        for name in references:
            for optimizer in optimizers[name]:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        grads_none.append(all(p.grad is None for p in in_backward.parameters()))
    params = [p.detach().clone() for p in in_backward.parameters()]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, params)
    return {"same_as_miniddp_reference": all_same_bits(
                params, list(references["miniddp"].parameters())),
            "same_as_torch_reference": all_same_bits(
                params, list(references["torch"].parameters())),
            "replicas_equal": all(all_same_bits(params, other) for other in everyone),
            "grads_none": grads_none,
            "hook": in_backward._get_ddp_logging_data().get("comm_hook")}


def test_optimizers_in_backward_step_on_the_average_as_under_torch(ranks):
    for view in (False, True):
        for after_wrapping in (False, True):
            got = ranks(3).run(train, view, after_wrapping)[0]
            case = f"gradient_as_bucket_view={view}, applied after wrapping={after_wrapping}"
            assert got["replicas_equal"], f"{case}: the replicas drifted apart"
            assert got["same_as_torch_reference"] and got["same_as_miniddp_reference"], case
            assert got["grads_none"] == [True] * 4, f"{case}: .grad must be None, as torch's"
            assert got["hook"] == "apply_optim_in_backward_hook", got["hook"]


def second_hook_refused() -> str:
    model = make_model()
    _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    ddp = miniddp.DistributedDataParallel(model)
    ddp.register_comm_hook(None, sum_then_divide)  # before the first forward: accepted
    try:
        ddp(torch.randn(2, 6))
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_comm_hook_of_ones_own_is_refused_as_torch_refuses_it(ranks):
    assert "can only be called once" in ranks(2).run(second_hook_refused)[0]


def plain_after_wrapping_copy() -> bool:
    """A DDP without optimizers in backward keeps the usual path (and no comm hook)."""
    ddp = miniddp.DistributedDataParallel(copy.deepcopy(make_model()))
    ddp(torch.randn(2, 6)).sum().backward()
    return not ddp.reducer.comm_hook.averages and all(p.grad is not None for p in ddp.parameters())


def test_a_model_without_them_is_left_alone(ranks):
    assert ranks(2).run(plain_after_wrapping_copy) == [True, True]
