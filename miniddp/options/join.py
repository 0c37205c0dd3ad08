"""Uneven inputs: ``ddp.join()``, so that ranks with fewer batches do not hang the others.

Every synchronized step is a sequence of collectives that every rank must call in the same
order: a buffer broadcast, one all_reduce per bucket, the used-parameter flags. A rank that
runs out of data leaves its training loop; the ranks still training then wait in their next
all_reduce for a partner that never comes, until the process group's timeout kills the job.

torch's answer, reproduced here call for call, is a context manager around the training loop
(``torch.distributed.algorithms.Join``, which ``ddp.join()`` returns). A rank that leaves the
loop enters ``Join.__exit__`` and, for as long as any rank still trains, *shadows* each step:
it issues the same collectives as the others, contributing zeros. The two sides of one step:

=====================================================  =========================================
a rank still training (``DistributedDataParallel``)    a rank that joined (:class:`DDPJoinHook`)
=====================================================  =========================================
"I am still here": all_reduce of 1                     all_reduce of 0: how many still train?
                                                       (0: everyone joined, leave the loop)
buffers, when synced: agree on a source rank           the same, offering no rank of its own
"my backward will synchronize": all_reduce of 1 or 0   all_reduce of 0
the bucket rebuild's broadcast, when it falls here     the same rebuild, with the same broadcast
buffers, when synced: the broadcast                    the same; skip the rest if no one
                                                       synchronizes (everyone is in ``no_sync``)
backward: one all_reduce per bucket                    one all_reduce of zeros per bucket
the used-parameter flags (``find_unused_parameters``)  its last flags, summed in again
=====================================================  =========================================

Gradients are divided by the initial world size (``divide_by_initial_world_size=True``: every
sample weighs the same) or by the number of ranks still training, which the first all_reduce
counts. The left column runs in the engine's ``before_forward`` list (:func:`before_forward`,
attached when ``ddp`` is first given to a join context), the rest in the engine's forward and
backward. When every rank has joined, the rank that joined last (the highest one if several)
broadcasts its parameters and buffers, so every replica ends equal. With
``throw_on_early_termination=True`` every rank raises instead as soon as one runs out.

Three details follow torch, for the bits: once a DDP has been in a join context (the
configuration outlives the context), buffers come from the highest rank still training, not
rank 0; a rank that joined before any bucket rebuild offers its parameters in model order for
it (rank 0's order wins, so this matters when rank 0 joined first); and its used-parameter
flags are the last ones it summed, so a parameter used by anyone before it joined counts as
used from then on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook

from miniddp.buckets import Bucket
from miniddp.sync import broadcast_from, group_rank0


def join_context(ddp, divide_by_initial_world_size: bool = True, enable: bool = True,
                 throw_on_early_termination: bool = False) -> Join:
    """What ``ddp.join(...)`` returns: torch's ``Join`` around this one DDP."""
    return Join([ddp], enable, throw_on_early_termination,
                divide_by_initial_world_size=divide_by_initial_world_size)


class DDPJoinHook(JoinHook):
    """What a rank that ran out of data does for ``ddp`` while others still train."""

    def __init__(self, ddp, divide_by_initial_world_size: bool = True):
        super().__init__()
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size
        ddp.logger.data["join_uneven_inputs"] = 1  # _get_ddp_logging_data(), as torch's
        if before_forward not in ddp.before_forward:
            ddp.before_forward.append(before_forward)

    def main_hook(self) -> None:
        """Shadow one step of the ranks still training (after ``Join`` counted them)."""
        ddp, reducer = self.ddp, self.ddp.reducer
        source = _common_rank(ddp, candidate=False) if _syncs_buffers(ddp) else None
        flag, work = _all_reduce_flag(ddp, False)
        reducer.begin_forward()  # the bucket rebuild, with its broadcast, if it is due
        if source is not None:  # as at a forward of the ranks still training
            broadcast_from(ddp._buffers_to_sync(), source, ddp.process_group)
        work.wait()
        someone_syncs = flag.item() > 0
        ddp.require_forward_param_sync = someone_syncs
        if not someone_syncs:
            return
        _shadow_buckets(reducer)
        if reducer.unused is not None:
            _shadow_used_flags(reducer)
        if reducer.should_rebuild and not reducer.ready_order:
            reducer.ready_order = list(range(len(reducer.params)))

    def post_hook(self, is_last_joiner: bool) -> None:
        """Everyone joined: copy the last joiner's parameters and buffers to every rank."""
        ddp = self.ddp
        states = [p.detach() for name, p in ddp.module.named_parameters()
                  if name not in ddp.ignored]  # torch's ignore list: left alone
        states += [b.detach() for b in _synced_buffers(ddp)]
        source = _common_rank(ddp, candidate=is_last_joiner)
        group = ddp.process_group
        # Where torch's DDP keeps it too: the source's rank in the group, the same on every rank.
        ddp._authoritative_rank = (source if group is None or group is dist.group.WORLD
                                   else dist.get_group_rank(group, source))
        broadcast_from(states, source, group)


# ----- a rank still training: called from DistributedDataParallel.forward -----

def before_forward(ddp) -> None:
    """The engine's ``before_forward`` once ``ddp`` has been given to a join context, at every
    forward: tell the joined ranks this one still trains (which sets the divisor); then, inside
    an enabled join context, agree on the rank whose buffers every rank copies (rank 0 may
    have joined, and its buffers be stale: the highest rank still training) and say whether this
    step's backward synchronizes (not inside ``no_sync``), so that joined ranks shadow its
    all_reduces or skip them (torch does not wait for that all_reduce)."""
    notify_still_training(ddp)
    if not ddp._join_config.enable:
        ddp.buffer_source = group_rank0(ddp.process_group)
        return
    if _syncs_buffers(ddp):
        ddp.buffer_source = _common_rank(ddp, candidate=True)
    _all_reduce_flag(ddp, ddp.require_backward_grad_sync)


def notify_still_training(ddp) -> None:
    """Tell the joined ranks this one still trains; set the divisor.

    Outside a join context this does nothing. Inside, the all_reduce also counts the ranks
    still training, which is the divisor when ``divide_by_initial_world_size=False``.
    """
    work = Join.notify_join_context(ddp)
    if work is None:
        return
    if getattr(ddp, "_divide_by_initial_world_size", True):
        ddp.reducer.divisor = ddp.reducer.world_size
    else:
        work.wait()
        ddp.reducer.divisor = int(work.get_future().value()[0].item())


def _syncs_buffers(ddp) -> bool:
    """Whether this forward broadcasts buffers (by rank 0's broadcast, not a buffer hook)."""
    return (ddp.will_sync_module_buffers() and ddp.buffer_hook is None
            and bool(ddp._buffers_to_sync()))


def _all_reduce_flag(ddp, flag: bool):
    """Start summing a 0/1 flag across ranks; return the tensor and the work."""
    tensor = torch.full((1,), float(flag), device=ddp.device)
    return tensor, dist.all_reduce(tensor, group=ddp.process_group, async_op=True)


def _common_rank(ddp, candidate: bool) -> int:
    """The highest group rank among those that offer themselves, as a global rank."""
    group = ddp.process_group
    offer = torch.tensor([dist.get_rank(group) if candidate else -1], device=ddp.device)
    dist.all_reduce(offer, op=dist.ReduceOp.MAX, group=group)
    chosen = int(offer.item())
    if chosen < 0:
        raise RuntimeError("join: no rank offered itself as the source of the model; this is "
                           "a bug in miniddp.options.join, please report it")
    if group is None or group is dist.group.WORLD:
        return chosen
    return dist.get_global_rank(group, chosen)


def _synced_buffers(ddp) -> list[torch.Tensor]:
    """The buffers the final sync broadcasts: all the module has now (torch reads them anew
    there, whether or not it had any at construction), unless buffer sync is off."""
    return list(ddp._read_buffers().values()) if ddp.forward_sync_buffers else []


def _shadow_buckets(reducer) -> None:
    """One reduction of zeros per bucket, in bucket order, by the reducer's own reduction (a
    comm hook may send something else than the bucket: fp16, say)."""
    works = []
    for bucket in reducer.buckets:
        zeros = Bucket(bucket.index, bucket.param_indices, reducer.params)
        zeros.buffer.zero_()
        works.append(reducer.comm_hook.launch(zeros, len(reducer.buckets)))
    for work in works:
        work.wait()


def _shadow_used_flags(reducer) -> None:
    """Sum this rank's last used-parameter flags in again, as torch's reducer does."""
    unused = reducer.unused
    if unused.used_everywhere is None:  # never reduced: it used nothing
        unused.used_everywhere = torch.zeros_like(unused.locally_used,
                                                  device=reducer.params[0].device)
    dist.all_reduce(unused.used_everywhere, group=reducer.group)
