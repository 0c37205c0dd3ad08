"""The reducer: averages gradients across ranks while the backward pass is still running.

The life of one synchronized step:

1. ``prepare_for_backward`` (end of forward): expect one hook per parameter; with
   ``find_unused_parameters`` walk the autograd graph to find parameters the output does not
   depend on.
2. A hook fires for each parameter once its gradient has been accumulated into ``.grad``. It
   is a post-hook on the parameter's AccumulateGrad node, as in torch's reducer, rather than
   ``Tensor.register_post_accumulate_grad_hook``: it runs after any such hook of the user's (so
   it reduces the gradient those hooks leave), and it also fires when the gradient that arrives
   is undefined (how parameters behind outputs the loss ignored are found). It copies
   ``grad * (1 / world_size)`` into the parameter's slot of its bucket (multiplying by the
   reciprocal before a SUM is exactly what torch does, and what makes the bits match). When a
   bucket's last slot is filled, its ``all_reduce(async_op=True)`` starts, buckets strictly in
   order, so every rank issues the same collectives in the same order.
3. When every parameter is ready, a callback is queued on the autograd engine. It runs after
   the last gradient is computed, waits for every bucket, and writes the averages back into
   ``.grad``. So when ``loss.backward()`` returns, gradients are synchronized.

Unused parameters get no hook. Without ``find_unused_parameters`` their bucket never fills and
the next forward raises, naming them. With it, they are marked ready (zero contribution) at the
first hook, and a flag per parameter is summed across ranks so that a parameter unused on every
rank keeps its ``.grad`` untouched.

Buckets start as one bucket holding everything (the order gradients arrive in is unknown), are
rebuilt once, at the next forward, in the order gradients became ready (rank 0's order wins),
exactly when torch rebuilds.

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

from miniddp.buckets import ONE_BUCKET, Bucket, BucketInfo, assign_buckets, bucket_limits
from miniddp.sync import rank0_assignment
from miniddp.unused import output_grad_fns, unreached_parameters, watch_outputs


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class Reducer:
    """Owns the buckets and the hooks of one DDP module. See the module docstring."""

    def __init__(self, params: list[torch.Tensor], names: list[str], process_group=None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = False, overlap: bool = True):
        self.params, self.names = params, names
        self.group = process_group
        # Launch through the group's own allreduce: dist.all_reduce's checks cost ~3 us a call.
        self._process_group = dist.group.WORLD if process_group is None else process_group
        self.world_size = dist.get_world_size(process_group)
        self.first_bucket_bytes, self.bucket_bytes = bucket_limits(bucket_cap_mb)
        self.find_unused = find_unused_parameters
        self.grad_as_view = gradient_as_bucket_view
        self.overlap = overlap
        self.expect_hooks = False  # True between a synced forward and the end of its backward
        self.require_finalize = False  # a parameter was marked ready and finalize has not run
        self.ready: set[int] = set()
        self.unused: list[int] = []
        self.marked_unused = False
        self.next_bucket = 0
        self.locally_used = torch.zeros(len(params), dtype=torch.int32)
        self.used_work = self.global_used = None
        self.ready_order: list[int] = []  # the first synced backward's order, for the rebuild
        self.has_rebuilt = False
        self.allreduce_calls = 0  # launched since the last forward (reset by the DDP wrapper)
        self.timeline: list[tuple] | None = None  # set to [] to record (event, id, time) tuples
        self._lock = threading.Lock()  # a module on several GPUs runs hooks on several threads
        # A parameter's AccumulateGrad node is created lazily and held weakly by the parameter:
        # keep it, or a new node (without the hook) replaces it. The hooks hold the reducer
        # weakly, so a dropped DDP wrapper leaves no live hook on a module used afterwards.
        self._accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in params]
        me = weakref.ref(self)
        self._hooks = [node.register_hook(functools.partial(_call_hook, me, i))
                       for i, node in enumerate(self._accumulators)]
        self._init_buckets(self.initial_assignment())

    # ----- bucket layout -----

    def initial_assignment(self) -> list[list[int]]:
        """Iteration 0: one bucket per dtype/device, unless unused parameters are expected."""
        limits = [self.first_bucket_bytes, self.bucket_bytes] if self.find_unused else [ONE_BUCKET]
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
        if self.grad_as_view:  # gradients that already exist move into the new buckets
            for bucket in self.buckets:
                for slot, i in enumerate(bucket.param_indices):
                    grad = self.params[i].grad
                    if grad is not None and not _same_storage(grad, bucket.views[slot]):
                        bucket.views[slot].copy_(grad)
                        self.params[i].grad = bucket.views[slot]

    def bucket_info(self) -> list[BucketInfo]:
        return [bucket.info(self.names) for bucket in self.buckets]

    def rebuild_buckets_if_due(self) -> bool:
        """At a forward with grad enabled: fail on an unfinished reduction, rebuild once."""
        self.ensure_prior_reduction_finished()
        if not self.should_rebuild or not self.ready_order:
            return False
        order = self.ready_order
        limits = [self.first_bucket_bytes, self.bucket_bytes]
        assignment = assign_buckets([self.params[i] for i in order], limits, order)
        n, device = len(self.params), self.params[0].device
        self._init_buckets(rank0_assignment(assignment, n, device, self.group))
        self.has_rebuilt, self.ready_order = True, []
        return True

    # ----- one backward pass -----

    def prepare_for_backward(self, outputs):
        """Called at the end of a synced forward: expect hooks; return the outputs to use.

        With ``find_unused_parameters``, parameters that no output reaches are found now, and
        the outputs come back watched, so that outputs the loss ignores still lead backward to
        their parameters' hooks (see ``miniddp.unused``).
        """
        self.expect_hooks = True
        self.ready.clear()
        self.unused, self.marked_unused = [], False
        self.next_bucket = 0
        self.allreduce_calls = 0
        for bucket in self.buckets:
            bucket.pending, bucket.work, bucket.recorded = len(bucket.param_indices), None, None
        if not self.find_unused:
            return outputs
        self.unused = unreached_parameters(self.params, output_grad_fns(outputs))
        return watch_outputs(outputs)

    def _hook(self, index: int) -> None:
        with self._lock:
            # Used = has a gradient; one from a no_sync step counts too, as in torch.
            if self.find_unused and self.params[index].grad is not None:
                self.locally_used[index] = 1
            if not self.expect_hooks:
                return  # inside no_sync: gradients just accumulate
            self._record("ready", index)
            if not self.marked_unused:
                self.marked_unused = True
                for unused in self.unused:
                    self._mark_ready(unused)
            if self.should_rebuild:
                self.ready_order.append(index)
            self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        if index in self.ready:
            raise RuntimeError(
                f"parameter {self.names[index]!r} was marked ready twice in one backward. "
                "Is it used outside forward, or in two reentrant backward passes "
                "(e.g. checkpointing the same layer twice)?")
        self.ready.add(index)
        self.require_finalize = True
        bucket, slot = self.locate[index]
        self._copy_into_bucket(self.params[index], bucket.views[slot])
        bucket.pending -= 1
        if self.overlap:
            self._launch_ready_buckets()
        if len(self.ready) == len(self.params):
            if self.find_unused:  # sum the used flags across ranks while buckets fly
                self.global_used = self.locally_used.to(self.params[0].device, copy=True)
                self.used_work = dist.all_reduce(self.global_used, group=self.group,
                                                 async_op=True)
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _copy_into_bucket(self, param: torch.Tensor, view: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:  # unused here: contribute zeros
            view.zero_()
        elif self.grad_as_view and _same_storage(grad, view):
            view.div_(self.world_size)  # torch divides in place when grad already is the view
        else:
            try:
                torch.mul(grad, 1.0 / self.world_size, out=view)
            except RuntimeError:
                if grad.requires_grad:
                    raise self._higher_order_error(param) from None
                raise
            if self.grad_as_view:
                param.grad = view

    def _higher_order_error(self, param: torch.Tensor) -> RuntimeError:
        name = next(n for p, n in zip(self.params, self.names) if p is param)
        return RuntimeError(
            f"the gradient of {name!r} requires grad: backward(create_graph=True) is not "
            "supported (torch's DDP fails here too; it never synchronizes higher-order "
            "gradients). For a gradient penalty, take the inner gradient with "
            "torch.autograd.grad(..., create_graph=True) and call loss.backward() plainly.")

    def _launch_ready_buckets(self) -> None:
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        self._record("launch", bucket.index)
        bucket.work = self._process_group.allreduce([bucket.buffer])  # async, SUM
        self.allreduce_calls += 1
        if self.timeline is not None:
            # A chained future, waited for in _finalize: the callback runs on a communication
            # thread, and must not still be running when the process exits.
            bucket.recorded = bucket.work.get_future().then(
                lambda _f, b=bucket.index: self._record("done", b))

    def _finalize(self) -> None:
        """End of backward: wait for every bucket, write the averages into ``.grad``."""
        self._record("backward_end", -1)
        self.expect_hooks = False
        self.require_finalize = False
        self._launch_ready_buckets()  # overlap=False launches everything here
        if self.find_unused:
            self.used_work.wait()
            globally_used = self.global_used.cpu()
            self.locally_used.zero_()
        for bucket in self.buckets:
            bucket.work.wait()
            if bucket.recorded is not None:
                bucket.recorded.wait()
            self._record("waited", bucket.index)
            for slot, i in enumerate(bucket.param_indices):
                if self.find_unused and not globally_used[i]:
                    continue  # unused on every rank: .grad stays as it was
                self._write_back(i, bucket.views[slot])
        self._record("finalized", -1)

    def _write_back(self, index: int, view: torch.Tensor) -> None:
        param = self.params[index]
        if self.grad_as_view:
            if param.grad is None:
                param.grad = view
            elif not _same_storage(param.grad, view):
                raise RuntimeError(
                    f"the .grad of {self.names[index]!r} is no longer a view "
                    "of its bucket; with gradient_as_bucket_view=True, don't replace .grad")
        elif param.grad is None:
            param.grad = view.clone(memory_format=torch.preserve_format)
        else:
            param.grad.copy_(view)

    def ensure_prior_reduction_finished(self) -> None:
        """Raise, naming the parameters, if the last synced backward never completed."""
        if not self.require_finalize:
            return
        # Raise at once, as torch does: waiting for the launched buckets could hang, since a
        # rank missing a different parameter never launched some of them.
        missing = [self.names[i] for i in range(len(self.params)) if i not in self.ready]
        if self.find_unused:
            advice = ("find_unused_parameters=True is set, so probably not every output of "
                      "forward was used to compute the loss: use them all, or return only "
                      "what the loss needs.")
        else:
            advice = ("If some parameters legitimately take no part in the loss, pass "
                      "find_unused_parameters=True to DistributedDataParallel; otherwise make "
                      "sure every output of forward contributes to the loss.")
        raise RuntimeError(
            "Expected to have finished reduction in the prior iteration before starting a new "
            f"one: rank {dist.get_rank()} got no gradient in the last backward for these "
            f"parameters: {', '.join(missing)}. {advice}")

    def _record(self, event: str, ident: int) -> None:
        if self.timeline is not None:
            self.timeline.append((event, ident, time.perf_counter()))

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def __del__(self):
        self.remove_hooks()


def _call_hook(reducer_ref, index: int, _grad_inputs, _grad_outputs) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer._hook(index)
