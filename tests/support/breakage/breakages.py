"""Breakages of the mechanisms the lessons prove, each applied from outside the lesson.

Each entry patches one module when it is imported (or at once, if it already is), so a process
that never imports that module (a launcher that only starts torchrun) pays nothing. If the
library is restructured and a patched name disappears, :func:`apply` fails loudly instead of
leaving the mechanism intact: update the entry, and the test goes on proving the lesson.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable

#: What each patch replaced, so that a pool of ranks can be mended after a case (:func:`undo`)
_REPLACED: list[tuple[object, str, object]] = []


def _patch(module, name: str, replace: Callable) -> None:
    """``module.name = replace(original)``, refusing a name that no longer exists."""
    if not hasattr(module, name):
        raise AttributeError(f"breakage: {module.__name__}.{name} no longer exists; update "
                             "tests/support/breakage/breakages.py for the new code")
    original = vars(module).get(name, getattr(module, name))  # a classmethod stays one
    _REPLACED.append((module, name, original))
    setattr(module, name, replace(getattr(module, name)))


def undo() -> None:
    """Put back everything patched since the last undo, the latest first."""
    while _REPLACED:
        module, name, original = _REPLACED.pop()
        setattr(module, name, original)


def no_optimizer_step(module):
    """Lesson 00: the optimizer never moves the weights."""
    _patch(module.SGD, "step", lambda step: lambda self, closure=None: None)


def reversed_gather(module):
    """Lesson 02: DataParallel joins its replicas' outputs in the wrong order."""
    _patch(module, "_gather", lambda gather: lambda outputs, device, dim:
           gather(list(reversed(outputs)), device, dim))


def all_reduce_does_nothing(module):
    """Lessons 03 and others: ``dist.all_reduce`` leaves every rank's tensor as it was."""
    def all_reduce(tensor, op=None, group=None, async_op=False):
        if async_op:
            raise RuntimeError("breakage: async all_reduce is not broken here")
    _patch(module, "all_reduce", lambda original: all_reduce)


def set_epoch_ignored(module):
    """Lesson 04: the sampler's ``set_epoch`` does nothing, so every epoch repeats the first."""
    _patch(module.DistributedSampler, "set_epoch", lambda original: lambda self, epoch: None)


def no_sync_ignored(module):
    """Lesson 07: ``no_sync`` does not stop the all_reduce of the micro-batches inside it."""
    _patch(module.DistributedDataParallel, "no_sync",
           lambda original: lambda self: contextlib.nullcontext())


def no_sync_outputs_unwatched(module):
    """Lesson 07's second trap: outputs of a forward inside ``no_sync`` skip DDP's watch, so
    the parameters behind an ignored output never report in to a reduction still expected."""
    _patch(module.Reducer, "outputs_of_unsynced_forward",
           lambda original: lambda self, outputs: outputs)


def divide_instead_of_multiply(module):
    """Lesson 08: the reducer divides by the world size instead of multiplying by its inverse
    (equal at 2 ranks, where halving is exact; not at 3)."""
    import torch

    def scale(self, source, out):  # gradient by gradient, or a whole bucket at once
        torch.div(source, getattr(self, "divisor", self.world_size), out=out)
    _patch(module.Reducer, "_scale", lambda original: scale)


def write_not_atomic(module):
    """Lesson 09: ``write_atomic`` writes in place, as ``torch.save`` does."""
    import torch

    _patch(module, "write_atomic", lambda original: lambda obj, path: torch.save(obj, path))


def no_grad_scaler(module):
    """Lesson 10: the GradScaler is removed: it scales by 1 and never skips a step."""
    class NoScaler:
        def __init__(self, *args, **kwargs):
            pass

        def scale(self, outputs):
            return outputs

        def unscale_(self, optimizer):
            pass

        def step(self, optimizer, *args, **kwargs):
            return optimizer.step(*args, **kwargs)

        def update(self, new_scale=None):
            pass

        def get_scale(self):
            return 1.0

    _patch(module, "GradScaler", lambda original: NoScaler)


def bucket_cap_ignored(module):
    """Lesson 11: ``bucket_cap_mb`` is ignored: every DDP gets the default buckets."""
    _patch(module, "bucket_limits", lambda limits: lambda cap, *args, **kwargs: limits(None))


def averages_not_written_back(module):
    """Lesson 12: the reducer all_reduces the buckets but never writes the averages to .grad."""
    _patch(module.Bucket, "write_back", lambda original: lambda self, *args: None)


def comm_hook_ignored(module):
    """Lesson 13: ``register_comm_hook`` checks the hook and then never uses it."""
    _patch(module, "register", lambda register: lambda reducer, state, hook:
           module.check_hook(hook))


def join_ignores_the_divisor(module):
    """Lesson 14: under join, gradients are always divided by the initial world size."""
    def notify_still_training(ddp):
        if module.Join.notify_join_context(ddp) is not None:
            ddp.reducer.divisor = ddp.reducer.world_size
    _patch(module, "notify_still_training", lambda original: notify_still_training)


def broadcast_does_nothing(module):
    """Lesson 15: ``dist.broadcast`` leaves every rank's tensor as it was: the owners' updated
    parameters never reach the other ranks."""
    class Done:
        def wait(self, *args, **kwargs):
            return True

    def broadcast(tensor, src=None, group=None, async_op=False, **kwargs):
        return Done() if async_op else None
    _patch(module, "broadcast", lambda original: broadcast)


def join_syncs_from_the_first_joiner(module):
    """Lesson 14: join's final sync takes the model of the ranks that ran out first (the
    highest of those that are not the last joiner) instead of the last joiner's."""
    _patch(module.DDPJoinHook, "post_hook", lambda original: lambda self, is_last_joiner:
           original(self, not is_last_joiner))


def join_syncs_from_rank_0(module):
    """Lesson 14: join's final sync always takes rank 0's model (rank 0 runs out first)."""
    def post_hook(self, is_last_joiner):
        ddp = self.ddp
        states = [p.detach() for name, p in ddp.module.named_parameters()
                  if name not in ddp.ignored] + [b.detach() for b in module._synced_buffers(ddp)]
        module.broadcast_from(states, 0, ddp.process_group)
    _patch(module.DDPJoinHook, "post_hook", lambda original: post_hook)


def join_skips_the_final_sync(module):
    """Lesson 14: join never copies the last joiner's model to the others."""
    _patch(module.DDPJoinHook, "post_hook", lambda original: lambda self, is_last_joiner: None)


def _trace_without(kinds):
    """A ``BackwardTrace.lines`` that leaves out the events of ``kinds``."""
    def patch(lines):
        def without(self):
            kept = [e for e in self.events if e[0] not in kinds]
            saved, self.events = self.events, kept
            try:
                return lines(self)
            finally:
                self.events = saved
        return without
    return patch


def trace_drops_waits(module):
    """Lesson 06: the trace prints no 'waited' line."""
    _patch(module.BackwardTrace, "lines", _trace_without({"waited"}))


def trace_drops_launches(module):
    """Lesson 06: the trace prints no 'launch' line."""
    _patch(module.BackwardTrace, "lines", _trace_without({"launch"}))


def trace_waits_reversed(module):
    """Lesson 06: the trace shows the waits in the reverse of their order."""
    def patch(lines):
        def reversed_waits(self):
            waits = [e for e in self.events if e[0] == "waited"][::-1]
            saved = self.events
            self.events = [waits.pop(0) if e[0] == "waited" else e for e in saved]
            try:
                return lines(self)
            finally:
                self.events = saved
        return reversed_waits
    _patch(module.BackwardTrace, "lines", patch)


def reducer_records_no_waits(module):
    """Lesson 06: the reducer's record (that the trace prints) has no 'waited' events."""
    def record(original):
        def without_waits(self, event, ident):
            if event != "waited":
                original(self, event, ident)
        return without_waits
    _patch(module.Reducer, "emit", record)


def write_back_before_wait(module):
    """Lessons 06 and 07: the reducer writes each bucket into ``.grad`` as if before waiting for
    its all_reduce, when the all_reduce has not written the sum yet: ``.grad`` gets this rank's
    own scaled gradients. (Reading the bucket before the wait is a race; this is its outcome
    whenever the all_reduce is the slower, fixed so that the lessons' tests are deterministic.)"""
    def launch(original):
        def keep_before(self, bucket):
            self._before_wait = getattr(self, "_before_wait", {})
            self._before_wait[bucket.index] = bucket.buffer.clone()
            original(self, bucket)
        return keep_before

    def finalize(original):
        def write_early(self):
            early = getattr(self, "_before_wait", {})
            self._before_wait = {}
            original(self)
            for bucket in self.buckets:
                if bucket.index not in early:
                    continue
                offset = 0
                for i in bucket.param_indices:
                    param = self.params[i]
                    if param.grad is not None:
                        flat = early[bucket.index][offset:offset + param.numel()]
                        param.grad.copy_(flat.view_as(param.grad))
                    offset += param.numel()
        return write_early
    _patch(module.Reducer, "_launch", launch)
    _patch(module.Reducer, "_finalize", finalize)


def compiled_ddp_unrecognised(module):
    """Lesson 16: miniddp marks its forward on a stand-in class, not on torch's DDP class, so
    torch's compiler never sees an active DDP module and compiles one graph."""
    _patch(module.DistributedDataParallel, "active_module_holder",
           lambda original: type("NotTorchsDDP", (), {"_active_ddp_module": None}))


def buckets_launched_after_backward(module):
    """Lesson 16: the reducer launches every bucket's all_reduce after backward (``overlap=False``,
    as ``AllReduceBucketsAfterBackward``) instead of as each bucket fills."""
    def init(original):
        def after_backward(self, *args, **kwargs):
            original(self, *args, **kwargs)
            if not hasattr(self, "overlap"):
                raise AttributeError("breakage: Reducer.overlap no longer exists; update "
                                     "tests/support/breakage/breakages.py for the new code")
            self.overlap = False
        return after_backward
    _patch(module.Reducer, "__init__", init)


def no_sync_exits_to_true(module):
    """Lesson 07: ``no_sync`` sets the flag to True on exit instead of restoring the value it
    found, so a ``no_sync`` nested in another ends the outer one's accumulation early."""
    @contextlib.contextmanager
    def no_sync(self):
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = True
    _patch(module.DistributedDataParallel, "no_sync", lambda original: no_sync)


def reshard_skips_by_the_new_world_size(module):
    """Lesson 04: a state saved at another world size resumes as if saved at this one: each rank
    skips ``consumed`` of its new share, not the ``consumed * saved world size`` samples done."""
    def load(original):
        def load_state_dict(self, state, reshard=False):
            if reshard:
                state = {**state, "num_replicas": self.num_replicas}
            original(self, state, reshard)
        return load_state_dict
    _patch(module.DistributedSampler, "load_state_dict", load)


def zero_ties_reversed(module):
    """Lesson 15: ZeRO's partition breaks ties between equal-size parameters the other way
    (the last of equals first), so equal layers get other owners than torch gives them."""
    def partition(original):
        def ties_reversed(param_groups, world_size):
            flipped = [{**group, "params": list(reversed(group["params"]))}
                       for group in param_groups]
            return original(flipped, world_size)
        return ties_reversed
    _patch(module, "greedy_by_size", partition)


def zero_lr_never_forwarded(module):
    """Lesson 15: a learning rate set on ZeRO's param_groups (a scheduler's) never reaches the
    local optimizer that steps this rank's share: it keeps the first one."""
    def without_lr(original):
        return lambda sources, destinations: original(
            [{k: v for k, v in group.items() if k != "lr"} for group in sources], destinations)
    _patch(module, "_copy_hyperparameters", without_lr)


def bucket_view_multiplied(module):
    """Lesson 08: with ``gradient_as_bucket_view``, a gradient that already is its bucket view
    is multiplied by ``1 / world_size`` where torch divides (equal at 2 ranks, not at 3)."""
    def copy_in(original):
        def multiplied(self, param, view, divisor, scale):
            if scale and param.grad is not None and module.same_storage(param.grad, view):
                view.mul_(1.0 / divisor)
            else:
                original(self, param, view, divisor, scale)
        return multiplied
    _patch(module.GradientsAsBucketViews, "copy_in", copy_in)


def static_graph_ready_at_first_arrival(module):
    """Lesson 08: with ``static_graph``, a gradient that arrives twice in a backward (a layer
    checkpointed twice) is called ready at its first arrival instead of its last."""
    def final_firing(original):
        def at_first(self, index, expect_hooks):
            if self.counting or not expect_hooks:
                return original(self, index, expect_hooks)
            first = self.remaining[index] == self.firings[index]
            original(self, index, expect_hooks)  # still counts this arrival down
            return first
        return at_first
    _patch(module.StaticGraph, "final_firing", final_firing)


def buckets_never_rebuilt(module):
    """Lessons 05 and 08: the reducer keeps the one bucket of construction for good, never
    rebuilding the buckets in the order gradients became ready."""
    _patch(module.Reducer, "should_rebuild", lambda original: property(lambda self: False))


def rebuilt_in_model_order(module):
    """Lesson 05: the rebuild (it runs once) cuts the buckets in model order
    instead of the order in which the gradients became ready in the first backward."""
    _patch(module, "rebuilt_assignment", lambda original: lambda params, order, *args, **kwargs:
           original(params, sorted(order), *args, **kwargs))


#: name -> (module it patches, the patch)
BREAKAGES = {
    "no_optimizer_step": ("torch.optim", no_optimizer_step),
    "reversed_gather": ("miniddp.baselines.data_parallel", reversed_gather),
    "all_reduce_does_nothing": ("torch.distributed", all_reduce_does_nothing),
    "set_epoch_ignored": ("miniddp.sampler", set_epoch_ignored),
    "no_sync_ignored": ("miniddp.ddp", no_sync_ignored),
    "no_sync_outputs_unwatched": ("miniddp.reducer", no_sync_outputs_unwatched),
    "divide_instead_of_multiply": ("miniddp.reducer", divide_instead_of_multiply),
    "write_not_atomic": ("miniddp.train.checkpoint", write_not_atomic),
    "no_grad_scaler": ("torch.amp", no_grad_scaler),
    "bucket_cap_ignored": ("miniddp.reducer_layout", bucket_cap_ignored),
    "averages_not_written_back": ("miniddp.reducer", averages_not_written_back),
    "comm_hook_ignored": ("miniddp.options.comm_hooks", comm_hook_ignored),
    "join_ignores_the_divisor": ("miniddp.options.join", join_ignores_the_divisor),
    "broadcast_does_nothing": ("torch.distributed", broadcast_does_nothing),
    "join_syncs_from_the_first_joiner": ("miniddp.options.join",
                                         join_syncs_from_the_first_joiner),
    "join_syncs_from_rank_0": ("miniddp.options.join", join_syncs_from_rank_0),
    "join_skips_the_final_sync": ("miniddp.options.join", join_skips_the_final_sync),
    "trace_drops_waits": ("miniddp.checks.trace", trace_drops_waits),
    "trace_drops_launches": ("miniddp.checks.trace", trace_drops_launches),
    "trace_waits_reversed": ("miniddp.checks.trace", trace_waits_reversed),
    "reducer_records_no_waits": ("miniddp.reducer", reducer_records_no_waits),
    "write_back_before_wait": ("miniddp.reducer", write_back_before_wait),
    "compiled_ddp_unrecognised": ("miniddp.ddp", compiled_ddp_unrecognised),
    "buckets_launched_after_backward": ("miniddp.reducer", buckets_launched_after_backward),
    "no_sync_exits_to_true": ("miniddp.ddp", no_sync_exits_to_true),
    "reshard_skips_by_the_new_world_size": ("miniddp.sampler",
                                            reshard_skips_by_the_new_world_size),
    "zero_ties_reversed": ("miniddp.optim.zero", zero_ties_reversed),
    "zero_lr_never_forwarded": ("miniddp.optim.zero", zero_lr_never_forwarded),
    "bucket_view_multiplied": ("miniddp.options.gradient_views", bucket_view_multiplied),
    "static_graph_ready_at_first_arrival": ("miniddp.options.static_graph",
                                            static_graph_ready_at_first_arrival),
    "buckets_never_rebuilt": ("miniddp.reducer", buckets_never_rebuilt),
    "rebuilt_in_model_order": ("miniddp.reducer", rebuilt_in_model_order),
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of one module so ``patch`` runs after it."""

    def __init__(self, name: str, patch: Callable):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def apply(name: str) -> None:
    """Apply the breakage ``name`` now, or when its module is first imported."""
    if name not in BREAKAGES:
        raise KeyError(f"no breakage named {name!r}; known: {', '.join(BREAKAGES)}")
    module_name, patch = BREAKAGES[name]
    if module_name in sys.modules:
        patch(sys.modules[module_name])
    else:
        sys.meta_path.insert(0, _PatchOnImport(module_name, patch))


def fsdp_scales_before_the_sum(module):
    """Lesson 17: miniddp's FSDP multiplies the gradients by 1/W before the sum (DDP's
    arithmetic) instead of dividing the sum by W (torch FSDP2's): other roundings at 3 ranks."""
    import torch.distributed as dist

    def mean(buffer, group=None):
        return module.reduce_scatter_sum(buffer.mul_(1 / dist.get_world_size(group)), group)
    _patch(module, "reduce_scatter_mean", lambda original: mean)


def fsdp_flat_layout(module):
    """Lesson 17: miniddp's FSDP sums its gradients laid out whole, one after another (FSDP1's
    flat parameter), instead of in torch's rank-major rows: the same sums, in other places of
    the buffer, so gloo adds them in another order at 3 ranks."""
    import torch
    import torch.distributed as dist

    collectives = module.collectives

    def flat_average(widths):
        def average(buffer, mesh=collectives.EVERY_RANK, partial=None, all_reduce=True):
            group = mesh.shard_group
            world, rank = buffer.shape[0], dist.get_rank(group)
            parts = buffer.split(widths, dim=1)  # each (W, width): one gradient, whole
            flat = torch.cat([p.reshape(-1) for p in parts])
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            whole = flat.split([p.numel() for p in parts])
            return torch.cat([w.view(world, -1)[rank] for w in whole]), None
        return average

    def reduce_scatter(original):
        def in_flat_layout(self, with_grad):
            average, collectives.average = collectives.average, flat_average(
                [p.padded.numel() for p, _ in with_grad])
            try:
                return original(self, with_grad)
            finally:
                collectives.average = average
        return in_flat_layout
    _patch(module.ParamGroup, "reduce_scatter", reduce_scatter)


BREAKAGES.update({
    "fsdp_scales_before_the_sum": ("miniddp.fsdp.collectives", fsdp_scales_before_the_sum),
    "fsdp_flat_layout": ("miniddp.fsdp.param_group", fsdp_flat_layout),
})

from sharding import SHARDING  # noqa: E402  (its breakages use _patch, above)

BREAKAGES.update(SHARDING)
