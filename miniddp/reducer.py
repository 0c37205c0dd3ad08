"""The reducer: averages gradients across ranks while the backward pass is still running.

The life of one synchronized step:

1. ``begin_forward`` (start of a forward with grad enabled): fail if the last synchronized
   backward never completed; rebuild the buckets once, after the first synchronized step.
2. ``prepare_for_backward`` (end of a synchronized forward): expect one hook per parameter.
3. A hook fires for each parameter once its gradient has been accumulated into ``.grad``. It
   is a post-hook on the parameter's AccumulateGrad node, as in torch's reducer, rather than
   ``Tensor.register_post_accumulate_grad_hook``: it runs after any such hook of the user's (so
   it reduces the gradient those hooks leave), and it also fires when the gradient that arrives
   is undefined (how parameters behind outputs the loss ignored are found). It copies
   ``grad * (1 / world_size)`` into the parameter's slot of its bucket (multiplying by the
   reciprocal before a SUM is exactly what torch does, and what makes the bits match). In a
   bucket of small gradients (on a GPU, in every bucket) they wait for the last one instead:
   then one call copies them all in and one multiplies the bucket by the same reciprocal (the
   same bits, and two calls per bucket instead of one per parameter: see ``copy_buckets_at_end``).
   When a bucket's last slot is filled, its ``all_reduce(async_op=True)`` starts, buckets
   strictly in order, so every rank issues the same collectives in the same order.
4. When every parameter is ready, a callback is queued on the autograd engine. It runs after
   the last gradient is computed and waits for each bucket in turn, writing its averages back
   into ``.grad`` while the later ones are still in flight. So when ``loss.backward()``
   returns, gradients are synchronized.

That is all of this file. The options attach where it says so, each in the module of
``miniddp.options`` named for it (``unused``, ``gradient_views``, ``comm_hooks``,
``static_graph``, ``batched_copy``, ``create_graph``); the bucket layout and its one rebuild
are ``miniddp.buckets``. A hook that no option needs to see goes straight to its bucket. The
checks (``miniddp.checks``) are not imported here: they attach to ``self.watch`` and
``self.consistency``, called at the points marked ``miniddp.checks``. ``timeline``, when set
to a list, records ``(event, ident, time)`` for lessons and traces.

``overlap=False`` waits for the end of backward before launching anything: the naive "reduce
after backward" baselines share this code instead of copying it.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref

import torch
import torch.distributed as dist

from miniddp import errors
from miniddp.buckets import (
    ONE_BUCKET,
    Bucket,
    BucketInfo,
    assign_buckets,
    bucket_limits,
    rebuilt_assignment,
)
from miniddp.options import create_graph
from miniddp.options.gradient_views import GradientsAsBucketViews
from miniddp.options.torch_private import TorchPrivateReducer
from miniddp.options.unused import UnusedParameters

#: On a CPU, a bucket of gradients of at most this many bytes each has them copied in with
#: its last one (``Reducer.copy_buckets_at_end``).
COPY_AT_END_BYTES_CPU = 64 * 1024


class Reducer(TorchPrivateReducer):  # torch's private methods: miniddp.options.torch_private
    """Owns the buckets and the hooks of one DDP module. See the module docstring."""

    def __init__(self, params: list[torch.Tensor], names: list[str], process_group=None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, overlap: bool = True,
                 bucket_caps: list[int] | None = None):
        self.params, self.names = params, names
        self.group = process_group
        # Launch through the group's own allreduce: dist.all_reduce's checks cost ~3 us a call.
        self._process_group = dist.group.WORLD if process_group is None else process_group
        self.world_size = dist.get_world_size(process_group)
        self.divisor = self.world_size  # what gradients are divided by
        self.first_bucket_bytes, self.bucket_bytes = bucket_limits(bucket_cap_mb)
        self.bucket_caps = bucket_caps  # torch's bucket_cap_mb_list, in bytes (miniddp.buckets)
        self.overlap = overlap
        self.find_unused = find_unused_parameters
        # The options, each in the module named for it; None when off.
        self.unused = UnusedParameters(params, process_group) if find_unused_parameters else None
        self.views = GradientsAsBucketViews(names) if gradient_as_bucket_view else None
        self.comm_hook = None  # see miniddp.options.comm_hooks
        self.static_graph = None  # see miniddp.options.static_graph
        self.batched_copy = None  # batched_grad_copy (miniddp.options.batched_copy)
        self.watch = None  # attached by miniddp.checks: late gradients, failed waits
        self.consistency = None  # checks across ranks, when on (miniddp.checks)
        self.forwards = self.synced_forwards = 0  # named when ranks fall out of step
        self.timeline: list[tuple] | None = None
        self.timer = self.logger = None  # a sampled step's times (miniddp.options.logging_data)
        # Where this step stands.
        self.expect_hooks = False  # True between a synced forward and the end of its backward
        self.reduced = False  # this forward's backward has been reduced
        self.second_backward = False  # and a backward reached its outputs again since
        self.require_finalize = False  # a parameter was marked ready and finalize has not run
        self.ready: set[int] = set()
        self.next_bucket = 0
        self.allreduce_calls = 0  # launched since the last forward
        self.ready_order: list[int] = []  # the first synced backward's order, for the rebuild
        self.has_rebuilt = False
        self.buckets_fresh = True  # no hook has touched the buckets since their last reset
        self._reciprocals: dict = {}  # (dtype, divisor) -> what gradients are multiplied by
        self.plain = False  # no option needs to see each hook this backward (prepare_for_backward)
        # A bucket of gradients of at most this many bytes each waits for its last one.
        on_gpu = bool(params) and params[0].device.type != "cpu"
        self.copy_at_end_bytes = float("inf") if on_gpu else COPY_AT_END_BYTES_CPU
        self._lock = threading.Lock()  # a module on several GPUs runs hooks on several threads
        # A parameter's AccumulateGrad node is created lazily and held weakly by the parameter:
        # keep it, or a new node (without the hook) replaces it. The hooks hold the reducer
        # weakly, so a dropped DDP wrapper leaves no live hook on a module used afterwards.
        self._accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]
        me = weakref.ref(self)
        self._hooks = [node.register_hook(functools.partial(_call_hook, me, i))
                       for i, node in enumerate(self._accumulators)]
        self._init_buckets(self.initial_assignment())

    # ----- bucket layout (the rules live in miniddp.buckets) -----

    def initial_assignment(self) -> list[list[int]]:
        """Iteration 0: one bucket per dtype/device, unless unused parameters are expected."""
        limits = [self.first_bucket_bytes, self.bucket_bytes] if self.find_unused else [ONE_BUCKET]
        limits = self.bucket_caps or limits  # bucket_cap_mb_list applies from iteration 0
        return list(reversed(assign_buckets(self.params, limits)))

    @property
    def should_rebuild(self) -> bool:
        return not self.find_unused and not self.has_rebuilt

    def _init_buckets(self, assignment: list[list[int]]) -> None:
        # Free the old buffers before allocating the new ones (as torch does), or a rebuild holds
        # two copies of every bucket at once; a gradient that is a view keeps its buffer alive.
        self.buckets, self.locate = [], {}
        self.buckets = [Bucket(b, indices, self.params) for b, indices in enumerate(assignment)]
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self.locate[i] = (bucket, slot)
        if self.views is not None:
            self.views.move_into(self.buckets, self.params)
        self.copy_buckets_at_end(self.copy_at_end_bytes)

    def copy_buckets_at_end(self, max_bytes: float) -> None:
        """A bucket whose gradients are all of at most ``max_bytes`` has them wait for its
        last one: then one call copies them all in, and one scales the whole bucket.

        Every element is multiplied by the same operand as it would be on the way in, so the
        bits are the same (dividing the bucket, as torch's ``batched_grad_copy`` does, is
        another operation and gives other bits). The slots of parameters without a gradient
        were zeroed, and stay zero.

        Each copy on the way in is one call from this thread (on a GPU, one more kernel launched
        by the thread that launches the backward's). Waiting trades those calls for one more
        pass over the bucket, which pays on a CPU only for small gradients (benchmarks/README.md,
        "Changes made to the engine", 4). ``float("inf")``: every bucket (a GPU's); -1: none.
        """
        self.copy_at_end_bytes = max_bytes
        self.buckets_fresh = False  # their next reset sets them up for it
        for bucket in self.buckets:
            bucket.copy_at_end = len(bucket.views) > 1 and self.views is None and all(
                view.numel() * view.element_size() <= max_bytes for view in bucket.views)

    def bucket_info(self) -> list[BucketInfo]:
        return [bucket.info(self.names) for bucket in self.buckets]

    # ----- one step -----

    def begin_forward(self) -> None:
        """At a forward with grad enabled: fail on an unfinished reduction, rebuild once."""
        self.ensure_prior_reduction_finished()
        self.forwards += 1  # miniddp.checks.consistency
        self.reduced = self.second_backward = False
        self.allreduce_calls = 0
        if self.should_rebuild and self.ready_order:
            limits = self.bucket_caps or [self.first_bucket_bytes, self.bucket_bytes]
            if self.consistency is not None:  # miniddp.checks
                self.consistency.before_collective("the broadcast of the bucket order", None, [])
            self._init_buckets(rebuilt_assignment(self.params, self.ready_order, limits,
                                                  self.group))
            self.has_rebuilt, self.ready_order = True, []

    def prepare_for_backward(self, outputs):
        """End of a synced forward: expect hooks; return the outputs to use."""
        self.expect_hooks = True
        self.synced_forwards += 1  # miniddp.checks.consistency
        if self.timer is not None:  # miniddp.options.logging_data
            self.timer.note("forward_end")
        self.ready.clear()
        self.next_bucket = 0
        if not self.buckets_fresh:  # the last synced forward's backward did not finish them
            for bucket in self.buckets:
                bucket.reset()
        self.buckets_fresh = False  # (each backward's _finalize resets them as it goes)
        # The options that see every hook first; without them a hook goes straight to its
        # bucket (a trace's timeline is checked at each hook: it may start after the forward).
        self.plain = (self.unused is None and self.static_graph is None and self.timer is None
                      and not self.should_rebuild)
        if self.unused is not None:  # find the parameters no output reaches; watch outputs
            outputs = self.unused.prepare(outputs)
        if self.static_graph is not None:  # firings to expect; the first backward waits
            outputs = self.static_graph.prepare(outputs)
        if self.watch is not None:  # miniddp.checks: mark them, to notice a second backward
            self.watch.outputs_of_synced_forward(outputs)
        return outputs

    def outputs_of_unsynced_forward(self, outputs):
        """A forward with grad enabled inside ``no_sync``: with ``find_unused_parameters``,
        its outputs are watched too, as torch routes every forward's outputs through its sink.

        It matters after a synced forward that no backward followed (a validation forward
        without ``torch.no_grad()``): the hooks that forward expects are still expected, so the
        ``no_sync`` backward is reduced after all, and a parameter behind an output its loss
        ignores must still fire its hook to be marked ready (``miniddp.options.unused``).
        Otherwise the watch changes nothing: hooks that are not expected only note use.
        """
        if self.unused is None:
            return outputs
        return self.unused.watch(outputs)

    def _hook(self, index: int) -> None:
        with self._lock:
            if self.plain and self.expect_hooks and self.timeline is None:
                self._mark_ready(index)  # nothing else needs to see it: into its bucket
            else:
                self._hook_with_options(index)

    def _hook_with_options(self, index: int) -> None:
        """A hook that an option, a trace or the bucket rebuild needs to see first, or that
        no synced backward expects."""
        if self.static_graph is not None and not self.static_graph.final_firing(
                index, self.expect_hooks):
            return  # static_graph: counted, not yet this parameter's last firing
        if self.expect_hooks:
            self._gradient_ready(index)
        elif self.second_backward:  # through a reduced forward: warn, or raise
            self.watch.late_gradient(index)  # (miniddp.checks)
        elif self.unused is not None:  # no_sync, or a forward through ddp.module:
            self.unused.note_use(index)  # gradients just accumulate

    def _gradient_ready(self, index: int) -> None:
        self._record("ready", index)  # the trace, and logging data
        if self.unused is not None:  # the unreached ones are ready too, with zeros
            self.unused.note_use(index)
            for unreached in self.unused.take_unreached():
                self._mark_ready(unreached)
        if self.static_graph is not None:  # unused in the first backward: ready, zeros
            for unused in self.static_graph.take_unused():
                self._mark_ready(unused)
        if self.should_rebuild:
            self.ready_order.append(index)
        self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        if index in self.ready:
            raise errors.marked_ready_twice(index, self.names[index])
        self.ready.add(index)
        self.require_finalize = True
        bucket, slot = self.locate[index]
        param = self.params[index]
        if self.batched_copy is not None:  # copies now or later (miniddp.options.batched_copy)
            self.batched_copy.copy_in(index, bucket, slot)
        elif bucket.copy_later is not None and param.grad is not None:
            bucket.copy_later.append((param.grad, bucket.views[slot]))  # with the bucket's last
        else:
            self._copy_into_bucket(param, bucket.views[slot])
        bucket.pending -= 1
        if bucket.pending == 0:  # full: launch it, and any full ones waiting behind it
            if self.batched_copy is not None:
                self.batched_copy.flush(bucket)
            elif bucket.copy_later:  # gradients that waited for this, the bucket's last one:
                grads, views = zip(*bucket.copy_later)  # one call copies them all in, one scales
                torch._foreach_copy_(list(views), list(create_graph.values(grads)))
                if self.comm_hook is None:  # (a comm hook does its own scaling)
                    self._scale(bucket.buffer, bucket.buffer)
            if self.overlap:
                self._launch_ready_buckets()
        if len(self.ready) == len(self.params):
            if self.unused is not None:
                if self.consistency is not None:  # miniddp.checks
                    self.consistency.before_collective("the all_reduce of used-parameter flags",
                                                       None, [self.unused.locally_used])
                self.unused.share()
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _copy_into_bucket(self, param: torch.Tensor, view: torch.Tensor) -> None:
        """``view = grad * (1 / world_size)``; unscaled when a comm hook does its own scaling."""
        scale = self.comm_hook is None
        try:
            if self.views is not None:
                self.views.copy_in(param, view, self.divisor, scale)
            elif param.grad is None:  # unused here: contribute zeros
                view.zero_()
            elif scale:
                self._scale(param.grad, view)
            else:
                view.copy_(param.grad)
        except RuntimeError as error:  # backward(create_graph=True)? miniddp.options.create_graph
            create_graph.copy_value(self, param, view, error)

    def _scale(self, source: torch.Tensor, out: torch.Tensor) -> None:
        """``out = source * (1 / divisor)``: a gradient into its slot, or a whole bucket in
        place once its gradients are copied in (see ``copy_buckets_at_end``)."""
        torch.mul(source, self._reciprocal(out.dtype), out=out)

    def _reciprocal(self, dtype: torch.dtype):
        """``1 / divisor`` as torch's reducer multiplies by it; for float32 a 0-dim float32
        tensor: the same bits, and no new tensor per call (benchmarks/README.md, "Changes", 3)."""
        key = (dtype, self.divisor)
        if key not in self._reciprocals:
            value = 1.0 / self.divisor
            self._reciprocals[key] = (torch.tensor(value, dtype=dtype)
                                      if dtype == torch.float32 else value)
        return self._reciprocals[key]

    def _launch_ready_buckets(self) -> None:
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        if self.unused is not None and self.unused.skips(bucket):  # miniddp.options.unused
            return
        self._record("launch", bucket.index)
        if self.consistency is not None:  # miniddp.checks
            self.consistency.before_collective("the all_reduce", bucket.index, [bucket.buffer])
        if self.comm_hook is None:
            bucket.work = self._process_group.allreduce([bucket.buffer])  # async, SUM
        else:  # the hook's future replaces the all_reduce
            bucket.work = self.comm_hook.launch(self, bucket)
        self.allreduce_calls += 1
        if self.timeline is not None:
            # A chained future, waited for in _finalize: the callback runs on a communication
            # thread, and must not still be running when the process exits.
            future = bucket.work if self.comm_hook else bucket.work.get_future()
            bucket.recorded = future.then(lambda _f, b=bucket.index: self._record("done", b))

    def _finalize(self) -> None:
        """End of backward: wait for every bucket, write the averages into ``.grad``."""
        self._record("backward_end", -1)
        self.expect_hooks = self.require_finalize = False
        self.reduced = True
        self._launch_ready_buckets()  # overlap=False launches everything here
        used = self.unused.used_on_some_rank() if self.unused is not None else None
        if self.static_graph is not None:  # used by some rank in the first backward
            used = self.static_graph.end_backward()
        for bucket in self.buckets:
            if bucket.work is None:  # skip_all_reduce_unused_params (miniddp.options.unused)
                bucket.reset()
                continue
            try:
                bucket.work.wait()
            except RuntimeError as error:  # say where every rank was (miniddp.checks)
                if self.watch is not None:
                    self.watch.failed_wait(bucket, error)
                raise
            if self.comm_hook is not None:  # its result goes into the bucket
                self.comm_hook.take_result(bucket)
            if bucket.recorded is not None:
                bucket.recorded.wait()
            self._record("waited", bucket.index)
            grads, averages = [], []  # copied in one call, while later buckets are in flight
            for i, view in zip(bucket.param_indices, bucket.views):
                if used is not None and not used[i]:  # unused on every rank: .grad stays
                    continue
                grad = self.params[i].grad
                if grad is None or grad.requires_grad or self.views is not None:
                    self._write_back(i, view)
                else:
                    grads.append(grad)
                    averages.append(view)
            _copy_all(grads, averages)
            bucket.reset()  # for the next backward, while it is at hand
        self.buckets_fresh = True
        self._record("finalized", -1)
        if self.consistency is not None:  # compare this step across ranks (miniddp.checks)
            self.consistency.after_backward()

    def _write_back(self, index: int, view: torch.Tensor) -> None:
        """The average into a ``.grad`` that is missing, a bucket view, or part of a graph."""
        param = self.params[index]
        if self.views is not None:
            self.views.write_back(param, index, view)
        elif param.grad is None:
            param.grad = view.clone(memory_format=torch.preserve_format)
        else:  # create_graph=True (miniddp.options.create_graph)
            create_graph.write_back(self.names[index], param.grad, view)

    # ----- records, clean-up -----

    def ensure_prior_reduction_finished(self) -> None:
        """Raise, naming the parameters, if the last synced backward never completed. At once,
        as torch does: waiting for the launched buckets could hang, since a rank missing a
        different parameter never launched some of them."""
        if self.require_finalize:
            raise errors.logged(self, errors.unfinished_reduction(self))

    def _record(self, event: str, ident: int) -> None:
        if self.timeline is not None:
            self.timeline.append((event, ident, time.perf_counter()))
        if self.timer is not None:  # a sampled step (miniddp.options.logging_data)
            self.timer.note(event, ident)

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def __del__(self):
        if hasattr(self, "_hooks"):  # not when __init__ failed before registering them
            self.remove_hooks()


def _copy_all(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    if destinations:  # one dispatch for all: a private op, present from torch 2.1 on
        torch._foreach_copy_(destinations, sources)


def _call_hook(reducer_ref, index: int, _grad_inputs, _grad_outputs) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer._hook(index)
