"""Optimizers applied in backward: torch's private ``_apply_optimizer_in_backward``, under DDP.

``torch.distributed.optim._apply_optimizer_in_backward(SGD, model.parameters(), {...})`` gives
every parameter an optimizer of its own, stepped by a hook on the parameter's AccumulateGrad
node as soon as its gradient is ready, and then sets ``.grad`` to None: no ``optimizer.step()``
after backward, and no gradients kept. Under DDP those hooks would step on each rank's *own*
gradient, before any all_reduce, and the replicas would drift apart. So torch's DDP takes them
over at its first forward (``_setup_in_backward_optimizers``), and miniddp does the same:

* the optimizer hooks of DDP's parameters are removed (their handles are in torch's
  ``param_to_optim_hook_handle_map``); parameters DDP ignores keep theirs, and step alone;
* a communication hook takes their place: each bucket is summed across ranks, *divided* by the
  group's size (torch's hook divides; without one, DDP multiplies by ``1 / world_size``: the
  same bits at 2 ranks, not always at 3), each parameter's ``.grad`` is set to its average and
  its optimizers step, in the bucket's order, while later buckets are still in backward;
* at the end of backward those parameters' ``.grad`` are set to None, as torch's are.

Since this is a communication hook, a DDP that uses it cannot register another (torch refuses
the second registration too). torch's version runs the optimizers on a side stream, which it
makes even on a CPU, where it then fails ("Cannot access accelerator device"); miniddp's has no
stream, and runs on the CPU as well.
"""

import weakref

import torch
import torch.distributed as dist


def at_first_forward(ddp) -> None:
    """In the engine's ``before_forward``, once: :func:`take_over`."""
    ddp.before_forward.remove(at_first_forward)
    take_over(ddp)


def take_over(ddp) -> None:
    """At the first forward: if any of ``ddp``'s parameters has optimizers applied in backward,
    remove their hooks and step them from a communication hook instead, after the all_reduce."""
    ddp._lazy_init_ran = True  # (torch's name for "the first forward's set-up is done")
    params = [p for name, p in ddp.module.named_parameters() if name not in ddp.ignored]
    stepped = [p for p in params if hasattr(p, "_in_backward_optimizers")]
    if not stepped:
        return
    # (imported here: on torch 2.1 torch.distributed.optim imports the compiler, which eager
    # training must not load; whoever applied these optimizers has imported it already)
    from torch.distributed.optim.apply_optimizer_in_backward import (
        param_to_optim_hook_handle_map as handles,  # where torch keeps their hooks' handles
    )
    for p in params:
        for handle in handles.get(p, []):
            handle.remove()
    ddp.register_comm_hook(HookState(weakref.ref(ddp), stepped), apply_optim_in_backward_hook)


class HookState:
    def __init__(self, ddp_ref, stepped: list):
        self.ddp_ref = ddp_ref
        self.stepped = stepped  # DDP's parameters whose optimizers step in backward
        self.clearing_queued = False  # the end-of-backward callback, once per backward


def apply_optim_in_backward_hook(state: HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Sum the bucket across ranks, divide it, and step the optimizers of its parameters."""
    ddp = state.ddp_ref()
    buffer = bucket.buffer()
    dist.all_reduce(buffer, group=ddp.process_group)  # waited for at once, as torch's is
    buffer.div_(dist.get_world_size(ddp.process_group))
    for param, average in zip(bucket.parameters(), bucket.gradients()):
        if hasattr(param, "_in_backward_optimizers"):
            if not ddp.gradient_as_bucket_view:  # (with it, .grad is that view already)
                param.grad = average
            for optimizer in param._in_backward_optimizers:
                optimizer.step()
    if not state.clearing_queued:
        state.clearing_queued = True
        _queue(lambda: _queue(lambda: _clear_grads(state)))  # see _clear_grads
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


def _queue(callback) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def _clear_grads(state: HookState) -> None:
    """At the end of backward, after the reducer has written the averages into ``.grad``: the
    callback queued during backward runs before the reducer's (queued at the last gradient),
    so it queues this one, which runs after it (the engine runs what callbacks queue)."""
    state.clearing_queued = False
    for param in state.stepped:
        param.grad = None
