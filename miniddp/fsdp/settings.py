"""The rest of torch's ``FSDPModule`` methods: a unit's prefetching, its gradient reduction's
settings, recovery after an exception, and those that need an accelerator or NCCL.

:class:`UnitSettings` is the base of ``api.FSDPModule``, and itself a subclass of torch's
``FSDPModule`` where torch has one, so that ``isinstance(m, torch.distributed.fsdp.FSDPModule)``
holds for miniddp's sharded modules (frameworks check it). Every public method of torch's class
is overridden here or in ``api``, so none of torch's machinery is reached through it; the one
private method torch's own helpers call, ``_get_fsdp_state``, gives miniddp's ``FSDPState``,
whose ``_pre_forward`` and ``_post_forward`` take torch's arguments (torch's
``register_fsdp_forward_method`` calls them).

What each does on CPU and gloo, as torch's does there (measured against torch 2.13):

* changes which collectives run or what they compute: ``set_modules_to_forward_prefetch``,
  ``set_modules_to_backward_prefetch`` (when units gather, never the bits),
  ``set_unshard_in_backward``, ``set_reduce_scatter_unused_params``,
  ``set_gradient_divide_factor`` (refused at the backward when it needs ``PREMUL_SUM``, which
  gloo lacks), ``set_force_sum_reduction_for_comms``, ``set_all_reduce_hook``,
  ``set_is_last_backward``, ``reset_iter_state``, ``set_custom_all_gather`` and
  ``set_custom_reduce_scatter`` (torch's ``AllGather`` and ``ReduceScatter``, called as torch
  calls them);
* accepted, and change nothing on CPU (they order CUDA streams or choose buffers and
  communicators, not values): ``set_post_optim_event``, ``set_reduce_scatter_max_input_buffers``,
  ``set_separate_reduce_scatter_group``, ``set_allocate_memory_from_process_group_for_comm``;
* refused: ``set_symm_mem_for_comm`` (NCCL's symmetric memory).
"""

from __future__ import annotations

import functools

from torch import nn

try:
    from torch.distributed.fsdp import FSDPModule as TORCH_FSDP_MODULE
except ImportError:  # torch before 2.6 exports it from here only, or not at all
    try:
        from torch.distributed._composable.fsdp import FSDPModule as TORCH_FSDP_MODULE
    except ImportError:
        TORCH_FSDP_MODULE = object


def _units(module: nn.Module, recurse: bool) -> list:
    modules = module.modules() if recurse else [module]
    return [m._fsdp_state for m in modules if hasattr(m, "_fsdp_state")]


def _groups(module: nn.Module, recurse: bool = False) -> list:
    return [s.group for s in _units(module, recurse) if s.group is not None]


def _states_of(modules) -> list:
    modules = list(modules)
    for m in modules:
        if not hasattr(m, "_fsdp_state"):
            raise ValueError(f"Expects FSDPModule but got {type(m)}: {m}")
    return [m._fsdp_state for m in modules]


class UnitSettings(TORCH_FSDP_MODULE):
    """torch's ``FSDPModule`` methods beyond ``api.FSDPModule``'s, on miniddp's unit."""

    def _get_fsdp_state(self):
        return self._fsdp_state

    def _apply(self, *args, **kwargs):  # torch's would reach for its own FSDP state
        return super(TORCH_FSDP_MODULE, self)._apply(*args, **kwargs)

    # ----- when units gather -----

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        """In this unit's pre-forward, after its own gather, all-gather these units' parameters
        (their copy-out waits for their own forward). Changes when they gather, not a bit."""
        self._fsdp_state.forward_prefetch = _states_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        """In this unit's pre-backward, all-gather these units' parameters, in place of the
        default (the unit whose forward ran just before this one's)."""
        self._fsdp_state.backward_prefetch = _states_of(modules)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: the backward needs none of this unit's parameters (an embedding's):
        they are not gathered for it."""
        for group in _groups(self):
            group.unshard_in_backward = unshard_in_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """``False``: the next backward is not the step's last (micro-batches); the forward
        order the default backward prefetch follows is kept past its end."""
        self._fsdp_state.ctx.is_last_backward = is_last_backward

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: call on the root, then train on
        (the failed iteration's gradients are dropped). See ``FSDPState.reset_iter_state``."""
        self._fsdp_state.reset_iter_state()

    # ----- the gradient reduction -----

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """``True``: a parameter that got no gradient reduces zeros, so that ranks that used
        different parameters still make the same collectives."""
        for group in _groups(self, recurse):
            group.reduce_unused = reduce_scatter_unused_params

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the ranks' count. On gloo only
        a factor equal to the shard group's size, or with
        :meth:`set_force_sum_reduction_for_comms`, can run (``collectives.divide_factors``)."""
        for group in _groups(self):
            group.reduce_settings["factor"] = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in torch: :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Sum in every collective and divide afterwards (on gloo, AVG is that already: the bits
        change only with a divide factor or under HSDP, as torch's)."""
        for group in _groups(self):
            group.reduce_settings["force_sum"] = enable

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """``hook(row)`` on each reduced gradient row of this unit, after the reduce-scatter
        (under HSDP, after the all-reduce), before the last division."""
        for group in _groups(self):
            if stream is not None and group.mesh.replicate_group is not None:
                raise ValueError("stream cannot be set when using native HSDP")
            group.reduce_settings["hook"] = hook

    def set_custom_all_gather(self, comm) -> None:
        """torch's ``AllGather`` (``allocate`` and a call) in place of this unit's all-gather,
        given the buffers torch gives it (``collectives.all_gather_params``)."""
        for group in _groups(self):
            group.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm) -> None:
        """torch's ``ReduceScatter`` in place of this unit's reduce-scatter, given the buffers
        and the op torch gives it (``collectives.average``)."""
        for group in _groups(self):
            group.reduce_settings["reduce_scatter"] = comm

    # ----- nothing to change on CPU: streams, buffers, communicators -----

    def set_post_optim_event(self, event) -> None:
        """torch's root orders its CUDA streams after ``event``; on CPU there are none."""

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """How many reduce-scatter inputs a GPU keeps in flight; miniddp's reduce is
        synchronous: one. Checked as torch checks it."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError("max_input_buffers must be an int, got "
                            f"{type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """A communicator of its own for the reduce-scatter, to overlap it with all-gathers on
        a GPU; miniddp's collectives run one at a time, so one group serves both."""

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """The process group's allocator for the collectives' buffers (NCCL's zero-copy);
        gloo has none of its own, and torch's then allocates as before."""

    # ----- refused -----

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        raise RuntimeError(
            "set_symm_mem_for_comm: symmetric memory needs NCCL on a GPU (torch's fails on "
            "gloo: 'SymmetricMemory does not find allocation backend NCCL'); leave it out on "
            "CPU.")



def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.method_name`` a forward for FSDP, as torch's function of that name does:
    the unit's pre-forward (gather) before it, its post-forward (reshard, and the backward's
    hooks) after. Does nothing to a module that is not a unit. (torch's own function does the
    same to miniddp's units, through ``_get_fsdp_state``.)"""
    state = getattr(module, "_fsdp_state", None)
    if state is None:
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        args, kwargs = state._pre_forward(self, args, kwargs)
        return state._post_forward(self, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped.__get__(module, type(module)))
