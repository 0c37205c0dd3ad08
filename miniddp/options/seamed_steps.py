"""The reducer's steps through its seams: what a step does while an option is attached.

The engine's :class:`~miniddp.reducer.Reducer` runs its plain steps, which name no seam, while
nothing needs more. Attaching an option to a seam (gradient views, batched copy, a comm hook,
unused parameters, static graph), listening to an event the plain steps do not emit, waiting to
rebuild the buckets, or launching only after backward (``overlap=False``) swaps the reducer's
class for a subclass with these methods (``Reducer._route``), and back once nothing needs them.
Each is the plain step with a check at every point where an attached option changes it.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.utils._pytree import tree_flatten

from miniddp import errors
from miniddp.buckets import Bucket, rebuilt_assignment
from miniddp.reducer import Reducer, Step, _call_reached_again


class SeamedSteps:
    """The reducer's methods while it needs its seams (see the module docstring)."""

    def begin_forward(self, sync: bool = True) -> None:
        """The plain ``begin_forward``, and the buckets rebuilt once, after the first
        synchronized step."""
        if self.state is Step.REDUCING:
            raise errors.logged(self, errors.unfinished_reduction(self))
        self.forwards, self.allreduce_calls = self.forwards + 1, 0
        self.state = Step.EXPECTING if self.state is Step.EXPECTING else Step.IDLE
        if self.should_rebuild and self.ready_order:
            if "rebuild" in self._listeners:
                self._record("rebuild", -1)
            self._init_buckets(rebuilt_assignment(self.params, self.ready_order,
                                                  self.bucket_limits, self.group))
            self.has_rebuilt, self.ready_order = True, []
            self._route()
        if "forward" in self._listeners:
            self._record("forward", int(sync))

    def prepare_for_backward(self, outputs):
        """End of a synced forward: expect hooks; return the outputs to use."""
        if self.ready:  # the last synced forward's backward never reached the reducer
            for bucket in self.buckets:
                self._reset(bucket)
            self.ready.clear()
        self.state, self.next_bucket, self.synced_forwards = (Step.EXPECTING, 0,
                                                              self.synced_forwards + 1)
        if "forward_end" in self._listeners:
            self._record("forward_end", -1)
        if self.unused is not None:  # find the parameters no output reaches; watch outputs
            outputs = self.unused.prepare(outputs)
        if self.static_graph is not None:  # firings to expect; the first backward waits
            outputs = self.static_graph.prepare(outputs)
        self.output_nodes = [t.grad_fn for t in tree_flatten(outputs)[0]
                             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        return outputs

    def _hook(self, index: int) -> None:
        with self._lock:
            self._hook_through_seams(index)

    def _hook_through_seams(self, index: int) -> None:
        """A hook that a seam or the bucket rebuild needs to see first."""
        expected = self.state in (Step.EXPECTING, Step.REDUCING)
        if self.static_graph is not None and not self.static_graph.final_firing(index, expected):
            return  # counted, not yet this parameter's last firing
        if expected:
            self._gradient_ready(index)
        elif self.state is Step.SECOND_BACKWARD:  # through a reduced forward: warn, or raise
            self._record("late_gradient", index)
        elif self.unused is not None:  # no_sync, or a forward through ddp.module:
            self.unused.note_use(index)  # gradients just accumulate

    def _gradient_ready(self, index: int) -> None:
        if "ready" in self._listeners:
            self._record("ready", index)
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
        self.state = Step.REDUCING
        bucket, slot = self.slot_of[index]
        grad = self.params[index].grad
        if self.batched_copy is not None:
            self.batched_copy.copy_in(index, bucket, slot)
        elif bucket.copy_at_end and grad is not None:
            if grad.requires_grad:  # backward(create_graph=True): its value is averaged
                grad = self.graph_gradients.value(grad) if self.graph_gradients else grad.detach()
            bucket.waiting.append((grad, bucket.views[slot]))  # copied with the bucket's last
        else:
            self._copy_into_bucket(self.params[index], bucket.views[slot])
        bucket.pending -= 1
        if bucket.pending == 0:
            self._bucket_full(bucket)
        if len(self.ready) == len(self.params):
            if self.unused is not None:
                if "used_flags" in self._listeners:
                    self._record("used_flags", -1)
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
        except RuntimeError as error:  # a gradient that requires grad (create_graph=True)?
            if self.graph_gradients is None:
                raise
            self.graph_gradients.copy_value(self, param, view, error)

    def _bucket_full(self, bucket: Bucket) -> None:
        """The bucket's last gradient is in: copy in those that waited, then launch it and any
        full ones waiting behind it."""
        if self.batched_copy is not None:
            self.batched_copy.flush(bucket)
        elif bucket.waiting:  # one call copies them all in, one scales the bucket
            grads, views = zip(*bucket.waiting)
            torch._foreach_copy_(list(views), list(grads))
            if self.comm_hook is None:  # (a comm hook does its own scaling)
                self._scale(bucket.buffer, bucket.buffer)
        if self.overlap:
            self._launch_ready_buckets()

    def _launch(self, bucket: Bucket) -> None:
        if self.unused is not None and self.unused.skips(bucket):
            return
        if "launch" in self._listeners:
            self._record("launch", bucket.index)
        if self.comm_hook is None:
            bucket.work = self.process_group.allreduce([bucket.buffer])  # async, SUM
        else:  # the hook's future replaces the all_reduce
            bucket.work = self.comm_hook.launch(self, bucket)
        self.allreduce_calls += 1
        if "done" in self._listeners:
            # A chained future, waited for in _finalize: the callback runs on a communication
            # thread, and must not still be running when the process exits.
            future = bucket.work if self.comm_hook else bucket.work.get_future()
            bucket.done = future.then(lambda _f, b=bucket.index: self._record("done", b))

    def _finalize(self) -> None:
        """End of backward: wait for every bucket, write the averages into ``.grad``."""
        if "backward_end" in self._listeners:
            self._record("backward_end", -1)
        self.state = Step.REDUCED
        self._launch_ready_buckets()  # overlap=False launches everything here
        used = self.unused.used_on_some_rank() if self.unused is not None else None
        if self.static_graph is not None:  # used by some rank in the first backward
            used = self.static_graph.end_backward()
        for bucket in self.buckets:
            if bucket.work is not None:  # (None: skipped, skip_all_reduce_unused_params)
                self._wait(bucket)
                self._write_back_used(bucket, used)
            self._reset(bucket)  # for the next backward, while it is at hand
        self.ready.clear()
        for node in self.output_nodes:  # a backward reaching them again is a second one
            node.register_prehook(functools.partial(_call_reached_again, weakref.ref(self)))
        self.output_nodes = []
        if "finalized" in self._listeners:
            self._record("finalized", -1)

    def _wait(self, bucket: Bucket) -> None:
        try:
            bucket.work.wait()
        except RuntimeError as error:  # the listeners may say where every rank was
            self.error = error
            self._record("wait_failed", bucket.index)
            raise
        if self.comm_hook is not None:  # its result goes into the bucket
            self.comm_hook.take_result(bucket)
        if bucket.done is not None:
            bucket.done.wait()
        if "waited" in self._listeners:
            self._record("waited", bucket.index)


    def _write_back_used(self, bucket: Bucket, used: list[bool] | None) -> None:
        """The plain write-back, but for parameters no rank used (their ``.grad`` stays) and
        gradient views (their ``.grad`` is the bucket)."""
        if used is None and self.views is None:
            return self._write_back_bucket(bucket)
        grads, averages = [], []
        for i, view in zip(bucket.param_indices, bucket.views):
            if used is not None and not used[i]:  # unused on every rank: .grad stays
                continue
            grad = self.params[i].grad
            if grad is None or grad.requires_grad or self.views is not None:
                self._write_back(i, view)
            else:
                grads.append(grad)
                averages.append(view)
        if grads:
            torch._foreach_copy_(grads, averages)


Reducer.seamed_steps = SeamedSteps
