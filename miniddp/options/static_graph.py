"""``static_graph=True``: the user promises the autograd graph is the same every iteration.

Two things the ordinary reducer cannot do become possible with that promise:

* **a parameter whose gradient arrives in several pieces.** A layer applied twice under
  reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``) is
  differentiated in two separate inner backward passes, so its AccumulateGrad hook fires twice
  per backward. The ordinary reducer would call the gradient ready at the first firing (and
  fail at the second: "marked ready twice"). Here the first backward only *counts* the firings
  of every parameter; from then on a parameter is ready when this backward's count is reached.
* **unused parameters without ``find_unused_parameters``.** A parameter whose hook never fired
  in the first backward is unused for good: it is marked ready (contributing zeros) at the first
  hook of every later backward, with no walk of the autograd graph at each forward. Whether
  *any* rank used it is settled once, by one all_reduce of flags; a parameter no rank used keeps
  its ``.grad`` untouched (``None`` stays ``None``).

The price is paid in the first iteration, as in torch's DDP (``_delay_all_reduce``): while the
hooks are only being counted nothing can be launched, so the first backward reduces every
bucket at its end. The outputs of the first synchronized forward pass through an identity
function, :class:`_FirstBackward`, whose backward runs before any parameter's and queues
:meth:`StaticGraph.delay_all_reduce` on the autograd engine; that marks every parameter ready,
and the reducer's usual end of backward follows.

When the buckets are rebuilt, which at 3 ranks and more changes bits: the first backward
records no ready order, so the next forward keeps the one-bucket layout. The *second*
synchronized backward records the order in which parameters become ready (at their last
firing), the parameters unused in the first backward are appended at the end, and the rebuild
happens at the start of the third synchronized forward.

:class:`StaticGraph` is what the reducer holds as ``reducer.static_graph``. It attaches at four
points the core names: the hook (:meth:`~StaticGraph.final_firing`), the end of a synchronized
forward (:meth:`~StaticGraph.prepare`), the first ready gradient
(:meth:`~StaticGraph.take_unused`) and the end of backward
(:meth:`~StaticGraph.used_on_some_rank`).
A graph that changes after the first iteration is an error, with a message saying so.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from miniddp.reducer import Step

#: torch's message for a parameter that starts being used (code and tests match on it).
GRAPH_CHANGED = (
    "Your training graph has changed in this iteration, e.g., one parameter is unused in first "
    "iteration, but then got used in the second iteration. this is not compatible with "
    "static_graph set to True.")


class StaticGraph:
    """The reducer's side of ``static_graph=True``. See the module docstring."""

    #: What the reducer's "Expected to have finished reduction" error advises.
    changed_graph_advice = (
        "static_graph=True is set, so the training graph must stay the one of the first "
        "iteration: this iteration used fewer parameters, or used some fewer times (e.g. a "
        "layer skipped, or checkpointed once instead of twice). Make every iteration use the "
        "same parameters the same number of times, or leave static_graph=False.")

    def __init__(self, reducer):
        self._reducer = weakref.ref(reducer)  # the reducer holds this object
        self.params, self.names = reducer.params, reducer.names
        self.group = reducer.group
        self.counting = True  # until the end of the first synchronized backward
        self.firings = [0] * len(self.params)  # per parameter, counted in the first backward
        self.remaining: list[int] = []  # firings still expected in this backward
        self.locally_used = torch.zeros(len(self.params), dtype=torch.int32)
        self.unused: list[int] = []  # parameters whose hook never fired in the first backward
        self.used: list[bool] | None = None  # used on some rank in the first backward
        self._unmarked: list[int] = []
        self._first_backward_queued = False
        self._work = self._used_everywhere = None
        self.clone_outputs = True  # False: ddp._set_ddp_sink_clone(False)

    @classmethod
    def attach(cls, reducer, initial_buckets: bool) -> StaticGraph:
        """Turn ``static_graph`` on for ``reducer``; before its first forward only.

        ``find_unused_parameters`` becomes unnecessary (unused parameters are found in the first
        backward) and is switched off, which also lets the buckets be rebuilt. With
        ``initial_buckets`` (from the constructor) the iteration-0 layout is made again as
        torch's constructor makes it for a static graph: one bucket per dtype and device.
        """
        if reducer.state is not Step.IDLE or reducer.has_rebuilt:
            raise RuntimeError(
                "static_graph can only be turned on before the first forward: pass "
                "static_graph=True to DistributedDataParallel, or call _set_static_graph() "
                "right after constructing it. (torch's DDP says: set_static_graph() should be "
                "called before training loop starts and after DistributedDataParallel is "
                "constructed.)")
        if reducer.unused is not None:
            reducer.attach(unused=None)
            if initial_buckets:
                reducer.lay_out_buckets(reducer.initial_assignment())
        reducer.attach(static_graph=cls(reducer))
        return reducer.static_graph

    # ----- where the reducer calls it -----

    def prepare(self, outputs):
        """End of a synchronized forward: expect this backward's firings; return the outputs.

        Until the first backward has run, the outputs go through :class:`_FirstBackward`.
        """
        self.remaining = list(self.firings)
        self._unmarked = list(self.unused)
        if self.counting and not self._first_backward_queued:
            outputs = _watch(outputs, self._queue_delay_all_reduce, self.clone_outputs)
        return outputs

    def final_firing(self, index: int, expect_hooks: bool) -> bool:
        """At each firing of a parameter's hook: True when the reducer should treat it as this
        parameter's gradient being ready (its last firing of the backward)."""
        if self.counting:
            if not expect_hooks:
                reducer = self._reducer()
                if reducer.forwards == reducer.synced_forwards:  # no forward of this DDP in
                    return True  # no_sync: a backward that bypassed it (e.g. an inner DDP)
                raise RuntimeError(
                    "with static_graph=True the first backward must follow a synchronized "
                    "forward: it counts how often each parameter's gradient arrives, and a "
                    "forward inside no_sync() does not count. Run the first iteration outside "
                    "no_sync(). (torch's DDP stops with an internal assertion here.)")
            self.firings[index] += 1
            if self.params[index].grad is not None:
                self.locally_used[index] = 1
            return False
        if not expect_hooks:  # inside no_sync: the reducer ignores it
            return True
        if self.remaining[index] == 0:  # as torch's, the next forward reports the step unfinished
            raise self._reducer().abandon_step(RuntimeError(
                f"the gradient of {self.names[index]!r} arrived more often in this backward "
                f"than in the first, where it arrived {self.firings[index]} time(s): the "
                "training graph has changed, which static_graph=True does not allow (e.g. a "
                "parameter unused in the first iteration is used now). Make every iteration "
                "use the same parameters the same number of times, or leave "
                f"static_graph=False.\nIn torch's words: {GRAPH_CHANGED}"))
        self.remaining[index] -= 1
        return self.remaining[index] == 0

    @property
    def unreached_this_step(self) -> list[int]:
        """The parameters unused in this step (those of the first backward), as
        ``find_unused_parameters`` names them."""
        return self.unused

    def take_unused(self) -> list[int]:
        """The parameters unused in the first backward, to mark ready (with zeros) at the
        first ready gradient of each later backward: once per backward."""
        unmarked, self._unmarked = self._unmarked, []
        return unmarked

    def used_on_some_rank(self) -> list[bool]:
        """End of a synchronized backward: which parameters some rank used in the first one.

        After the second backward, the unused parameters join the recorded ready order last,
        so that the rebuilt buckets hold every parameter.
        """
        reducer = self._reducer()
        if reducer.should_rebuild and reducer.ready_order:
            reducer.ready_order.extend(self.unused)
        if self.used is None:
            self._work.wait()
            self.used = self._used_everywhere.cpu().bool().tolist()
        return self.used

    # ----- the first backward -----

    def _queue_delay_all_reduce(self) -> None:
        if not self._first_backward_queued:  # several outputs of several forwards: once
            self._first_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.delay_all_reduce)

    def delay_all_reduce(self) -> None:
        """End of the first backward: every firing has been counted; reduce everything now.

        Starts the all_reduce of the "used here" flags, then marks every parameter ready in
        index order (an unused one contributes zeros); the reducer launches the buckets and
        queues its usual end of backward, which follows this callback.
        """
        reducer = self._reducer()
        self.counting = False
        self.unused = [i for i, count in enumerate(self.firings) if count == 0]
        self._used_everywhere = self.locally_used.to(self.params[0].device, copy=True)
        self._work = dist.all_reduce(self._used_everywhere, group=self.group, async_op=True)
        reducer.mark_all_ready()


def _watch(outputs, on_backward, clone: bool = True):
    """``outputs`` with every tensor that has a grad_fn passed through :class:`_FirstBackward`."""
    leaves, spec = tree_flatten(outputs)
    tracked = [k for k, t in enumerate(leaves)
               if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    if not tracked:
        return outputs
    watched = _FirstBackward.apply(on_backward, clone, *(leaves[k] for k in tracked))
    for k, t in zip(tracked, watched):
        leaves[k] = t
    return tree_unflatten(leaves, spec)


class _FirstBackward(torch.autograd.Function):
    """Identity on forward's outputs; its backward, the first node of the backward pass, calls
    ``on_backward``. Gradients the loss does not produce stay undefined, as in torch's
    ``_DDPSink``, so parameters behind ignored outputs still fire (without a gradient)."""

    @staticmethod
    def forward(ctx, on_backward, clone, *outputs):
        ctx.set_materialize_grads(False)
        ctx.on_backward = on_backward
        return tuple(t.clone() for t in outputs) if clone else outputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.on_backward()
        return (None, None, *grads)
