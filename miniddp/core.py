"""The core of DDP: wrap a module, keep its replicas equal, and average gradients in backward.

What happens where:

* construction (here): check every rank has the same parameter shapes, broadcast parameters
  (frozen ones too) and buffers from rank 0, hand the trainable parameters to the reducer;
* forward (here): rebuild buckets once, broadcast buffers from rank 0, run the module, and,
  when this forward will be followed by a synchronized backward, prepare the reducer;
* backward (``miniddp.reducer``): hooks fill buckets and launch asynchronous all_reduces;
* bucket layout and its one rebuild (``miniddp.buckets``).

The public class, ``miniddp.ddp.DistributedDataParallel``, is this one with DDP's options and
torch's compatibility composed onto it; they attach at the points named below, each of which
does nothing until something is attached:

* ``check_devices``: the devices and layers torch's DDP accepts (``miniddp.compat.arguments``);
* ``before_forward``: callables run with the module at the start of every forward (the
  optimizers applied in backward, taken over at the first; ``join``'s notices);
* ``traced_forward``: the forward as torch's compiler traces it (``torch.compile(ddp)``);
* ``active_module_holder``: the class whose ``_active_ddp_module`` names the DDP module whose
  wrapped module is running (torch's compiler reads torch's DDP class there);
* ``buffer_hook``: what synchronizes buffers instead of rank 0's broadcast;
* the reducer's options and its event stream (``miniddp.reducer``, ``miniddp.events``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from miniddp import errors, profiling
from miniddp.buckets import BucketInfo, bucket_limits
from miniddp.profiling import NO_SPAN
from miniddp.reducer import Reducer
from miniddp.sync import broadcast_from, broadcast_from_rank0, group_rank0, held, verify_same_shapes
from miniddp.torch_versions import TORCH_HAS_IS_COMPILING

#: True while torch's compiler traces the code that asks (torch 2.3 on).
_is_compiling = torch.compiler.is_compiling if TORCH_HAS_IS_COMPILING else bool


def move_to(obj, device):
    """Move every tensor in a (nested) input to ``device`` (also the one-device DataParallel's),
    as torch's DDP does: a PackedSequence keeps its batch sizes on the CPU, a namedtuple or a
    dict keeps its type, any other non-empty tuple or list becomes a plain one."""
    if isinstance(obj, (torch.Tensor, PackedSequence)):
        return obj.to(device)
    if isinstance(obj, (list, tuple)) and obj:
        moved = [move_to(x, device) for x in obj]
        if hasattr(obj, "_fields"):
            return type(obj)(*moved)
        return moved if isinstance(obj, list) else tuple(moved)
    if isinstance(obj, dict):
        return type(obj)((k, move_to(v, device)) for k, v in obj.items())
    return obj


class CoreDDP(nn.Module):
    """The engine's wrapper: the public class (``miniddp.ddp.DistributedDataParallel``, whose
    docstring says what each argument means) is this one with options and torch's
    compatibility attached. Subclasses change how gradients are reduced by swapping
    ``reducer_class`` (the bucket layout) or ``overlap`` (launch during backward, or only after
    it); see ``miniddp.baselines.naive``."""

    reducer_class = Reducer
    overlap = True
    traced_forward = None
    active_module_holder = None  # (the class itself unless set: see below)
    _active_ddp_module = None
    buffer_hook = None
    explain_assertion = None  # (module, error): raise a clearer error for the module's, or not

    def __init__(self, module: nn.Module, *, device_ids=None, output_device=None,
                 init_sync: bool = True, process_group=None, bucket_cap_mb: float | None = None,
                 bucket_caps: list[int] | None = None, find_unused_parameters: bool = False,
                 forward_sync_buffers: bool = True, sync_buffers_at_init: bool = True,
                 views=None, batched_copy: bool = False):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise errors.no_process_group()
        bucket_limits(bucket_cap_mb)  # reject a bad cap before any collective runs
        self.module = module
        self._group = held(process_group)  # None for the default group (see held)
        self.bucket_cap_mb = bucket_cap_mb
        self.bucket_caps = bucket_caps
        self.forward_sync_buffers = forward_sync_buffers
        self.find_unused_parameters = find_unused_parameters
        self.before_forward: list = []
        self.buffer_source = group_rank0(process_group)  # the rank whose buffers all copy
        # torch's private opt-out list: these are neither broadcast nor averaged
        self.ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        # torch's rule for buffers: whether there are any at construction decides whether
        # buffers are ever synced; each sync then reads them anew (a module may reassign a
        # buffer, or register one), as torch's _sync_buffers does.
        self._modules_buffers = self._read_buffers()
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True  # false right after a no_sync / no_grad forward
        all_params = [(name, p) for name, p in module.named_parameters()  # shared ones once
                      if name not in self.ignored]
        trainable = [p for _, p in all_params if p.requires_grad]
        if not trainable:
            raise errors.nothing_to_synchronize()
        self.device = trainable[0].device
        self.device_ids, self.output_device = self.check_devices(
            device_ids, output_device, {p.device for _, p in all_params})
        if init_sync:  # torch's opt-out, for models already identical on every rank
            verify_same_shapes(all_params, process_group)
            broadcast_from_rank0([p.detach() for _, p in all_params], process_group)
            buffers = self._buffers_to_sync()
            if sync_buffers_at_init and buffers:
                broadcast_from_rank0(buffers, process_group)
        self.reducer = self._make_reducer(views, batched_copy)

    def check_devices(self, device_ids, output_device, devices: set):
        """``device_ids=[gpu]`` for a module on one GPU, None on a CPU; refuse what cannot be
        wrapped (the public class says what torch's DDP refuses)."""
        return device_ids, output_device

    @property
    def process_group(self):
        """The group object itself, as torch's DDP keeps it (torch's utilities read it here)."""
        return dist.group.WORLD if self._group is None else self._group

    def _make_reducer(self, views=None, batched_copy: bool = False) -> Reducer:
        """The reducer for the trainable parameters DDP manages."""
        trainable = [(name, p) for name, p in self.module.named_parameters()
                     if p.requires_grad and name not in self.ignored]
        reducer = self.reducer_class(
            [p for _, p in trainable], [name for name, _ in trainable], self._group,
            bucket_cap_mb=self.bucket_cap_mb, bucket_caps=self.bucket_caps,
            find_unused_parameters=self.find_unused_parameters, overlap=self.overlap,
            batched_copy=batched_copy)
        if views is not None:
            reducer.attach(views=views)  # (options/gradient_views.py)
        self.bucket_bytes_cap = max(self.bucket_caps or reducer.bucket_limits[-1:])
        return reducer

    def _read_buffers(self) -> dict[str, torch.Tensor]:
        """The module's buffers now (a tensor registered under two names once), but ignored."""
        return {name: b for name, b in self.module.named_buffers() if name not in self.ignored}

    def _buffers_to_sync(self) -> list[torch.Tensor]:
        if self._modules_buffers:  # none at construction: never (torch's will_sync_module_buffers)
            self._modules_buffers = self._read_buffers()
        return list(self._modules_buffers.values())

    @property
    def buckets(self) -> list[BucketInfo]:
        """The current buckets, in the order their all_reduces are launched."""
        return self.reducer.bucket_info()

    @property
    def allreduce_calls(self) -> int:
        """All_reduce calls made by the backward of the last forward with grad enabled: one
        per bucket after a synced forward, 0 after a forward inside ``no_sync``."""
        return self.reducer.allreduce_calls

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the forward must run inside the context.

        The flag is read at forward time (as in torch): a forward inside ``no_sync`` followed by
        a backward outside it does not synchronize. The first synced backward afterwards
        averages the whole accumulated gradient once.
        """
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def forward(self, *inputs, **kwargs):
        if _is_compiling() and self.traced_forward is not None:  # torch.compile(ddp)
            return self.traced_forward(inputs, kwargs)
        with profiling.span("miniddp.ddp.forward") if profiling.recording() else NO_SPAN:
            inputs, kwargs = self._pre_forward(*inputs, **kwargs)
            return self._post_forward(self._run_module(inputs, kwargs))

    def _pre_forward(self, *inputs, **kwargs):
        """Before the module runs: the bucket rebuild, the buffer broadcast; returns the inputs,
        moved to the module's GPU if it has one."""
        for prepare in tuple(self.before_forward):  # (one may remove itself)
            prepare(self)
        if torch.is_grad_enabled():
            self.reducer.begin_forward(self.require_backward_grad_sync)
        if self.will_sync_module_buffers():
            self._sync_buffers(before_forward=True)
        if self.device_ids:
            device = torch.device("cuda", self.device_ids[0])
            inputs, kwargs = move_to(inputs, device), move_to(kwargs, device)
        return inputs, kwargs

    def _run_module(self, inputs, kwargs):
        """``self.module(...)``, with this module named as the running DDP module (where
        torch's compiler looks for it, to split a compiled module at the buckets)."""
        holder = self.active_module_holder or CoreDDP
        previous, holder._active_ddp_module = holder._active_ddp_module, self
        try:
            return self.module(*inputs, **kwargs)
        except AssertionError as error:  # torch's compiler refusing the bucket cap, say
            if self.explain_assertion is not None:
                self.explain_assertion(self, error)
            raise
        finally:
            holder._active_ddp_module = previous

    def will_sync_module_buffers(self) -> bool:
        """Whether this forward synchronizes the buffers (torch's rule: right after a
        synchronized forward, with buffer sync on, and buffers at construction)."""
        return (self.require_forward_param_sync and self.forward_sync_buffers
                and bool(self._modules_buffers))

    def _sync_buffers(self, before_forward: bool) -> None:
        """Rank 0's buffers to every rank (or the ``buffer_hook``'s sync, where it runs)."""
        if self.buffer_hook is not None:
            self.buffer_hook(self, before_forward)
        elif before_forward:
            buffers = self._buffers_to_sync()
            if buffers:
                self.reducer.emit("buffers", -1)
                broadcast_from(buffers, self.buffer_source, self.process_group)

    def _post_forward(self, output):
        """After the module ran: when a synced backward will follow, prepare the reducer."""
        if self.buffer_hook is not None and self.will_sync_module_buffers():
            self._sync_buffers(before_forward=False)
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        self.require_forward_param_sync = sync
        if sync:
            return self.reducer.prepare_for_backward(output)
        if torch.is_grad_enabled():  # inside no_sync: watched all the same (see the reducer)
            return self.reducer.outputs_of_unsynced_forward(output)
        return output
