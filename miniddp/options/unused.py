"""Finding parameters that take no part in this step's loss (``find_unused_parameters``).

A parameter the loss does not depend on gets no gradient, so without help its hook never fires
and its bucket waits forever. Two cases, handled as torch's DDP handles them:

* no output of forward reaches it: found at the end of forward by walking the autograd graph
  from the outputs (:func:`unreached_parameters`); the reducer marks it ready at the first hook;
* it is reached only through outputs that the loss ignores. Forward cannot know that. So the
  outputs are returned through one identity autograd function (:func:`watch_outputs`, torch's
  ``DDPSink``): backward from any used output passes through it, and it hands an *undefined*
  gradient to each ignored output. Backward then still walks those outputs' graphs, with
  nothing to compute, and each parameter's AccumulateGrad node runs and fires the reducer's
  hook with no gradient: ready, contributing zeros, not counted as used.

:class:`UnusedParameters` is what the reducer holds when the option is on. It also keeps a flag
per parameter, "got a gradient on this rank since the last synchronized step" (``no_sync``
steps count), summed across ranks once every parameter is ready: a parameter unused on *every*
rank keeps its ``.grad`` as it was (``None`` stays ``None``), one used on some ranks gets the
average of what they have.

``skip_all_reduce_unused_params=True`` (torch 2.13) goes one step further: a bucket whose every
parameter no output reached on this rank is not all_reduced at all, and its gradients are left
as they are. That is only right when every rank leaves the same parameters unused in every
step (torch's documented condition): otherwise ranks launch different collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from miniddp import profiling
from miniddp.errors import print_warning
from miniddp.profiling import NO_SPAN

#: Printed at a synchronized forward whose outputs reach every parameter, once per process (every
#: time under ``torch.set_warn_always(True)``), to stderr, as torch's reducer does
#: (``miniddp.errors``); it opens with torch's sentence, the words users search for.
NOTHING_UNUSED = (
    "find_unused_parameters=True was specified in DDP constructor, but did not find any unused "
    "parameters in the forward pass. Every parameter was reached from this forward's outputs, "
    "and the search for unreached ones walks the autograd graph on each synchronized step: "
    "leave the option off unless some step (a branch not taken, a frozen head) really skips "
    "parameters.")


class UnusedParameters:
    """The reducer's side of ``find_unused_parameters=True``. See the module docstring."""

    def __init__(self, params: list[torch.Tensor], group=None):
        self.params, self.group = params, group
        self.locally_used = torch.zeros(len(params), dtype=torch.int32)
        self.unreached: list[int] = []
        self.unreached_this_step: set[int] = set()
        self.skip_unused_buckets = False  # skip_all_reduce_unused_params
        self.used_everywhere = self.work = None
        self.clone_outputs = True  # False: ddp._set_ddp_sink_clone(False)
        #: the same parameters unused every step so far (what torch's ``_ddp_graph_static()`` says)
        self.graph_static = True
        self._previous_unreached: list[int] | None = None

    def prepare(self, outputs):
        """End of a synced forward: find what no output reaches; return the watched outputs."""
        with profiling.span("search_unused_parameters") if profiling.recording() else NO_SPAN:
            self.unreached = unreached_parameters(self.params, output_grad_fns(outputs))
        self.unreached_this_step = set(self.unreached)
        if not self.unreached:
            print_warning(NOTHING_UNUSED, once=True)
        if self._previous_unreached is not None and self._previous_unreached != self.unreached:
            self.graph_static = False
        self._previous_unreached = list(self.unreached)
        return watch_outputs(outputs, self.clone_outputs)

    def watch(self, outputs):
        """A ``no_sync`` forward's outputs, through the same watch, as torch routes every
        forward's outputs through its sink; nothing is searched.

        It matters after a synced forward that no backward followed (a validation forward
        without ``torch.no_grad()``): the hooks that forward expects are still expected, so the
        ``no_sync`` backward is reduced after all, and a parameter behind an output its loss
        ignores must still fire its hook to be marked ready. Otherwise the watch changes
        nothing: hooks that are not expected only note use.
        """
        return watch_outputs(outputs)

    def note_use(self, index: int) -> None:
        if self.params[index].grad is not None:
            self.locally_used[index] = 1

    def take_unreached(self) -> list[int]:
        """The parameters to mark ready (with zeros) at the first hook: once per backward."""
        unreached, self.unreached = self.unreached, []
        return unreached

    def skips(self, bucket) -> bool:
        """With ``skip_all_reduce_unused_params``: True for a bucket no output reached."""
        return self.skip_unused_buckets and self.unreached_this_step.issuperset(
            bucket.param_indices)

    def share(self) -> None:
        """Every parameter is ready: sum the flags across ranks, while the buckets fly."""
        self.used_everywhere = self.locally_used.to(self.params[0].device, copy=True)
        self.work = dist.all_reduce(self.used_everywhere, group=self.group, async_op=True)

    def used_on_some_rank(self) -> list[bool]:
        """End of backward: which parameters some rank used; the flags start over."""
        self.work.wait()
        self.locally_used.zero_()
        return self.used_everywhere.cpu().bool().tolist()


def unreached_parameters(params: list[torch.Tensor], grad_fns) -> list[int]:
    """Indices of ``params`` that the autograd graphs below ``grad_fns`` do not reach."""
    stack = [fn for fn in grad_fns if fn is not None]
    seen, reached = set(stack), set()
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            reached.add(id(variable))
        for next_node, _ in node.next_functions:
            if next_node is not None and next_node not in seen:
                seen.add(next_node)
                stack.append(next_node)
    return [i for i, p in enumerate(params) if id(p) not in reached]


def output_grad_fns(obj) -> list:
    """The autograd nodes of every tensor in a forward output: tensors inside lists, tuples,
    dicts and dataclasses, subclasses included (what torch's DDP searches)."""
    if isinstance(obj, torch.Tensor):
        return [obj.grad_fn] if obj.grad_fn is not None else []
    if isinstance(obj, dict):
        obj = list(obj.values())
    elif hasattr(obj, "__dataclass_fields__"):
        obj = [getattr(obj, name) for name in obj.__dataclass_fields__]
    if isinstance(obj, (list, tuple)):
        return [fn for item in obj for fn in output_grad_fns(item)]
    return []


def watch_outputs(outputs, clone: bool = True):
    """``outputs`` with every tensor that has a grad_fn passed through :class:`_WatchOutputs`.

    The structure is taken apart with torch's pytree (as torch's DDP does): tensors inside
    containers it does not know, such as dataclasses, are left as they are.
    """
    leaves, spec = tree_flatten(outputs)
    tracked = [k for k, t in enumerate(leaves) if getattr(t, "grad_fn", None) is not None]
    if not tracked:
        return outputs
    watched = _WatchOutputs.apply(clone, *(leaves[k] for k in tracked))
    for k, t in zip(tracked, watched):
        leaves[k] = t
    return tree_unflatten(leaves, spec)


class _WatchOutputs(torch.autograd.Function):
    """Identity on forward's outputs; in backward, an ignored output's gradient stays undefined
    (not materialized as zeros) on its way to the parameters behind it."""

    @staticmethod
    def forward(ctx, clone, *outputs):
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in outputs) if clone else outputs

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)
