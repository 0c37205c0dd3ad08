"""``miniddp.DistributedDataParallel``: torch's DDP, rebuilt in readable Python.

Same constructor arguments, same meanings and the same bits as
``torch.nn.parallel.DistributedDataParallel``, so swapping the import in a working script
changes nothing else. What happens where:

* construction (here): check every rank has the same parameter shapes, broadcast parameters
  (frozen ones too) and buffers from rank 0, hand the trainable parameters to the reducer;
* forward (here): rebuild buckets once, broadcast buffers from rank 0, run the module, and —
  when this forward will be followed by a synchronized backward — prepare the reducer;
* backward (``miniddp.reducer``): hooks fill buckets and launch asynchronous all_reduces;
* bucket layout and its one rebuild (``miniddp.buckets``);
* uneven inputs, ``ddp.join()`` and torch's ``Join`` (``miniddp.options.join``).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable
from torch.nn.utils.rnn import PackedSequence

from miniddp import errors
from miniddp.buckets import BucketInfo, bucket_limits, bucket_limits_list
from miniddp.options import arguments, comm_hooks, compiled, optimizer_in_backward, pickling
from miniddp.options.batched_copy import BatchedGradCopy
from miniddp.options.join import (
    DDPJoinHook,
    announce_backward_sync,
    buffer_source,
    join_context,
    notify_still_training,
)
from miniddp.options.logging_data import DDPLogging
from miniddp.options.static_graph import StaticGraph
from miniddp.options.torch_private import BufferCommHookLocation, TorchPrivateDDP
from miniddp.reducer import Reducer
from miniddp.sync import broadcast_from, broadcast_from_rank0, verify_same_shapes


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


class DistributedDataParallel(TorchPrivateDDP, nn.Module, Joinable):  # see miniddp.options
    """Data parallelism across processes: every rank trains a replica on its own data, and
    gradients are averaged during backward, so every replica takes the same optimizer step.

    ``device_ids`` / ``output_device``: for a module on one GPU, ``[gpu]`` (as torch); ``None``
    for CPU modules. ``forward_sync_buffers`` (torch 2.13; before it, ``broadcast_buffers``):
    copy rank 0's buffers before each synced forward.
    ``bucket_cap_mb``: bucket size (default: 1 MiB first bucket, then 25 MiB; an explicit cap
    covers the first bucket too from torch 2.4, as in torch).
    ``find_unused_parameters``: allow parameters that take no part in the loss.
    ``gradient_as_bucket_view``: ``.grad`` aliases the bucket (saves one copy of the gradients).
    ``static_graph``: the graph is the same every iteration, which allows a layer used twice
    under reentrant checkpointing and finds unused parameters once
    (``miniddp.options.static_graph``).
    ``init_sync=False`` skips the construction-time check and broadcast. The arguments are
    the installed torch's, in torch's order, with its defaults (``miniddp.options.arguments``; the
    README's "torch's constructor arguments" says which work and which are refused).
    Parameters and buffers named by torch's
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)`` are
    neither broadcast nor averaged. ``copy.deepcopy`` and pickling work as torch's
    (``miniddp.options.pickling``). torch's private attributes and methods that torch's tests,
    compiler and libraries read (``_get_ddp_logging_data()``, buffer hooks, ...) come from
    ``miniddp.options.torch_private``.

    Subclasses change how gradients are reduced by swapping ``reducer_class`` (the bucket
    layout) or ``overlap`` (launch during backward, or only after it); see
    ``miniddp.baselines.naive``.
    """

    reducer_class = Reducer
    overlap = True
    #: The checks and traces attach here: ``miniddp.checks`` sets it when ``miniddp`` is
    #: imported (the engine imports no check). None: no checks, no trace.
    checks = None
    #: torch's compiler asks DDP's class for the module whose forward is running; asked of
    #: this class too, the answer is the same (miniddp.options.compiled)
    _get_active_ddp_module = staticmethod(compiled.active_ddp_module)
    #: torch's (private, but libraries use it): name parameters and buffers DDP must leave alone
    _set_params_and_buffers_to_ignore_for_model = staticmethod(
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model)

    @arguments.takes_torchs_arguments
    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group=None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None,
                 skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: list[float] | None = None, batched_grad_copy: bool = False,
                 forward_sync_buffers: bool | None = None):
        super().__init__()
        arguments.refuse_unsupported(delay_all_reduce_named_params, param_to_hook_all_reduce,
                                     mixed_precision)  # miniddp.options.arguments
        arguments.warn_check_reduction(check_reduction)
        Joinable.__init__(self)  # miniddp.options.join: outside a join context, join does nothing
        # dim (for single-process DataParallel) and check_reduction: accepted, unused, as torch
        self.dim, self._lazy_init_ran = dim, False  # (the first forward's set-up: not yet)
        if not dist.is_available() or not dist.is_initialized():
            raise errors.NoProcessGroupError(
                "DistributedDataParallel needs a process group: call "
                "torch.distributed.init_process_group(...) first (or start the script with "
                "miniddp.launch.launch / torchrun).")
        bucket_limits(bucket_cap_mb)  # reject a bad cap before any collective runs
        self.bucket_caps = bucket_limits_list(bucket_cap_mb_list)  # miniddp.buckets
        process_group = arguments.group_of(process_group, device_mesh)  # miniddp.options.arguments
        self.module = module
        # the group object itself, as torch keeps it (torch's utilities take it from here)
        self.process_group = dist.group.WORLD if process_group is None else process_group
        self.device_mesh = device_mesh
        self.forward_sync_buffers, sync_buffers_at_init = arguments.buffer_sync_flags(
            broadcast_buffers, forward_sync_buffers)  # miniddp.options.arguments
        self.bucket_cap_mb = bucket_cap_mb
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        # torch's private opt-out list: these are neither broadcast nor averaged
        self.ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        # torch's rule for buffers: whether there are any at construction decides whether
        # buffers are ever synced; each sync then reads them anew (a module may reassign a
        # buffer, or register one), as torch's _sync_buffers does.
        self._modules_buffers = self._read_buffers()
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True  # false right after a no_sync / no_grad forward

        all_params = [(name, p) for name, p in module.named_parameters()  # shared ones once
                      if name not in self.ignored]
        trainable = [(name, p) for name, p in all_params if p.requires_grad]
        if not trainable:  # torch's words first: code matches on them
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any parameter "
                "that requires a gradient: this module has no parameter that requires grad, so "
                "there is nothing to synchronize. Train it without DDP, or unfreeze a "
                "parameter.")
        devices = {p.device for _, p in all_params}
        arguments.refuse_unsupported_layers(module, devices)  # sparse, SyncBatchNorm on a CPU
        self.device = trainable[0][1].device
        self.device_ids, self.output_device = arguments.device_ids_of(device_ids, output_device,
                                                                      devices)

        if init_sync:  # torch's opt-out, for models already identical on every rank
            verify_same_shapes(all_params, process_group)
            broadcast_from_rank0([p.detach() for _, p in all_params], process_group)
            buffers = self._buffers_to_sync()
            if sync_buffers_at_init and buffers:
                broadcast_from_rank0(buffers, process_group)

        self.reducer = self._make_reducer()
        self.logger = DDPLogging(self)  # _get_ddp_logging_data() (miniddp.options.logging_data)
        self.static_graph = False
        if static_graph:  # miniddp.options.static_graph
            self._set_static_graph(initial_buckets=True)

    def _make_reducer(self) -> Reducer:
        """The reducer for the trainable parameters DDP manages (at construction, and in a
        copy: ``miniddp.options.pickling``)."""
        trainable = [(name, p) for name, p in self.module.named_parameters()
                     if p.requires_grad and name not in self.ignored]
        reducer = self.reducer_class(
            [p for _, p in trainable], [name for name, _ in trainable], self.process_group,
            self.bucket_cap_mb, self.find_unused_parameters, self.gradient_as_bucket_view,
            self.overlap, bucket_caps=self.bucket_caps)
        self.bucket_bytes_cap = max(self.bucket_caps or [reducer.bucket_bytes])
        if self.batched_grad_copy:  # miniddp.options.batched_copy
            reducer.batched_copy = BatchedGradCopy(reducer)
        if reducer.unused is not None:  # skip_all_reduce_unused_params (miniddp.options.unused)
            reducer.unused.skip_unused_buckets = self.skip_all_reduce_unused_params
        if self.checks is not None:  # miniddp.checks: as TORCH_DISTRIBUTED_DEBUG asks
            self.checks.to_reducer(self, reducer)
        if getattr(self, "static_graph", False):  # a copy of a static-graph DDP
            StaticGraph.attach(reducer, initial_buckets=True)
        return reducer

    def _read_buffers(self) -> dict[str, torch.Tensor]:
        """The module's buffers now (a tensor registered under two names once), but ignored."""
        return {name: b for name, b in self.module.named_buffers() if name not in self.ignored}

    def _buffers_to_sync(self) -> list[torch.Tensor]:
        if self._modules_buffers:  # none at construction: never (torch's will_sync_module_buffers)
            self._modules_buffers = self._read_buffers()
        return list(self._modules_buffers.values())

    @property
    def broadcast_buffers(self) -> bool:
        """torch's older name (deprecated in 2.13) for ``forward_sync_buffers``."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def __getstate__(self):
        return pickling.state_to_copy(self)

    def __setstate__(self, state):
        pickling.restore_copy(self, state)

    @property
    def buckets(self) -> list[BucketInfo]:
        """The current buckets, in the order their all_reduces are launched."""
        return self.reducer.bucket_info()

    @property
    def _has_rebuilt_buckets(self) -> bool:
        """torch's flag: the buckets have been rebuilt (read by torch's ``hook_with_zero_step``
        and ``miniddp.optim``'s, which wait for the final buckets)."""
        return self.reducer.has_rebuilt

    @property
    def allreduce_calls(self) -> int:
        """All_reduce calls made by the backward of the last forward with grad enabled: one
        per bucket after a synced forward, 0 after a forward inside ``no_sync``."""
        return self.reducer.allreduce_calls

    def _set_static_graph(self, initial_buckets: bool = False) -> None:
        """Turn ``static_graph`` on after construction, before the first forward (torch's
        older way, still used by some libraries). See ``miniddp.options.static_graph``."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again: it is "
                          "on, and this call changes nothing.", stacklevel=2)
            return
        try:
            StaticGraph.attach(self.reducer, initial_buckets)
        except RuntimeError as error:
            self.logger.set_error(error)  # _get_ddp_logging_data()["error"], as torch
            raise
        self.static_graph = True
        self.logger.set_static_graph()
        if self.find_unused_parameters:
            warnings.warn("You passed find_unused_parameters=true to DistributedDataParallel, "
                          "`_set_static_graph` will detect unused parameters automatically: "
                          "those unused in the first iteration are found then, and must stay "
                          "unused.", stacklevel=2)

    def trace(self, all_ranks: bool = False):
        """Record the reducer's events inside a ``with`` block: see :mod:`miniddp.checks.trace`."""
        return self._checks().trace(self, all_ranks)

    def register_comm_hook(self, state: object, hook) -> None:  # see miniddp.options.comm_hooks
        """Reduce each bucket with ``hook(state, bucket) -> torch.futures.Future`` instead of
        the all_reduce of ``grad * (1 / world_size)``: torch's hooks
        (``torch.distributed.algorithms.ddp_comm_hooks``) or your own. Once per model; the hook
        does its own averaging."""
        comm_hooks.register(self, state, hook)

    def check_every(self, steps: int | None, detail: bool = False) -> None:
        """Compare every rank's step, and every ``steps`` steps its parameters; raise on every
        rank when they differ (see ``miniddp.checks.consistency``). ``detail=True`` also compares
        each collective before it is launched. ``None`` switches the checks off. Call it at
        the same point on every rank."""
        self._checks().check_every(self, steps, detail)

    def _checks(self):
        if self.checks is None:
            raise RuntimeError("miniddp.checks is not loaded: import miniddp (the package) "
                               "rather than loading miniddp/ddp.py on its own.")
        return self.checks

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the forward must run inside the context.

        The flag is read at forward time (as in torch): a forward inside ``no_sync`` followed by
        a backward outside it does not synchronize. The first synced backward afterwards
        averages the whole accumulated gradient once.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # ----- uneven inputs (miniddp.options.join): torch's Joinable interface -----

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False):
        """A context manager around the training loop for ranks with different numbers of
        batches: those that finish first shadow the others' collectives. See
        miniddp.options.join."""
        return join_context(self, divide_by_initial_world_size, enable,
                            throw_on_early_termination)

    def join_hook(self, **kwargs):
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        return self.process_group

    def forward(self, *inputs, **kwargs):
        if compiled.tracing():  # torch.compile(ddp): see miniddp.options.compiled
            return compiled.forward(self, inputs, kwargs)
        inputs, kwargs = self._pre_forward(*inputs, **kwargs)
        with compiled.inside_forward(self):  # a compiled module is split at our buckets
            output = self.module(*inputs, **kwargs)
        return self._post_forward(output)

    def _pre_forward(self, *inputs, **kwargs):
        """Before the module runs: the join notice, the bucket rebuild, the buffer broadcast;
        returns the inputs, moved to the module's GPU if it has one."""
        if not self._lazy_init_ran:  # optimizers applied in backward, taken over as torch's
            optimizer_in_backward.take_over(self)  # (miniddp.options.optimizer_in_backward)
        notify_still_training(self)  # miniddp.options.join: joined ranks shadow this step
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            if self.require_backward_grad_sync:  # times the step when sampled
                self.logger.at_synced_forward(self.reducer)  # (miniddp.options.logging_data)
            self.reducer.begin_forward()
        checks = self.reducer.consistency  # miniddp.checks
        if grad_enabled and checks is not None:
            checks.at_forward(self.require_backward_grad_sync)
        if (self.will_sync_module_buffers()  # (torch's rule: miniddp.options.torch_private)
                and not self._run_buffer_hook(BufferCommHookLocation.PRE_FORWARD)):
            buffers = self._buffers_to_sync()
            if buffers:  # from rank 0, or under join the last rank training (miniddp.options.join)
                if checks is not None:
                    checks.before_collective("the broadcast of buffers", None, buffers)
                broadcast_from(buffers, buffer_source(self), self.process_group)
        announce_backward_sync(self)  # miniddp.options.join
        if self.device_ids:
            device = torch.device("cuda", self.device_ids[0])
            inputs, kwargs = move_to(inputs, device), move_to(kwargs, device)
        return inputs, kwargs

    def _post_forward(self, output):
        """After the module ran: a buffer hook registered to run now (torch_private); when a
        synced backward will follow, prepare the reducer."""
        grad_enabled = torch.is_grad_enabled()
        if self.will_sync_module_buffers():
            self._run_buffer_hook(BufferCommHookLocation.POST_FORWARD)
        sync = grad_enabled and self.require_backward_grad_sync
        self.require_forward_param_sync = sync
        if sync:
            output = self.reducer.prepare_for_backward(output)
        elif grad_enabled:  # inside no_sync: watched all the same (see the reducer)
            output = self.reducer.outputs_of_unsynced_forward(output)
        return output
