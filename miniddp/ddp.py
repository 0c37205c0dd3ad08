"""``miniddp.DistributedDataParallel``: torch's DDP, rebuilt in readable Python.

Same constructor arguments, same meanings and the same bits as
``torch.nn.parallel.DistributedDataParallel``, so swapping the import in a working script
changes nothing else.

The class is composed here: the engine's :class:`~miniddp.core.CoreDDP` (construction,
forward, the reducer's backward), with torch's compatibility (``miniddp.compat``: the private
attributes and methods torch's own code reads, torch's argument binding, logging data,
pickling, the compiler's hooks) and torch's ``Joinable`` interface mixed in; DDP's options
(``miniddp.options``: ``find_unused_parameters``, ``gradient_as_bucket_view``,
``static_graph``, comm hooks, ``join``) and the checks (``miniddp.checks``) attached to the
reducer at construction. The engine imports none of this.
"""

from __future__ import annotations

import warnings

from torch import nn
from torch.distributed.algorithms.join import Joinable

from miniddp.buckets import bucket_limits_list
from miniddp.checks import consistency
from miniddp.checks.trace import trace_backward
from miniddp.compat import arguments, compiled, logging_data, optimizer_in_backward, pickling
from miniddp.compat.torch_private import TorchPrivateDDP, TorchReducer
from miniddp.core import CoreDDP, move_to
from miniddp.options import comm_hooks, create_graph
from miniddp.options.gradient_views import GradientsAsBucketViews
from miniddp.options.join import DDPJoinHook, join_context
from miniddp.options.static_graph import StaticGraph
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
    the installed torch's, in torch's order, with its defaults (``miniddp.compat.arguments``; the
    README's "torch's constructor arguments" says which work and which are refused).
    Parameters and buffers named by torch's
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)`` are
    neither broadcast nor averaged. ``copy.deepcopy`` and pickling work as torch's
    (``miniddp.compat.pickling``). torch's private attributes and methods that torch's tests,
    compiler and libraries read (``_get_ddp_logging_data()``, buffer hooks, ...) come from
    ``miniddp.compat.torch_private``.

    Subclasses change how gradients are reduced by swapping ``reducer_class`` (the bucket
    layout) or ``overlap`` (launch during backward, or only after it); see
    ``miniddp.baselines.naive``.
    """

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
        forward_sync, sync_at_init = arguments.buffer_sync_flags(broadcast_buffers,
                                                                 forward_sync_buffers)
        super().__init__(
            module, device_ids=device_ids, output_device=output_device, init_sync=init_sync,
            process_group=arguments.group_of(process_group, device_mesh),
            bucket_cap_mb=bucket_cap_mb, bucket_caps=bucket_limits_list(bucket_cap_mb_list),
            find_unused_parameters=find_unused_parameters, forward_sync_buffers=forward_sync,
            sync_buffers_at_init=sync_at_init, batched_copy=batched_grad_copy,
            views=GradientsAsBucketViews() if gradient_as_bucket_view else None)
        Joinable.__init__(self)  # outside a join context, join does nothing
        # dim (for single-process DataParallel) and check_reduction: accepted, unused, as torch
        self.dim, self._lazy_init_ran = dim, False  # (the first forward's set-up: not yet)
        self.before_forward.append(optimizer_in_backward.at_first_forward)
        self.device_mesh = device_mesh
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = False
        self._attach_options(self.reducer)
        self.logger = logging_data.DDPLogging(self)
        if static_graph:
            self._set_static_graph(initial_buckets=True)

    def check_devices(self, device_ids, output_device, devices: set):
        """torch's rules for ``device_ids`` and the layers it refuses (sparse gradients,
        SyncBatchNorm on a CPU): ``miniddp.compat.arguments``."""
        arguments.refuse_unsupported_layers(self.module, devices)
        return arguments.device_ids_of(device_ids, output_device, devices)

    def _attach_options(self, reducer) -> None:
        """DDP's options and the checks onto a new reducer (at construction, and in a copy:
        ``miniddp.compat.pickling``)."""
        reducer.attach(graph_gradients=create_graph)
        if self.find_unused_parameters:
            unused = UnusedParameters(reducer.params, reducer.group)
            unused.skip_unused_buckets = self.skip_all_reduce_unused_params
            reducer.attach(unused=unused)
        consistency.attach(self, reducer)  # the checks TORCH_DISTRIBUTED_DEBUG asks for
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
        return trace_backward(self, all_ranks)

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
        consistency.check_every(self, steps, detail)

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

