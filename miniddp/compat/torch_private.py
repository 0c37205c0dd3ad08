"""torch's private DDP attributes and methods, for the code that reads them.

They are not part of torch's documented API, but torch's own tests use them, and so do other
parts of torch (the compiler's DDP support, FSDP, ``_sync_module_states``) and some libraries.
Each has the meaning it has in torch, in miniddp's terms:

* ``device_type``, ``is_multi_device_module`` and ``mixed_precision`` (always None here),
  which torch's DDP has as public attributes (``will_sync_module_buffers()`` is the engine's);
* ``parameters_to_ignore`` (the names DDP leaves alone), ``broadcast_bucket_size`` (the size of
  torch's coalesced broadcasts), ``bucket_bytes_cap_list`` (``bucket_cap_mb_list`` in bytes, ``[]``
  without one), ``modules_buffers`` / ``named_module_buffers``;
* ``_build_params_for_reducer()`` and ``_build_debug_param_to_name_mapping(params)``: the
  reducer's parameters, and the index -> name map torch's errors use;
* ``_get_data_parallel_params(module)`` (static): the parameters DDP manages;
* ``_register_buffer_comm_hook(state, hook, location)``: buffers synchronized by ``hook(state,
  named_buffers)`` instead of the broadcast from rank 0, before or after forward; futures it
  returns are waited for at once (torch waits for them at the end of backward);
* ``_register_builtin_comm_hook(dist.BuiltinCommHookType.X)``: torch's C++ hooks, as
  :mod:`miniddp.options.comm_hooks` writes them in Python;
* ``_remove_autograd_hooks()``: detach the reducer from the parameters (a DDP given up after an
  error, before wrapping the module again);
* ``_set_ddp_sink_clone(False)``: outputs pass through DDP's identity function without a copy;
* ``_get_ddp_logging_data()`` and ``_set_ddp_runtime_logging_sample_rate(n)``
  (:mod:`miniddp.compat.logging_data`);
* on the reducer, ``_get_local_used_map()``: per parameter, how many ranks used it in the last
  synchronized backward (with ``find_unused_parameters`` or ``static_graph``), and
  ``_ddp_graph_static()``: whether the unused parameters have been the same every step.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist
from torch import nn

from miniddp.options import comm_hooks
from miniddp.reducer import Reducer
from miniddp.sync import broadcast_from

#: torch's enum for where a buffer hook runs (its own, when torch has it).
BufferCommHookLocation = getattr(nn.parallel.distributed, "_BufferCommHookLocation", None)
if BufferCommHookLocation is None:  # pragma: no cover (every torch miniddp supports has it)
    BufferCommHookLocation = enum.Enum("BufferCommHookLocation", "PRE_FORWARD POST_FORWARD")


class TorchPrivateDDP:
    """Mixed into ``miniddp.DistributedDataParallel``. See the module docstring."""

    #: torch's size limit of one coalesced broadcast (250 MiB); miniddp broadcasts one flat
    #: buffer per dtype, so it only matters to callers that pass it on.
    broadcast_bucket_size = 250 * 1024 * 1024
    buffer_hook = None  # set by _register_buffer_comm_hook
    _ddp_sink_clone = True

    @staticmethod
    def _get_data_parallel_params(module, named_params: bool = False):
        """The parameters of ``module`` DDP manages: those not marked ignored by
        ``_set_params_and_buffers_to_ignore_for_model`` (a generator, as torch's)."""
        for param in module.named_parameters() if named_params else module.parameters():
            if not hasattr(param, "_ddp_ignored"):
                yield param

    @property
    def parameters_to_ignore(self) -> set[str]:
        return self.ignored

    mixed_precision = None  # torch's experimental DDP-native mixed precision: refused if given

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def is_multi_device_module(self) -> bool:
        return len({p.device for name, p in self.module.named_parameters()
                    if name not in self.ignored}) > 1

    @property
    def bucket_bytes_cap_list(self) -> list[int]:
        return list(self.bucket_caps or [])

    @property
    def named_module_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers as of the last sync (or construction), as torch keeps them."""
        return dict(self._modules_buffers)

    @property
    def modules_buffers(self) -> list[torch.Tensor]:
        return list(self._modules_buffers.values())

    def _build_params_for_reducer(self):
        params = list(self.reducer.params)
        sparse = [False] * len(params)  # miniddp refuses sparse gradients at construction
        return params, sparse

    def _build_debug_param_to_name_mapping(self, parameters) -> dict[int, str]:
        """``{index in parameters: name}``; a ValueError when they are not DDP's parameters."""
        index_of = {p: i for i, p in enumerate(parameters)}
        mapping = {}
        for name, param in self.module.named_parameters():
            if name in self.ignored or not param.requires_grad:
                continue
            if param not in index_of:
                raise ValueError(f"Param with name {name} found in module parameters, but not "
                                 "DDP parameters: the list passed is not this DDP's parameters.")
            mapping[index_of[param]] = name
        if len(set(parameters)) != len(mapping):
            raise ValueError(
                "Expected param to name mapping to cover all parameters, but got conflicting "
                f"lengths: {len(set(parameters))} vs {len(mapping)}: the list passed holds "
                "parameters that this DDP does not manage.")
        return mapping

    # ----- buffers -----

    def _register_buffer_comm_hook(self, state, hook,
                                   comm_hook_location=BufferCommHookLocation.POST_FORWARD):
        """Synchronize buffers with ``hook(state, {name: buffer})`` instead of broadcasting
        rank 0's, before or after forward (``comm_hook_location``)."""
        if not callable(hook):
            raise TypeError(f"the buffer communication hook must be callable, got {hook!r}")
        self.buffer_hook = BufferHook(state, hook, comm_hook_location)

    def _default_broadcast_coalesced(self, bufs=None, bucket_size=None, authoritative_rank=0):
        """Broadcast ``bufs`` (default: the module's buffers) from ``authoritative_rank``."""
        del bucket_size  # one flat broadcast per dtype, whatever the size
        bufs = self.modules_buffers if bufs is None else bufs
        if bufs:
            broadcast_from(list(bufs), authoritative_rank, self.process_group)

    # ----- hooks, logging -----

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        """torch's C++ hooks: ``ALLREDUCE`` (divide, then sum) and ``FP16_COMPRESS``."""
        builtin = {dist.BuiltinCommHookType.ALLREDUCE: comm_hooks.allreduce,
                   dist.BuiltinCommHookType.FP16_COMPRESS: comm_hooks.fp16_compress}
        if not isinstance(comm_hook_type, dist.BuiltinCommHookType):  # a TypeError, as torch's
            raise TypeError(f"_register_builtin_comm_hook takes a "
                            f"torch.distributed.BuiltinCommHookType (ALLREDUCE or "
                            f"FP16_COMPRESS), got {comm_hook_type!r}")
        comm_hooks.register(self, self._group, builtin[comm_hook_type])
        self.reducer.comm_hook.name = str(comm_hook_type)

    def _remove_autograd_hooks(self) -> None:
        self.reducer.remove_hooks()

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """False: forward's outputs pass through DDP's identity function uncopied (saves memory;
        an in-place change to an output then fails in backward)."""
        self._ddp_sink_clone = val
        for option in (self.reducer.unused, self.reducer.static_graph):
            if option is not None:
                option.clone_outputs = val

    def _get_ddp_logging_data(self) -> dict:
        return self.logger.snapshot(self)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        self.logger.set_sample_rate(sample_rate, self.reducer)


class BufferHook:
    """The engine's ``buffer_hook``: buffers synchronized by ``hook(state, named_buffers)``
    instead of rank 0's broadcast, before or after forward; futures it returns are waited for
    at once (torch waits for them at the end of backward)."""

    def __init__(self, state, hook, location):
        self.state, self.hook, self.location = state, hook, location

    def __call__(self, ddp, before_forward: bool) -> None:
        if before_forward != (self.location == BufferCommHookLocation.PRE_FORWARD):
            return
        ddp._buffers_to_sync()  # read anew, as torch's _sync_buffers does
        futures = self.hook(self.state, ddp.named_module_buffers)
        if futures is not None:
            torch.futures.wait_all(list(futures))


class TorchReducer(Reducer):
    """The engine's reducer with torch's private reducer methods, as ``ddp.reducer``."""

    def _get_local_used_map(self) -> torch.Tensor:
        """How many ranks used each parameter in the last synchronized backward (int32)."""
        if self.unused is not None and self.unused.used_everywhere is not None:
            return self.unused.used_everywhere
        if self.static_graph is not None and self.static_graph._used_everywhere is not None:
            return self.static_graph._used_everywhere
        return torch.zeros(len(self.params), dtype=torch.int32)

    def _ddp_graph_static(self) -> bool:
        """With ``find_unused_parameters``: False once the set of unused parameters has
        changed between two steps (torch logs it, to suggest ``static_graph``)."""
        return self.unused is None or self.unused.graph_static
