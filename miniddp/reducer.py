"""The reducer: averages gradients across ranks while the backward pass is still running.

The life of one synchronized step:

1. ``begin_forward`` (start of a forward with grad enabled): fail if the last synchronized
   backward never completed; after the first synchronized backward, rebuild the buckets once,
   in the order its gradients became ready.
2. ``prepare_for_backward`` (end of a synchronized forward): expect one hook per parameter.
3. A hook fires for each parameter once its gradient has been accumulated into ``.grad``. It
   is a post-hook on the parameter's AccumulateGrad node, as in torch's reducer, rather than
   ``Tensor.register_post_accumulate_grad_hook``: it runs after any such hook of the user's (so
   it reduces the gradient those hooks leave), and it also fires when the gradient that arrives
   is undefined (how parameters behind outputs the loss ignored are found). The parameter's
   bucket takes the gradient (``Bucket.fill``): ``grad * (1 / world_size)`` into its slot
   (multiplying by the reciprocal before a SUM is exactly what torch does, and what makes the
   bits match), or kept until the bucket's last one (``copy_buckets_at_end``). When a bucket
   is full its all_reduce starts, asynchronously, buckets strictly in order, so every rank
   issues the same collectives in the same order.
4. When every parameter is ready, a callback is queued on the autograd engine. It runs after
   the last gradient is computed and waits for each bucket in turn, writing its averages back
   into ``.grad`` while the later ones are still in flight. So when ``loss.backward()``
   returns, gradients are synchronized.

This file is the whole of it, one copy of each step. Each of DDP's options acts at the line
where it changes a step, and that line names its module in ``miniddp.options`` (this file
imports none): ``views`` (``gradient_views``), ``comm_hook`` (``comm_hooks``: a hook replaces
the default all_reduce), ``unused``, ``static_graph``, ``graph_gradients`` (``create_graph``).
An option comes in one way, ``attach`` (until then each is ``None``, and ``comm_hook`` the
plain all_reduce), and acts only through the reducer's public methods: ``lay_out_buckets``,
``initial_assignment``, ``mark_all_ready``, ``abandon_step``, ``emit``. What the reducer is
built with (its settings, the options attached, the buckets' layout) is its base class's,
``miniddp.reducer_layout``. What happened is emitted as ``(event, ident, time)`` records
(``miniddp.events``), and, while torch.profiler records, as named spans. ``overlap=False``
launches at the end of backward: the naive "reduce after backward" baselines share this code.

One module because it is the one copy of the step: a reader follows one backward from a
parameter's hook to its averaged ``.grad`` here, and each option's line where it acts. How
the reducer is built is ``miniddp.reducer_layout``, the bucket's own part of the step
``miniddp.buckets``, and each option's part its module.
"""

from __future__ import annotations

import enum
import functools
import threading
import time
import weakref

import torch
from torch.utils._pytree import tree_flatten

from miniddp import errors, profiling
from miniddp.buckets import Bucket, rebuilt_assignment
from miniddp.profiling import NO_SPAN
from miniddp.reducer_layout import ReducerLayout

#: torch's reducer times the first ten synchronized iterations, then one in this many
#: (``_set_ddp_runtime_logging_sample_rate``): those emit a ``sampled`` record.
DEFAULT_SAMPLE_RATE = 100


class Step(enum.Enum):
    """Where the reducer stands in a step."""

    IDLE = "no synchronized backward expected"
    EXPECTING = "a synchronized forward ran; its backward has not reached the reducer"
    REDUCING = "gradients are being marked ready; the end of backward has not run"
    REDUCED = "this forward's backward has been reduced"
    SECOND_BACKWARD = "a backward reached this forward's outputs again after the reduction"


class Reducer(ReducerLayout):
    """Owns the hooks of one DDP module, and runs its steps; what it is built with (settings,
    options, the buckets' layout) is its base's, ``miniddp.reducer_layout``."""

    def __init__(self, params: list[torch.Tensor], names: list[str], process_group=None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 overlap: bool = True, bucket_caps: list[int] | None = None,
                 batched_copy: bool = False):
        super().__init__(params, names, process_group, bucket_cap_mb, bucket_caps, batched_copy)
        self.overlap = overlap
        self.state = Step.IDLE
        self.forwards = self.synced_forwards = 0  # named when ranks fall out of step
        self.iterations, self.sample_rate = 0, DEFAULT_SAMPLE_RATE  # torch's num_iterations_
        self.profiling = False  # whether torch.profiler records this step (see _spanned)
        self.ready: set[int] = set()
        self.next_bucket = 0
        self.allreduce_calls = 0  # launched since the last forward
        self.ready_order: list[int] = []  # the last synced backward's order, for the rebuild
        self.output_nodes: list = []  # the last synced forward's, until its backward ends
        self.error: BaseException | None = None  # what the last wait_failed or error names
        self._reciprocals: dict = {}  # (dtype, divisor) -> what gradients are multiplied by
        self._lock = threading.Lock()  # a module on several GPUs runs hooks on several threads
        self._me = weakref.ref(self)  # what the hooks hold: see _hook_every_parameter
        self._accumulators, self._hooks = _hook_every_parameter(self._me, params)
        self.lay_out_buckets(self.initial_assignment(find_unused_parameters))

    @property
    def should_rebuild(self) -> bool:
        return self.unused is None and not self.has_rebuilt

    # ----- one step -----

    def begin_forward(self, sync: bool = True) -> None:
        """At a forward with grad enabled (``sync``: not inside ``no_sync``): fail on an
        unfinished reduction, naming the parameters, as torch does (waiting could hang: a rank
        missing another parameter never launched some buckets); rebuild the buckets once."""
        if self.state is Step.REDUCING:
            raise errors.logged(self, errors.unfinished_reduction(self))
        self.forwards, self.allreduce_calls = self.forwards + 1, 0
        self.state = Step.EXPECTING if self.state is Step.EXPECTING else Step.IDLE
        self.profiling = profiling.recording()  # asked once a step
        self.iterations += sync  # torch's num_iterations_; compat/logging_data.py times some:
        if sync and (self.iterations <= 10 or self.iterations % self.sample_rate == 0):
            self.emit("sampled", self.iterations)
        if self.ready_order and self.should_rebuild:
            self.emit("rebuild", -1)
            with profiling.span("miniddp.ddp.rebuild") if self.profiling else NO_SPAN:  # (once)
                self.lay_out_buckets(rebuilt_assignment(self.params, self.ready_order,
                                                      self.bucket_limits, self.group))
            self.has_rebuilt, self.ready_order = True, []
        self.emit("forward", int(sync))

    def prepare_for_backward(self, outputs):
        """End of a synced forward: expect hooks; return the outputs to use."""
        if self.ready:  # the last synced forward's backward never reached the reducer
            for bucket in self.buckets:
                bucket.reset()
            self.ready.clear()
        self.state, self.next_bucket = Step.EXPECTING, 0
        self.synced_forwards += 1
        self.ready_order.clear()  # this backward's order (for the rebuild, if one is to come)
        self.emit("forward_end", -1)
        if self.unused is not None:  # options/unused.py: find what no output reaches
            outputs = self.unused.prepare(outputs)
        if self.static_graph is not None:  # options/static_graph.py: the first backward waits
            outputs = self.static_graph.prepare(outputs)
        leaves = tree_flatten(outputs)[0]
        self.output_nodes = [t.grad_fn for t in leaves if getattr(t, "grad_fn", None) is not None]
        return outputs

    def outputs_of_unsynced_forward(self, outputs):
        """A forward with grad enabled inside ``no_sync``: its outputs, watched with
        ``find_unused_parameters`` (``UnusedParameters.watch`` says why)."""
        if self.unused is None:
            return outputs
        return self.unused.watch(outputs)  # options/unused.py

    def _hook(self, index: int) -> None:
        with self._lock:
            awaited = self.state is Step.EXPECTING or self.state is Step.REDUCING
            if self.static_graph is not None and not self.static_graph.final_firing(index, awaited):
                return  # options/static_graph.py: not yet this parameter's last firing
            if not awaited:
                if self.state is Step.SECOND_BACKWARD:  # through a reduced forward: warn, or
                    self.emit("late_gradient", index)  # raise
                elif self.unused is not None:  # options/unused.py: no_sync, or a forward
                    self.unused.note_use(index)  # through ddp.module: the gradient accumulates
                return
            self.emit("ready", index)
            if self.unused is not None:  # options/unused.py: the unreached are ready, zeros
                self.unused.note_use(index)
                for unreached in self.unused.take_unreached():
                    self._mark_ready(unreached)
            if self.static_graph is not None:  # options/static_graph.py: unused in the first
                for unused in self.static_graph.take_unused():  # backward: ready, zeros
                    self._mark_ready(unused)
            self.ready_order.append(index)
            self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        if index in self.ready:
            raise errors.marked_ready_twice(index, self.names[index])
        self.ready.add(index)
        self.state = Step.REDUCING
        bucket, slot = self.slot_of[index]
        if bucket.fill(slot, self._copy_into_bucket):
            if bucket.scales_whole:  # its gradients copied in at once (if kept), and scaled
                self._spanned("copy_in", bucket, bucket.complete, self._scale_bucket)
            if self.overlap:
                self._launch_ready_buckets()
        if len(self.ready) == len(self.params):
            if self.unused is not None:  # options/unused.py: which were used, on which rank
                self.emit("used_flags", -1)
                self.unused.share()
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def mark_all_ready(self) -> None:
        """Every parameter ready, in index order (``options/static_graph.py``: the end of the
        first backward, torch's ``delay_all_reduce``); then the usual end of backward."""
        with self._lock:
            for index in range(len(self.params)):
                self._mark_ready(index)

    def abandon_step(self, error: BaseException) -> BaseException:
        """An option found that this backward cannot be reduced: the next forward reports the
        step unfinished, as torch's does. Returns ``error``, logged, to raise."""
        self.state = Step.REDUCING
        return errors.logged(self, error)

    def _copy_into_bucket(self, param: torch.Tensor, view: torch.Tensor,
                          scale: bool = True) -> None:
        """``view = grad * (1 / world_size)`` (unscaled: ``scale=False``, or a comm hook that
        averages itself), or zeros for a parameter without a gradient."""
        scale = scale and not self.comm_hook.averages
        try:
            if self.views is not None:  # options/gradient_views.py: .grad becomes the view
                self.views.copy_in(param, view, self.divisor, scale)
            elif param.grad is None:  # unused here: contribute zeros
                view.zero_()
            elif scale:
                self._scale(param.grad, view)
            else:
                view.copy_(param.grad)
        except RuntimeError as error:  # options/create_graph.py: a gradient that requires grad?
            if self.graph_gradients is None:
                raise
            with self.graph_gradients.value_only(param, error, self.views is not None):
                self._copy_into_bucket(param, view, scale)

    def _scale(self, source: torch.Tensor, out: torch.Tensor) -> None:
        """``out = source * (1 / divisor)``: a gradient into its slot, or a whole bucket in
        place once its gradients are copied in (see ``copy_buckets_at_end``)."""
        try:  # (one Python call less than asking a method: each costs about 0.5 us here)
            torch.mul(source, self._reciprocals[out.dtype, self.divisor], out=out)
        except KeyError:
            torch.mul(source, self._reciprocal(out.dtype), out=out)

    def _scale_bucket(self, buffer: torch.Tensor) -> None:
        """A complete bucket that scales whole: multiplied (divided, as torch's
        ``batched_grad_copy``), unless a comm hook does its own averaging."""
        if self.batched_copy and not self.comm_hook.averages:
            buffer.div_(self.divisor)
        elif not self.comm_hook.averages:
            self._scale(buffer, buffer)

    def _reciprocal(self, dtype: torch.dtype):
        """``1 / divisor`` as torch's reducer multiplies by it; for float32 a 0-dim float32
        tensor: the same bits, and no new tensor per call."""
        value = 1.0 / self.divisor
        value = torch.tensor(value, dtype=dtype) if dtype == torch.float32 else value
        return self._reciprocals.setdefault((dtype, self.divisor), value)

    def _launch_ready_buckets(self) -> None:
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        if self.unused is not None and self.unused.skips(bucket):
            return  # options/unused.py: skip_all_reduce_unused_params
        self.emit("launch", bucket.index)
        on_done = (lambda b: self.emit("done", b.index)) if "done" in self._listeners else None
        self._spanned("launch", bucket, bucket.launch, self.comm_hook, len(self.buckets), on_done)
        self.allreduce_calls += 1

    def _finalize(self) -> None:
        """End of backward: wait for every bucket, write the averages into ``.grad``."""
        self.emit("backward_end", -1)
        self.state = Step.REDUCED
        with profiling.span("miniddp.ddp.end_of_backward") if self.profiling else NO_SPAN:
            self._launch_ready_buckets()  # (overlap=False launches every bucket here)
            # Which parameters some rank used (None: all of them): options/unused.py finds them
            # at each step, options/static_graph.py in the first backward.
            option = self.unused or self.static_graph
            used = option.used_on_some_rank() if option is not None else None
            for bucket in self.buckets:
                if bucket.work is not None:  # (None: skipped, skip_all_reduce_unused_params)
                    self._wait(bucket)
                    self._spanned("write_back", bucket, self._write_back_bucket, bucket, used)
                bucket.reset()  # for the next backward, while it is at hand
        self.ready.clear()
        while self.output_nodes:  # a backward reaching them again is a second one; popped, as
            # each holds its graph
            self.output_nodes.pop().register_prehook(functools.partial(_reached_again, self._me))
        self.emit("finalized", -1)

    def _wait(self, bucket: Bucket) -> None:
        try:
            self._spanned("wait", bucket, bucket.wait)
        except RuntimeError as error:  # the listeners may say where every rank was
            self.error = error
            self.emit("wait_failed", bucket.index)
            raise
        self.comm_hook.finish(bucket)  # options/comm_hooks.py: a hook's result into the bucket
        self.emit("waited", bucket.index)

    def _write_back_bucket(self, bucket: Bucket, used: list[bool] | None) -> None:
        if self.views is not None:  # options/gradient_views.py: .grad is the bucket already
            self.views.write_back(bucket, self.names, used)
        else:
            bucket.write_back(self._write_back, used)

    def _write_back(self, index: int, view: torch.Tensor) -> None:
        """The average into a ``.grad`` that is missing, or part of a graph."""
        param = self.params[index]
        if param.grad is None:
            param.grad = view.clone(memory_format=torch.preserve_format)
        else:  # options/create_graph.py: copied into the graph's gradient in place
            self.graph_gradients.write_back(self.names[index], param.grad, view)

    def _spanned(self, step: str, bucket: Bucket, work, *args):
        """``work(*args)``, inside a span while torch.profiler records (asked once a step). (A
        ``with`` per bucket step would cost more than the call: about 0.16 us, no profiler.)"""
        return profiling.bucket_span(step, bucket, work, args) if self.profiling else work(*args)

    def emit(self, event: str, ident: int) -> None:
        """``(event, ident, now)`` to the event's listeners (``EventStream``: who listens).
        (Here, not in ``miniddp.events``, so that one step reads in the engine's files.)"""
        for listener in self._listeners.get(event, self._others):
            listener((event, ident, time.perf_counter()))

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def __del__(self):
        if hasattr(self, "_hooks"):  # not when __init__ failed before registering them
            self.remove_hooks()


def _hook_every_parameter(reducer_ref, params: list[torch.Tensor]) -> tuple[list, list]:
    """A post-hook on each parameter's AccumulateGrad node; return the nodes and the handles.

    The node is created lazily and held weakly by the parameter: keep it, or a new node
    (without the hook) replaces it. The hooks hold the reducer weakly, so a dropped DDP wrapper
    leaves no live hook on a module used afterwards."""
    accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]
    return accumulators, [node.register_hook(functools.partial(_call_hook, reducer_ref, i))
                          for i, node in enumerate(accumulators)]


def _call_hook(reducer_ref, index: int, _grad_inputs, _grad_outputs) -> None:
    if (reducer := reducer_ref()) is not None:
        reducer._hook(index)


def _reached_again(reducer_ref, _grad_outputs) -> None:
    """A backward reached a reduced forward's outputs again: a second backward through it."""
    if (reducer := reducer_ref()) is not None and reducer.state is Step.REDUCED:
        reducer.state = Step.SECOND_BACKWARD
