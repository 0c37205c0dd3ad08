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

That is the plain path, and all of it is in this file. Everything else attaches through a few
seams, each ``None`` (the plain behaviour) until something is attached to it from outside the
engine (this file imports none of it):

* how a gradient enters its bucket and how the average returns: ``views``
  (``gradient_as_bucket_view``), ``batched_copy``, ``graph_gradients`` (``create_graph=True``);
* what reduces a bucket: ``comm_hook`` instead of the all_reduce;
* which parameters count as ready: ``unused`` (``find_unused_parameters``), ``static_graph``;
* what happened, as one stream of ``(event, ident, time)`` records: ``subscribe``. The timeline,
  traces, torch's logging timers, the consistency checks and the late-gradient watch listen there.

``overlap=False`` waits for the end of backward before launching anything: the naive "reduce
after backward" baselines share this code instead of copying it.

The plain steps name no seam. While something needs more (a seam attached, a listener of an event
they do not emit, the rebuild still to come, ``overlap=False``), the reducer's class is swapped
for one with the steps through the seams, which are attached from outside (``seamed_steps``),
and back once nothing does: the plain step stays the small version, and as fast.
"""

from __future__ import annotations

import enum
import functools
import operator
import threading
import time
import weakref

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from miniddp import errors
from miniddp.buckets import (
    UNLIMITED_BYTES,
    Bucket,
    BucketInfo,
    assign_buckets,
    bucket_limits,
)
from miniddp.sync import held

#: On a CPU, a bucket of gradients of at most this many bytes each has them copied in with
#: its last one (``Reducer.copy_buckets_at_end``).
COPY_AT_END_BYTES_CPU = 64 * 1024

#: The events of the stream, in the order a step emits them; ``ident`` is a parameter index for
#: ``ready`` and ``late_gradient``, a bucket index for ``launch``, ``done``, ``waited`` and
#: ``wait_failed``, 1 or 0 (synchronized or not) for ``forward``, else -1;
#: the error a ``wait_failed`` or ``error`` names is the reducer's ``error``.
EVENTS = ("rebuild", "forward", "forward_end", "ready", "launch", "done",
          "used_flags", "backward_end", "waited", "wait_failed", "finalized", "late_gradient",
          "buffers", "error")


#: What the timeline records: a backward's events, and any other a caller records (None).
TIMELINE_EVENTS = ("ready", "launch", "done", "backward_end", "waited", "finalized", None)


#: The events the plain steps emit; a listener of any other takes the seamed steps.
PLAIN_EVENTS = ("forward_end", "ready", "launch", "backward_end", "finalized", "wait_failed",
                "late_gradient", "error")

#: The seams: each None (the plain behaviour) until an option attaches to it.
SEAMS = ("views", "batched_copy", "comm_hook", "unused", "static_graph")


def _seam(name: str, doc: str) -> property:
    """A seam's attribute: read at C speed, and attaching to it (or detaching) chooses the
    reducer's steps (``Reducer._route``)."""
    private = "_" + name

    def attach(reducer, value) -> None:
        setattr(reducer, private, value)
        reducer._route()
    return property(operator.attrgetter(private), attach, doc=doc)


class Step(enum.Enum):
    """Where the reducer stands in a step."""

    IDLE = "no synchronized backward expected"
    EXPECTING = "a synchronized forward ran; its backward has not reached the reducer"
    REDUCING = "gradients are being marked ready; the end of backward has not run"
    REDUCED = "this forward's backward has been reduced"
    SECOND_BACKWARD = "a backward reached this forward's outputs again after the reduction"


class Reducer:
    """Owns the buckets and the hooks of one DDP module. See the module docstring."""

    views = _seam("views", "gradient_as_bucket_view: .grad aliases the bucket")
    batched_copy = _seam("batched_copy",
                         "batched_grad_copy: a bucket's gradients copied in once it is full")
    comm_hook = _seam("comm_hook", "a bucket reduced by a hook instead of the all_reduce")
    unused = _seam("unused",
                   "find_unused_parameters: parameters no output reaches are ready too")
    static_graph = _seam("static_graph", "static_graph: firings counted in the first backward")
    graph_gradients = None  # backward(create_graph=True): gradients that require grad
    _views = _batched_copy = _comm_hook = _unused = _static_graph = None
    #: The steps through the seams, attached from outside the engine
    #: (``miniddp.options.seamed_steps``); a reducer takes them while it needs them (``_route``).
    seamed_steps = None

    def __init__(self, params: list[torch.Tensor], names: list[str], process_group=None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 views=None, overlap: bool = True, bucket_caps: list[int] | None = None):
        self.params, self.names = params, names
        self.group = held(process_group)  # None for the default group (see held)
        self.world_size = dist.get_world_size(process_group)
        self.divisor = self.world_size  # what gradients are divided by
        #: Byte limits of the buckets after the rebuild: the first bucket's, then the rest's
        #: (the last repeats); ``bucket_caps`` (torch's ``bucket_cap_mb_list``) when given.
        self.bucket_limits = bucket_caps or list(bucket_limits(bucket_cap_mb))
        self.bucket_caps = bucket_caps  # given as a list: it applies from iteration 0 too
        self.overlap = overlap
        self.find_unused = find_unused_parameters
        self._listeners: dict[str | None, list] = {}  # event (None: any other) -> callables
        self.views = views
        self.state = Step.IDLE
        self.forwards = self.synced_forwards = 0  # named when ranks fall out of step
        self.ready: set[int] = set()
        self.next_bucket = 0
        self.allreduce_calls = 0  # launched since the last forward
        self.ready_order: list[int] = []  # the first synced backward's order, for the rebuild
        self.has_rebuilt = False
        self.output_nodes: list = []  # the last synced forward's, until its backward ends
        self.error: BaseException | None = None  # what the last wait_failed or error names
        self._reciprocals: dict = {}  # (dtype, divisor) -> what gradients are multiplied by
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
        self._plain_class = type(self)  # its steps are swapped for the seamed ones and back
        self._route()

    # ----- bucket layout (torch's rules: miniddp.buckets) -----

    def initial_assignment(self) -> list[list[int]]:
        """Iteration 0: one bucket per dtype/device, unless unused parameters are expected."""
        limits = self.bucket_limits if self.find_unused else [UNLIMITED_BYTES]
        limits = self.bucket_caps or limits  # bucket_cap_mb_list applies from iteration 0
        return list(reversed(assign_buckets(self.params, limits)))

    @property
    def should_rebuild(self) -> bool:
        return not self.find_unused and not self.has_rebuilt

    def _init_buckets(self, assignment: list[list[int]]) -> None:
        # Free the old buffers before allocating the new ones (as torch does), or a rebuild holds
        # two copies of every bucket at once; a gradient that is a view keeps its buffer alive.
        self.buckets, self.slot_of = [], {}
        self.buckets = [Bucket(b, indices, self.params) for b, indices in enumerate(assignment)]
        for bucket in self.buckets:
            for slot, i in enumerate(bucket.param_indices):
                self.slot_of[i] = (bucket, slot)
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
        pass over the bucket, which pays on a CPU only for small gradients (measured in
        benchmarks/README.md). ``float("inf")``: every bucket (a GPU's); -1: none.
        """
        self.copy_at_end_bytes = max_bytes
        for bucket in self.buckets:
            bucket.copy_at_end = len(bucket.views) > 1 and self.views is None and all(
                view.numel() * view.element_size() <= max_bytes for view in bucket.views)
            self._reset(bucket)

    def bucket_info(self) -> list[BucketInfo]:
        return [bucket.info(self.names) for bucket in self.buckets]

    # ----- one step -----

    def begin_forward(self, sync: bool = True) -> None:
        """At a forward with grad enabled (``sync``: not inside ``no_sync``): fail on an
        unfinished reduction (the seamed steps also rebuild the buckets once).

        An unfinished reduction raises at once, naming the parameters, as torch does: waiting
        for the launched buckets could hang, since a rank missing a different parameter never
        launched some of them."""
        if self.state is Step.REDUCING:
            raise errors.logged(self, errors.unfinished_reduction(self))
        self.forwards, self.allreduce_calls = self.forwards + 1, 0
        self.state = Step.EXPECTING if self.state is Step.EXPECTING else Step.IDLE

    def prepare_for_backward(self, outputs):
        """End of a synced forward: expect hooks; return the outputs to use."""
        if self.ready:  # the last synced forward's backward never reached the reducer
            for bucket in self.buckets:
                self._reset(bucket)
            self.ready.clear()
        self.state, self.next_bucket, self.synced_forwards = (Step.EXPECTING, 0,
                                                              self.synced_forwards + 1)
        self._record("forward_end", -1)
        self.output_nodes = [t.grad_fn for t in tree_flatten(outputs)[0]
                             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        return outputs

    def outputs_of_unsynced_forward(self, outputs):
        """A forward with grad enabled inside ``no_sync``: with ``find_unused_parameters``,
        its outputs are watched too, as torch routes every forward's outputs through its sink.

        It matters after a synced forward that no backward followed (a validation forward
        without ``torch.no_grad()``): the hooks that forward expects are still expected, so the
        ``no_sync`` backward is reduced after all, and a parameter behind an output its loss
        ignores must still fire its hook to be marked ready (``find_unused_parameters``).
        Otherwise the watch changes nothing: hooks that are not expected only note use.
        """
        if self.unused is None:
            return outputs
        return self.unused.watch(outputs)

    def _hook(self, index: int) -> None:
        with self._lock:
            if self.state is Step.EXPECTING or self.state is Step.REDUCING:
                self._record("ready", index)
                self._mark_ready(index)
            elif self.state is Step.SECOND_BACKWARD:  # through a reduced forward: warn, or raise
                self._record("late_gradient", index)

    def _mark_ready(self, index: int) -> None:
        if index in self.ready:
            raise errors.marked_ready_twice(index, self.names[index])
        self.ready.add(index)
        self.state = Step.REDUCING
        bucket, slot = self.slot_of[index]
        grad = self.params[index].grad
        if bucket.copy_at_end and grad is not None:
            if grad.requires_grad:  # backward(create_graph=True): its value is averaged
                grad = self.graph_gradients.value(grad) if self.graph_gradients else grad.detach()
            bucket.waiting.append((grad, bucket.views[slot]))  # copied with the bucket's last
        else:
            self._copy_into_bucket(self.params[index], bucket.views[slot])
        bucket.pending -= 1
        if bucket.pending == 0:
            self._bucket_full(bucket)
        if len(self.ready) == len(self.params):
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _copy_into_bucket(self, param: torch.Tensor, view: torch.Tensor) -> None:
        """``view = grad * (1 / world_size)``, or zeros for a parameter without a gradient."""
        try:
            if param.grad is None:  # unused here: contribute zeros
                view.zero_()
            else:
                self._scale(param.grad, view)
        except RuntimeError as error:  # a gradient that requires grad (create_graph=True)?
            if self.graph_gradients is None:
                raise
            self.graph_gradients.copy_value(self, param, view, error)

    def _bucket_full(self, bucket: Bucket) -> None:
        """The bucket's last gradient is in: copy in those that waited, then launch it and any
        full ones waiting behind it."""
        if bucket.waiting:  # one call copies them all in, one scales the bucket
            grads, views = zip(*bucket.waiting)
            torch._foreach_copy_(list(views), list(grads))
            self._scale(bucket.buffer, bucket.buffer)
        self._launch_ready_buckets()

    def _scale(self, source: torch.Tensor, out: torch.Tensor) -> None:
        """``out = source * (1 / divisor)``: a gradient into its slot, or a whole bucket in
        place once its gradients are copied in (see ``copy_buckets_at_end``)."""
        torch.mul(source, self._reciprocal(out.dtype), out=out)

    def _reciprocal(self, dtype: torch.dtype):
        """``1 / divisor`` as torch's reducer multiplies by it; for float32 a 0-dim float32
        tensor: the same bits, and no new tensor per call."""
        try:
            return self._reciprocals[dtype, self.divisor]
        except KeyError:
            value = 1.0 / self.divisor
            value = torch.tensor(value, dtype=dtype) if dtype == torch.float32 else value
            return self._reciprocals.setdefault((dtype, self.divisor), value)

    @property
    def process_group(self):
        """The group the buckets' all_reduces run in. They launch through its own allreduce:
        ``dist.all_reduce``'s checks cost about 3 us a call."""
        return dist.group.WORLD if self.group is None else self.group

    def _launch_ready_buckets(self) -> None:
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        self._record("launch", bucket.index)
        bucket.work = self.process_group.allreduce([bucket.buffer])  # async, SUM
        self.allreduce_calls += 1

    def _finalize(self) -> None:
        """End of backward: wait for every bucket, write the averages into ``.grad``."""
        self._record("backward_end", -1)
        self.state = Step.REDUCED
        for bucket in self.buckets:
            self._wait(bucket)
            self._write_back_bucket(bucket)
            self._reset(bucket)  # for the next backward, while it is at hand
        self.ready.clear()
        for node in self.output_nodes:  # a backward reaching them again is a second one
            node.register_prehook(functools.partial(_call_reached_again, weakref.ref(self)))
        self.output_nodes = []
        self._record("finalized", -1)

    def _wait(self, bucket: Bucket) -> None:
        try:
            bucket.work.wait()
        except RuntimeError as error:  # the listeners may say where every rank was
            self.error = error
            self._record("wait_failed", bucket.index)
            raise

    def _write_back_bucket(self, bucket: Bucket) -> None:
        """The bucket's averages into ``.grad``: one call for the plain ones, while later
        buckets are still in flight."""
        grads, averages = [], []
        for i, view in zip(bucket.param_indices, bucket.views):
            grad = self.params[i].grad
            if grad is None or grad.requires_grad:
                self._write_back(i, view)
            else:
                grads.append(grad)
                averages.append(view)
        if grads:  # one dispatch for all: a private op, present from torch 2.1 on
            torch._foreach_copy_(grads, averages)

    def _write_back(self, index: int, view: torch.Tensor) -> None:
        """The average into a ``.grad`` that is missing, a bucket view, or part of a graph."""
        param = self.params[index]
        if self.views is not None:
            self.views.write_back(param, self.names[index], view)
        elif param.grad is None:
            param.grad = view.clone(memory_format=torch.preserve_format)
        else:
            self.graph_gradients.write_back(self.names[index], param.grad, view)

    @staticmethod
    def _reset(bucket: Bucket) -> None:
        bucket.pending, bucket.work, bucket.done = len(bucket.param_indices), None, None
        bucket.waiting.clear()

    def _reached_again(self) -> None:
        if self.state is Step.REDUCED:
            self.state = Step.SECOND_BACKWARD

    # ----- the event stream, clean-up -----

    def subscribe(self, listener, events=None) -> None:
        """Call ``listener((event, ident, time.perf_counter()))`` at each of ``events`` (every
        event when None; see :data:`EVENTS`)."""
        for event in (*EVENTS, None) if events is None else events:
            self._listeners.setdefault(event, []).append(listener)
        if events is None or not set(events) <= set(PLAIN_EVENTS):
            self._route()

    def unsubscribe(self, listener) -> None:
        kept = {event: [f for f in fs if f != listener]
                for event, fs in self._listeners.items()}
        self._listeners = {event: fs for event, fs in kept.items() if fs}
        if type(self) is not self._plain_class:  # perhaps plain again
            self._route()

    def _route(self) -> None:
        """Take the plain steps while nothing needs the seamed ones: no seam attached, the
        buckets rebuilt (or never to be), launches overlapping backward, and no listener of an
        event the plain steps do not emit."""
        if "_plain_class" not in self.__dict__:
            return  # still in __init__
        seamed = (self.should_rebuild or not self.overlap
                  or any(getattr(self, seam) is not None for seam in SEAMS)
                  or not set(self._listeners) <= set(PLAIN_EVENTS))
        self.__class__ = _seamed_class(self._plain_class) if seamed else self._plain_class

    def _record(self, event: str, ident: int) -> None:
        for listener in self._listeners.get(event, self._listeners.get(None, ())):
            listener((event, ident, time.perf_counter()))

    @property
    def timeline(self) -> list[tuple] | None:
        """A backward's events as ``(event, ident, time)`` (:data:`TIMELINE_EVENTS`), when set
        to a list (lessons, traces)."""
        return self.__dict__.get("_timeline")

    @timeline.setter
    def timeline(self, records: list[tuple] | None) -> None:
        old = self.__dict__.get("_timeline")
        if old is not None:
            self.unsubscribe(self._timeline_append)
        self._timeline = records
        if records is not None:
            self._timeline_append = records.append
            self.subscribe(self._timeline_append, TIMELINE_EVENTS)

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def __del__(self):
        if hasattr(self, "_hooks"):  # not when __init__ failed before registering them
            self.remove_hooks()




@functools.cache
def _seamed_class(plain: type) -> type:
    """``plain`` with the seamed steps' methods (``Reducer.seamed_steps``): the same name, and
    every ``isinstance``."""
    steps = Reducer.seamed_steps
    if steps is None:
        raise RuntimeError("a seam, a listener or the bucket rebuild needs the reducer's seamed "
                           "steps: import miniddp.options.seamed_steps (import miniddp does)")
    methods = {name: value for name, value in vars(steps).items()
               if callable(value) and not name.startswith("__")}
    return type(plain.__name__, (plain,), {**methods, "__qualname__": plain.__qualname__,
                                           "__module__": plain.__module__})


def _call_hook(reducer_ref, index: int, _grad_inputs, _grad_outputs) -> None:
    if (reducer := reducer_ref()) is not None:
        reducer._hook(index)


def _call_reached_again(reducer_ref, _grad_outputs) -> None:
    if (reducer := reducer_ref()) is not None:
        reducer._reached_again()
