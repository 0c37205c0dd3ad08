"""``overlap_with_ddp=True``: the sharded step runs inside DDP's backward, bucket by bucket.

Without it, a step waits for the whole backward, then steps, then broadcasts. With it, a DDP
communication hook does the step, in one of torch's two orders; ``zero.step()`` then does nothing.

* :func:`hook_with_zero_step`: once the last bucket has been launched, each rank waits only for
  the all_reduces of the buckets it owns, steps the parameters in them with the averaged
  gradients straight from the bucket, and broadcasts them, while the other buckets may still be
  in flight. The backward computes without pause; the step follows it.
* :func:`hook_with_zero_step_interleaved`: at each bucket, its owners wait for its all_reduce,
  step their share of it and broadcast it, before the backward goes on to the next bucket. The
  step runs beside the backward, and all_reduces and broadcasts alternate (bucket 0's
  all_reduce, its broadcast, bucket 1's all_reduce, ...). torch prefers it where communication
  is fast beside computation.

Both do the same steps (one local step per owned bucket, each from that bucket's gradients), so
the parameters come out bit for bit the same; only when each step runs differs. While
torch.profiler records (asked once per backward, at bucket 0), each bucket's local step and
broadcasts, and the final wait, are named spans in its trace.

A rank owns whole DDP buckets (bucket ``i``: rank ``i % world_size``; or slices of buckets with
``shard_buckets=True``), so it must know DDP's final buckets first, as torch's version does:

* first backward: DDP has not rebuilt its buckets yet; the hook only reduces;
* second: DDP has rebuilt them; the hook records each bucket's parameters;
* third, at bucket 0: the partition is made from them, each owner's parameters become views of
  one flat tensor per bucket (one broadcast each), the local (functional) optimizer is built,
  and the step runs from then on.

So the first two iterations do not update the parameters, as with torch (three with
``static_graph=True``, where DDP rebuilds its buckets one iteration later). The local optimizer is
torch's functional version of ``optimizer_class`` (``torch.distributed.optim``): its step takes
the gradients as an argument, ``None`` for parameters it must leave alone.

torch's two hooks refuse the gloo backend by name (pytorch issue 62300, a hang seen with the
interleaved one). torch's interleaved hook chains each bucket's step to its all_reduce's future
(``future.then``). With NCCL that future counts as done as soon as the all_reduce is queued on
its CUDA stream, so the step and its broadcast are issued at once, on the autograd thread, in
bucket order. With gloo the chained step runs later, on a gloo worker thread, when the
all_reduce has finished, and issues its broadcasts from there, beside the autograd thread's
all_reduces (tried with the check bypassed: it timed out or failed every time). Here every wait
and every collective is issued by the autograd thread that called the hook, in torch's NCCL
order, so gloo is allowed. With gloo the wait holds the backward until the bucket is reduced;
with NCCL, waiting on a future only makes the current CUDA stream wait, as torch's does.
"""


import enum
import weakref

import torch
import torch.distributed as dist

from miniddp import profiling
from miniddp.optim.partition import (
    BucketShare,
    assign_ddp_buckets,
    flatten_into_views,
    owners_per_bucket,
    with_params,
)


class Status(enum.IntEnum):
    WAITING_FOR_REBUILD = 0  # DDP's buckets are not final yet
    RECORDING_BUCKETS = 1  # they are: note each bucket's parameters
    READY = 2  # the partition is made and the local optimizer built


class Overlap:
    """One ``ZeroRedundancyOptimizer``'s side of the overlap: the buckets, who owns them, and
    what one backward has seen so far."""

    def __init__(self, zero):
        self.zero = zero
        self.status = Status.WAITING_FOR_REBUILD
        self.shard_buckets = False
        self.params_per_bucket: list[list[torch.Tensor]] = []
        self.shares: list[dict[int, BucketShare]] = []  # [rank][bucket index]
        self.owners: list[set[int]] = []  # [bucket index]: the ranks that step a share of it
        self.offsets: dict[int, int] = {}  # bucket index -> first of its params in my share
        self.waiting: dict[int, tuple] = {}  # this backward: bucket index -> (bucket, future)
        self.seen: list[int] = []
        self.sending: list = []  # this backward's broadcasts not yet waited for
        self.profiled = False  # whether a profiler records this backward (asked at bucket 0)

    @property
    def ready(self) -> bool:
        return self.status == Status.READY

    def note_bucket(self, ddp, bucket) -> None:
        """The set-up, bucket by bucket, until the partition can be made (see the module)."""
        if not ddp._has_rebuilt_buckets:
            return
        if self.status == Status.WAITING_FOR_REBUILD:
            self.status = Status.RECORDING_BUCKETS
        if self.status == Status.RECORDING_BUCKETS:
            if bucket.index() == 0 and self.params_per_bucket:
                self.make_partition()
            else:
                self.params_per_bucket.append(bucket.parameters())

    def make_partition(self) -> None:
        zero = self.zero
        if len(zero.param_groups) > 1:  # the buckets decide who owns what: one group only
            raise RuntimeError(
                "overlap_with_ddp=True shares the parameters out by DDP's buckets, so it "
                f"supports a single parameter group; this optimizer has "
                f"{len(zero.param_groups)} (torch's words: Specifying 'params_per_rank' only "
                "supports a single parameter group)")
        self.status = Status.READY
        self.shares = assign_ddp_buckets(self.params_per_bucket, zero.world_size,
                                         self.shard_buckets)
        self.owners = owners_per_bucket(self.shares, len(self.params_per_bucket))
        params_per_rank = []
        for rank, mine in enumerate(self.shares):
            params = []
            for index, share in mine.items():
                if rank == zero.rank:
                    self.offsets[index] = len(params)
                params += share.parameters
                share.tensor = flatten_into_views(share.parameters)
            params_per_rank.append(params)
        zero._partition = [[with_params(zero.param_groups[0], params)]
                           for params in params_per_rank]
        zero._init_local_optimizer()

    def at_bucket(self, bucket, future) -> None:
        """:func:`hook_with_zero_step`: keep my buckets; at the last one, step and broadcast them
        all."""
        index, rank = bucket.index(), self.zero.rank
        if rank in self.owners[index]:
            self.waiting[index] = (bucket, future)
        self.check_order(index)
        if index != len(self.params_per_bucket) - 1:
            return
        for index in range(len(self.params_per_bucket)):
            if rank in self.owners[index]:
                bucket, future = self.waiting[index]
                future.wait()  # this bucket's gradients are averaged
                self.step_share(bucket)
            self.sending += self.broadcast(index)
        self.end_of_backward()

    def at_bucket_interleaved(self, bucket, future) -> None:
        """:func:`hook_with_zero_step_interleaved`: step and broadcast this bucket now; at the
        last one, wait for every broadcast."""
        index = bucket.index()
        self.check_order(index)
        if self.zero.rank in self.owners[index]:
            future.wait()
            self.step_share(bucket)
        self.sending += self.broadcast(index)
        if index == len(self.params_per_bucket) - 1:
            self.end_of_backward()

    def check_order(self, index: int) -> None:
        """Note bucket ``index`` as seen: the steps and broadcasts rely on buckets 0, 1, ...
        coming in that order on every rank."""
        expected = self.seen[-1] + 1 if self.seen else 0
        if index == 0:
            self.profiled = profiling.recording()
        if index != expected:
            raise AssertionError(f"DDP launched bucket {index} where bucket {expected} was "
                                 "expected: buckets must come in order, starting at 0")
        self.seen.append(index)

    def end_of_backward(self) -> None:
        """Every parameter is sent before the next forward reads it."""
        with profiling.span(self.profiled and f"miniddp.zero.wait {len(self.sending)} "
                            "broadcasts"):
            for handle in self.sending:
                handle.wait()
        self.sending.clear()
        self.seen.clear()
        self.waiting.clear()

    def step_share(self, bucket) -> None:
        """Step the parameters of my share of ``bucket`` with its averaged gradients."""
        index = bucket.index()
        share = self.shares[self.zero.rank][index]
        gradients = [None] * len(self.zero.optim.param_groups[0]["params"])
        mine = bucket.gradients()[share.offset:share.offset + len(share.parameters)]
        for i, gradient in enumerate(mine):
            gradients[self.offsets[index] + i] = gradient
        with profiling.span(self.profiled and f"miniddp.zero.local_step rank {self.zero.rank} "
                            f"bucket {index}"):
            self.zero._local_step(gradients)

    def broadcast(self, index: int) -> list:
        """Each owner of bucket ``index`` (in rank order) sends its share's flat tensor."""
        zero, handles = self.zero, []
        for rank in sorted(self.owners[index]):
            tensor = self.shares[rank][index].tensor
            with profiling.span(self.profiled and f"miniddp.zero.broadcast rank {rank} bucket "
                                f"{index} ({tensor.numel() * tensor.element_size()} bytes)"):
                handles.append(dist.broadcast(tensor, group=zero.process_group, async_op=True,
                                              src=dist.get_global_rank(zero.process_group, rank)))
        return handles


def hook_with_zero_step(hook, ddp, zero, shard_buckets: bool = False):
    """Wrap the communication hook ``hook`` (e.g. ``miniddp.options.comm_hooks.allreduce``, or
    torch's ``allreduce_hook``) so that ``zero`` (built with ``overlap_with_ddp=True``) steps
    during the backward of ``ddp`` (miniddp's DDP or torch's), after its last bucket. Register the
    result with ``ddp.register_comm_hook(state, ...)``. torch's signature and behaviour."""
    return with_zero_step(hook, ddp, zero, shard_buckets, Overlap.at_bucket)


def hook_with_zero_step_interleaved(hook, ddp, zero, shard_buckets: bool = False):
    """As :func:`hook_with_zero_step`, but each bucket is stepped and broadcast as soon as it is
    reduced, bucket by bucket during the backward (see the module). torch's signature and
    behaviour."""
    return with_zero_step(hook, ddp, zero, shard_buckets, Overlap.at_bucket_interleaved)


def with_zero_step(hook, ddp, zero, shard_buckets: bool, at_bucket):
    """The hook both variants build: ``hook``, then the set-up, then ``at_bucket`` (an
    :class:`Overlap` method: when to step) once the set-up is done."""
    if not zero._overlap_with_ddp:
        raise ValueError("ZeroRedundancyOptimizer must be constructed with "
                         "`overlap_with_ddp=True` to use this hook properly")
    overlap: Overlap = zero._overlap
    if shard_buckets:
        overlap.shard_buckets = True
    ddp_ref = weakref.ref(ddp)

    def hook_with_zero_fn(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        future = hook(state, bucket)
        overlap.note_bucket(ddp_ref(), bucket)
        if overlap.ready:
            at_bucket(overlap, bucket, future)
        return future

    return hook_with_zero_fn
