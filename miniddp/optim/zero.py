"""``miniddp.ZeroRedundancyOptimizer``: ZeRO stage 1, torch's ``ZeroRedundancyOptimizer`` bit
for bit.

DDP keeps the whole optimizer state on every rank: with Adam, two moments per parameter, twice
the model. After the gradients are averaged every rank holds the same gradients and would take
the same step, so each rank only needs to step (and keep the state of) a share of the
parameters, and send the result to the others. One step:

1. the gradients are already averaged (DDP did it during backward);
2. each rank's local optimizer steps the parameters it owns (``miniddp.optim.partition`` says
   which: torch's greedy partition by size);
3. every owner broadcasts its updated parameters, one by one, or one flat bucket per rank and
   device with ``parameters_as_bucket_view=True`` (then ``param.data`` are views of it).

The optimizer state per rank shrinks to about 1/world_size; the parameters and gradients do not
(that is ZeRO stages 2 and 3). With ``overlap_with_ddp=True`` the step runs inside DDP's
backward instead, one gradient bucket at a time (``miniddp.optim.overlap``). While
torch.profiler records, the trace shows each step's ``miniddp.zero.local_step``, every
``miniddp.zero.broadcast`` (whose share, how many bytes) and the ``miniddp.zero.wait``.
``consolidate_state_dict`` / ``state_dict`` / ``load_state_dict``: ``miniddp.optim.state``.

One module because it is one class, torch's public ``ZeroRedundancyOptimizer``, whose
methods share its partition and buckets; who owns what (``partition``), its state dicts
(``state``) and the step inside DDP's backward (``overlap``) live apart.
"""

from __future__ import annotations

import inspect
import logging
import operator
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from miniddp import profiling
from miniddp.optim import checks, state
from miniddp.optim.overlap import Overlap
from miniddp.optim.partition import flatten_into_views, greedy_by_size
from miniddp.sync import held

logger = logging.getLogger(__name__)


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Wrap ``optimizer_class`` so that each rank keeps the state of, and steps, only its share
    of ``params``; after :meth:`step` every rank has every updated parameter.

    The arguments are torch's: ``process_group`` (default: the world), ``parameters_as_bucket_view``
    (parameters become views of one flat tensor per rank and device, so each rank's share is
    sent in one broadcast), ``overlap_with_ddp`` (step during DDP's backward through
    :func:`miniddp.optim.hook_with_zero_step` or ``hook_with_zero_step_interleaved``; then
    :meth:`step` does nothing) and ``**defaults`` (passed to ``optimizer_class``). Every rank
    must build it, and call :meth:`add_param_group`, with the same parameters in the same order:
    it checks.
    """

    def __init__(self, params, optimizer_class: type[Optimizer], process_group: Any = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 **defaults: Any):
        params, self._all_params = checks.parameters(params)
        self._group = held(process_group)  # None for the default group (see held)
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.global_rank = dist.get_global_rank(self.process_group, self.rank)
        self._overlap_with_ddp = overlap_with_ddp
        self._optim_constructor = checks.optimizer_class(optimizer_class, overlap_with_ddp)
        self._optim_defaults = defaults
        self.initialized = False  # Optimizer.__init__ calls add_param_group: not ours yet
        Optimizer.__init__(self, params, defaults)
        Joinable.__init__(self)
        checks.ranks_agree(self.param_groups, self.process_group, "at construction")
        self._partition: list[list[dict]] | None = None
        self._is_trainable_mask = self._trainable_mask()
        self._default_device = self._all_params[0].device
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self._buckets: list[list[torch.Tensor]] = []
        self._all_state_dicts: list[dict] = []
        if overlap_with_ddp:
            self._overlap = Overlap(self)  # the local optimizer comes at the third backward
            if parameters_as_bucket_view:
                logger.warning("`parameters_as_bucket_view=True` will be ignored since "
                               "`overlap_with_ddp=True`; instead, a different bucketing "
                               "strategy will be used")
        else:
            self._init_local_optimizer()
            self._build_param_buckets()
        self.initialized = True

    # ----- who owns what -----

    def _partition_parameters(self) -> list[list[dict]]:
        """``[rank][group]``: each rank's share of each parameter group (torch's partition)."""
        if self._partition is None:
            self._partition = greedy_by_size(self.param_groups, self.world_size)
        return self._partition

    @property
    def _param_to_rank(self) -> dict[torch.Tensor, int]:
        return {p: rank for rank, groups in enumerate(self._partition_parameters())
                for group in groups for p in group["params"]}

    @property
    def _index_to_param(self) -> list[torch.Tensor]:
        return list(chain.from_iterable(g["params"] for g in self.param_groups))

    def _init_local_optimizer(self) -> None:
        mine = self._partition_parameters()[self.rank]
        if self._overlap_with_ddp:  # a functional optimizer: one group, gradients passed in
            extra = ({"_allow_empty_param_list": True} if "_allow_empty_param_list"
                     in inspect.signature(self._optim_constructor).parameters else {})
            self.optim = self._optim_constructor(mine[0]["params"], **self._optim_defaults,
                                                 **extra)
            self.optim.param_groups = [self.optim.param_group]
        else:  # given as groups, an empty share is allowed
            self.optim = self._optim_constructor(mine, **self._optim_defaults)
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for p in self._all_params]

    # ----- the step -----

    def step(self, closure=None, **kwargs):
        """Step this rank's share (``closure`` re-evaluates the loss, as for any optimizer),
        then send every share to every rank. Returns the local optimizer's loss."""
        if self._overlap_with_ddp:
            logger.warning("`step()` should not be included in the training loop when "
                           "`overlap_with_ddp=True`")
            return None
        on = profiling.recording()  # spans in the profiler's trace, if one records
        with profiling.span(on and f"miniddp.zero.local_step rank {self.rank}"):
            loss = self._local_step(closure=closure, **kwargs)
        self._sync_params(on)
        return loss

    def _local_step(self, gradients=None, closure=None, **kwargs):
        """Step this rank's share only. ``gradients`` (with ``overlap_with_ddp``): one per owned
        parameter, ``None`` for those this call leaves alone."""
        Join.notify_join_context(self)
        mask = self._trainable_mask()
        if mask != self._is_trainable_mask:
            if self._overlap_with_ddp:
                raise RuntimeError("ZeroRedundancyOptimizer with `overlap_with_ddp=True` does "
                                   "not support changing parameter trainability at run time")
            logger.warning("ZeroRedundancyOptimizer detected that the trainable parameters "
                           "changed; rebuilding the parameter buckets if enabled")  # as torch
            self._build_param_buckets()
            self._is_trainable_mask = mask
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)  # e.g. a scheduler's lr
        if gradients is not None:
            loss = self.optim.step(gradients=gradients)
        elif closure is not None:
            loss = self.optim.step(closure=closure, **kwargs)
        else:
            loss = self.optim.step(**kwargs)
        _copy_hyperparameters(self.optim.param_groups, self.param_groups)
        return loss

    def _sync_params(self, profiled: bool = False) -> None:
        """Every rank broadcasts its share (rank 0's first), all at once, then waits. The
        broadcasts only copy, so neither their order nor their grouping changes a bit; torch's
        are kept all the same: rank by rank, parameter by parameter (or one flat bucket per
        device with ``parameters_as_bucket_view``). ``profiled``: a span for each broadcast (its
tensor ``k``: the ``k``-th parameter of that rank's share, or its bucket on the ``k``-th
device), and one for the waits."""
        handles = []
        for rank in range(self.world_size):
            src = dist.get_global_rank(self.process_group, rank)
            if self.parameters_as_bucket_view:
                tensors = [per_rank[rank] for per_rank in self._buckets]
            else:
                tensors = [p.data for g in self._partition_parameters()[rank] for p in g["params"]]
            for k, t in enumerate(tensors):
                with profiling.span(profiled and f"miniddp.zero.broadcast rank {rank} tensor "
                                    f"{k} ({t.numel() * t.element_size()} bytes)"):
                    handles.append(dist.broadcast(t, src=src, group=self.process_group,
                                                  async_op=True))
        with profiling.span(profiled and f"miniddp.zero.wait {len(handles)} broadcasts"):
            for handle in handles:
                handle.wait()

    def _build_param_buckets(self) -> None:
        """``parameters_as_bucket_view``: one flat tensor per device and rank holding that
        rank's trainable parameters, whose ``param.data`` become views of it. A frozen one gets
        its own copy back (it is not sent); a rank with nothing there sends one float."""
        if not self.parameters_as_bucket_view or self._overlap_with_ddp:
            return
        per_device: dict[torch.device, list[list[torch.Tensor]]] = {}
        for rank, groups in enumerate(self._partition_parameters()):
            for p in (p for g in groups for p in g["params"]):
                per_device.setdefault(p.device, [[] for _ in range(self.world_size)])
                per_device[p.device][rank].append(p)
        self._buckets = []
        for device, per_rank in per_device.items():
            self._buckets.append([])
            for params in per_rank:
                for p in params:
                    if not p.requires_grad:
                        p.data = p.data.detach().clone()
                trainable = [p for p in params if p.requires_grad]
                if not trainable:
                    self._buckets[-1].append(torch.zeros(1, device=device))
                    continue
                self._buckets[-1].append(flatten_into_views(trainable))

    # ----- groups -----

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (on every rank alike); its parameters are shared out as torch does, and
        the ones already there keep their owner."""
        if self.initialized and self._overlap_with_ddp:
            raise RuntimeError("ZeroRedundancyOptimizer with `overlap_with_ddp=True` only "
                               "supports a single parameter group")
        super().add_param_group(param_group)
        if not self.initialized:
            return
        self._all_params += [p for p in self.param_groups[-1]["params"]]
        checks.ranks_agree(self.param_groups, self.process_group, "after add_param_group")
        self._partition = None
        mine = self._partition_parameters()[self.rank]
        if len(mine) == len(self.optim.param_groups) + 1:
            self.optim.add_param_group(mine[-1])
        self._is_trainable_mask = self._trainable_mask()
        if self.parameters_as_bucket_view:
            self._build_param_buckets()

    # ----- checkpoints (miniddp.optim.state) -----

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's share of the state on rank ``to`` (a rank of the group), for
        :meth:`state_dict` there. Every rank must call it."""
        self._check_initialized()
        # An int or an integer such as numpy's; like torch, which compares it with ==, also a
        # number equal to one (0.0).
        to = int(to) if isinstance(to, float) and to.is_integer() else operator.index(to)
        if not 0 <= to < self.world_size:  # (torch gathers nowhere and says nothing)
            raise ValueError(f"consolidate_state_dict(to={to!r}): `to` is a rank of the "
                             f"optimizer's process group, an int in [0, {self.world_size - 1}]")
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)
        self._all_state_dicts = state.gather_local_states(
            state.local_state_dict(self.optim), to, self.rank, self.world_size, self.process_group)

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state as of the last :meth:`consolidate_state_dict` to this
        rank, numbered as one un-sharded optimizer would number it."""
        self._check_initialized()
        if not self._all_state_dicts:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Please call "
                f"`consolidate_state_dict(to={self.rank})` on all ranks beforehand if you "
                "meant to save the global state.")
        index_of = {p: i for i, p in enumerate(self._index_to_param)}
        return state.merge(super().state_dict(), self._all_state_dicts,
                           self._partition_parameters(), index_of)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole state (from :meth:`state_dict`, on every rank): each rank keeps the
        states of the parameters it owns. The given dict is left as it was."""
        self._check_initialized()
        kept = state.load_into(self.optim, state_dict, self._index_to_param,
                               self._param_to_rank, self.rank)
        super().load_state_dict(kept)
        _copy_hyperparameters(state_dict["param_groups"], self.param_groups)
        _copy_hyperparameters(self.param_groups, self.optim.param_groups)

    def _check_initialized(self) -> None:
        if self._overlap_with_ddp and not self._overlap.ready:
            raise RuntimeError(
                "This method should not be called until this ZeroRedundancyOptimizer instance "
                "has been fully initialized (with overlap_with_ddp=True, at the third backward "
                "through DDP with the hook from hook_with_zero_step)")

    # ----- uneven inputs: torch's Join -----

    def join_hook(self, **kwargs) -> JoinHook:
        """Under ``Join``, a rank out of data still steps its share and sends it."""
        return _StepWhenJoined(self)

    @property
    def join_device(self) -> torch.device:
        return self._default_device

    @property
    def process_group(self):
        """The group the optimizer state is sharded over, as torch's attribute."""
        return dist.group.WORLD if self._group is None else self._group

    @property
    def join_process_group(self):
        return self.process_group


def _torchs_signature(init):
    """torch's own signature for ``init`` (the same names, order, kinds and defaults, and
    torch's annotations), so that code inspecting the constructor sees torch's; ``init``'s own
    if the installed torch's differs."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    ours, torchs = inspect.signature(init), inspect.signature(TorchZero.__init__)
    same = [(p.name, p.kind, p.default) for p in ours.parameters.values()] == \
        [(p.name, p.kind, p.default) for p in torchs.parameters.values()]
    init.__signature__ = torchs if same else ours


_torchs_signature(ZeroRedundancyOptimizer.__init__)


class _StepWhenJoined(JoinHook):
    def __init__(self, zero: ZeroRedundancyOptimizer):
        self.zero = zero

    def main_hook(self) -> None:
        self.zero.step()


def _copy_hyperparameters(sources: list[dict], destinations: list[dict]) -> None:
    """Copy every key but ``params`` group by group (lr changed by a scheduler, or loaded)."""
    if len(sources) != len(destinations):
        raise AssertionError("Mismatch between number of source and destination parameter "
                             "groups")
    for source, destination in zip(sources, destinations):
        for key, value in source.items():
            if key != "params":
                destination[key] = value

