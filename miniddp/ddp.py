"""``miniddp.DistributedDataParallel``: torch's DDP, rebuilt in readable Python.

Same constructor arguments, same meanings and the same bits as
``torch.nn.parallel.DistributedDataParallel``, so swapping the import in a working script
changes nothing else.

The class is composed here: the engine's :class:`~miniddp.core.CoreDDP` (the plain path:
construction, forward, the reducer's backward), with torch's compatibility
(:class:`~miniddp.options.torch_private.TorchPrivateDDP`: the private attributes and methods
torch's own code reads; torch's argument binding, logging data, pickling, the compiler's hooks)
and torch's ``Joinable`` interface mixed in, and DDP's options attached to the engine's seams
at construction (``find_unused_parameters``, ``gradient_as_bucket_view``, ``static_graph``,
``batched_grad_copy``, comm hooks, ``join``). The engine imports none of this.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable

from miniddp import errors
from miniddp.buckets import bucket_limits, bucket_limits_list
from miniddp.core import CoreDDP, move_to
from miniddp.options import (
    arguments,
    comm_hooks,
    compiled,
    create_graph,
    logging_data,
    optimizer_in_backward,
    pickling,
    seamed_steps,  # noqa: F401  (attaches the reducer's steps through its seams)
)
from miniddp.options.batched_copy import BatchedGradCopy
from miniddp.options.gradient_views import GradientsAsBucketViews
from miniddp.options.join import DDPJoinHook, join_context
from miniddp.options.logging_data import DDPLogging
from miniddp.options.static_graph import StaticGraph
from miniddp.options.torch_private import TorchPrivateDDP, TorchReducer
from miniddp.options.unused import UnusedParameters

__all__ = ["DistributedDataParallel", "move_to"]


class DistributedDataParallel(TorchPrivateDDP, CoreDDP, Joinable):
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

    #: The checks and traces attach here: ``miniddp.checks`` sets it when ``miniddp`` is
    #: imported. None: no checks, no trace.
    checks = None
    reducer_class = TorchReducer
    traced_forward = compiled.forward
    active_module_holder = compiled.torch_ddp_class()
    explain_assertion = staticmethod(compiled.explain_assertion)
    #: torch's compiler asks DDP's class for the module whose forward is running; asked of
    #: this class too, the answer is the same
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
        arguments.refuse_unsupported(delay_all_reduce_named_params, param_to_hook_all_reduce,
                                     mixed_precision)
        arguments.warn_check_reduction(check_reduction)
        if not dist.is_available() or not dist.is_initialized():
            raise errors.no_process_group()
        bucket_limits(bucket_cap_mb)  # reject a bad cap before any collective runs
        bucket_caps = bucket_limits_list(bucket_cap_mb_list)
        process_group = arguments.group_of(process_group, device_mesh)
        forward_sync, sync_at_init = arguments.buffer_sync_flags(broadcast_buffers,
                                                                 forward_sync_buffers)
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        params = [p for name, p in module.named_parameters() if name not in ignored]
        if not any(p.requires_grad for p in params):
            raise errors.nothing_to_synchronize()
        devices = {p.device for p in params}
        arguments.refuse_unsupported_layers(module, devices)  # sparse, SyncBatchNorm on a CPU
        device_ids, output_device = arguments.device_ids_of(device_ids, output_device, devices)
        super().__init__(module, device_ids, output_device, init_sync, process_group,
                         bucket_cap_mb, find_unused_parameters, bucket_caps, forward_sync,
                         sync_at_init, views=GradientsAsBucketViews() if gradient_as_bucket_view
                         else None)
        Joinable.__init__(self)  # outside a join context, join does nothing
        # dim (for single-process DataParallel) and check_reduction: accepted, unused, as torch
        self.dim, self._lazy_init_ran = dim, False  # (the first forward's set-up: not yet)
        self.before_forward += [optimizer_in_backward.at_first_forward, logging_data.at_forward]
        self.device_mesh = device_mesh
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = False
        self._attach_options(self.reducer)
        self.logger = DDPLogging(self)
        if static_graph:
            self._set_static_graph(initial_buckets=True)

    def _attach_options(self, reducer) -> None:
        """DDP's options and torch's compatibility onto a new reducer's seams (at construction,
        and in a copy: ``miniddp.options.pickling``)."""
        reducer.graph_gradients = create_graph
        if self.batched_grad_copy:
            reducer.batched_copy = BatchedGradCopy(reducer)
        if self.find_unused_parameters:
            reducer.unused = UnusedParameters(reducer.params, reducer.group)
            reducer.unused.skip_unused_buckets = self.skip_all_reduce_unused_params
        if self.checks is not None:  # as TORCH_DISTRIBUTED_DEBUG asks
            self.checks.to_reducer(self, reducer)
        if self.static_graph:  # a copy of a static-graph DDP
            StaticGraph.attach(reducer, initial_buckets=True)

    def __getstate__(self):
        return pickling.state_to_copy(self)

    def __setstate__(self, state):
        pickling.restore_copy(self, state)

    @property
    def _has_rebuilt_buckets(self) -> bool:
        """torch's flag: the buckets have been rebuilt (read by torch's ``hook_with_zero_step``
        and ``miniddp.optim``'s, which wait for the final buckets)."""
        return self.reducer.has_rebuilt

    @property
    def broadcast_buffers(self) -> bool:
        """torch's older name (deprecated in 2.13) for ``forward_sync_buffers``."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

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

    def register_comm_hook(self, state: object, hook) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> torch.futures.Future`` instead of
        the all_reduce of ``grad * (1 / world_size)``: torch's hooks
        (``torch.distributed.algorithms.ddp_comm_hooks``) or your own. Once per model; the hook
        does its own averaging (``miniddp.options.comm_hooks``)."""
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

    # ----- uneven inputs: torch's Joinable interface -----

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

