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


def _patch(module, name: str, replace: Callable) -> None:
    """``module.name = replace(original)``, refusing a name that no longer exists."""
    if not hasattr(module, name):
        raise AttributeError(f"breakage: {module.__name__}.{name} no longer exists; update "
                             "tests/breakage/breakages.py for the new code")
    setattr(module, name, replace(getattr(module, name)))


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


def divide_instead_of_multiply(module):
    """Lesson 08: the reducer divides by the world size instead of multiplying by its inverse
    (equal at 2 ranks, where halving is exact; not at 3)."""
    def copy_into_bucket(self, param, view):
        if param.grad is None:
            view.zero_()
        else:
            view.copy_(param.grad).div_(getattr(self, "divisor", self.world_size))
    _patch(module.Reducer, "_copy_into_bucket", lambda original: copy_into_bucket)


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
    _patch(module.Reducer, "_write_back", lambda original: lambda self, index, view, *rest: None)


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


def compiled_ddp_unrecognised(module):
    """Lesson 16: miniddp marks its forward on a stand-in class, not on torch's DDP class, so
    torch's compiler never sees an active DDP module and compiles one graph."""
    _patch(module, "_TorchDDP", lambda original: type("NotTorchsDDP", (),
                                                      {"_active_ddp_module": None}))


#: name -> (module it patches, the patch)
BREAKAGES = {
    "no_optimizer_step": ("torch.optim", no_optimizer_step),
    "reversed_gather": ("miniddp.baselines.data_parallel", reversed_gather),
    "all_reduce_does_nothing": ("torch.distributed", all_reduce_does_nothing),
    "set_epoch_ignored": ("miniddp.sampler", set_epoch_ignored),
    "no_sync_ignored": ("miniddp.ddp", no_sync_ignored),
    "divide_instead_of_multiply": ("miniddp.reducer", divide_instead_of_multiply),
    "write_not_atomic": ("miniddp.train.checkpoint", write_not_atomic),
    "no_grad_scaler": ("torch.amp", no_grad_scaler),
    "bucket_cap_ignored": ("miniddp.reducer", bucket_cap_ignored),
    "averages_not_written_back": ("miniddp.reducer", averages_not_written_back),
    "comm_hook_ignored": ("miniddp.options.comm_hooks", comm_hook_ignored),
    "join_ignores_the_divisor": ("miniddp.options.join", join_ignores_the_divisor),
    "compiled_ddp_unrecognised": ("miniddp.options.compiled", compiled_ddp_unrecognised),
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
