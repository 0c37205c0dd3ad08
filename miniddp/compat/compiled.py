"""``torch.compile``: letting torch's compiler see miniddp's DDP as it sees its own.

DDP overlaps communication with backward because the autograd engine calls a hook on each
parameter as soon as that parameter's gradient exists. A compiled model runs its whole backward
as one opaque function: every gradient appears when it returns, every hook fires then, and no
all_reduce can start before the computation has ended. torch's compiler (dynamo's
``DDPOptimizer``, ``torch/_dynamo/backends/distributed.py``) gets the overlap back by cutting the
compiled graph where DDP's buckets would be cut (walking the graph from its end, a new piece
whenever the parameters met reach ``bucket_bytes_cap``; the first piece at
``dist._DEFAULT_FIRST_BUCKET_BYTES``), so backward runs as several compiled pieces and each
bucket fills as its piece returns.

How dynamo recognises DDP (the same from torch 2.0's ``eval_frame.py`` to 2.13's
``convert_frame.py``): while it compiles a frame it asks
``torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()``, which returns the
class attribute ``_active_ddp_module`` that torch's DDP sets only while its wrapped module's
forward runs (``_inside_ddp_forward``). If a module is returned (and
``torch._dynamo.config.optimize_ddp`` is on), the frame goes to ``DDPOptimizer`` with that
module's ``bucket_bytes_cap``; it reads nothing else from the module. Parameters marked
``_ddp_ignored`` (by ``_set_params_and_buffers_to_ignore_for_model``, which miniddp shares
with torch) do not count toward a piece.

So miniddp sets that same attribute around ``self.module(...)`` (the engine's ``_run_module``,
with torch's DDP class as its ``active_module_holder``; :func:`inside_forward` when traced), and
gets the same cuts, the same order of ready gradients, hence the same rebuilt buckets and, at
3 ranks and more, the same bits as torch's compiled DDP.

``torch.compile(ddp)`` traces DDP's own forward too. torch's forward costs it three graph breaks:
its bookkeeping runs outside the graph and the user's model is compiled in one graph. miniddp's
forward, traced line by line, broke the graph at each collective, each check and the reducer's
bookkeeping (8 breaks, 9 graphs), and compiled the wrapped module in its own frame. When dynamo
traces it, :func:`forward` instead hands the whole forward to a function whose own frame dynamo
skips but whose callees it compiles, as it does for torch's DDP (whose file it skips): three
graph breaks, as torch's, and exactly the frames torch's compiled DDP compiles (a
``torch.nn.Sequential``, all torch's frames, is not compiled at all under
``torch.compile(DDP(m))``, with either DDP).
The eager path never imports ``torch._dynamo`` (seconds of CPU in a fresh process).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.nn.parallel.distributed import DistributedDataParallel as _TorchDDP

#: The graph breaks ``torch.compile(ddp)`` costs around miniddp's forward (see above): three, as
#: torch's DDP costs on 2.11 and 2.13 (on 2.3 and 2.4 torch's costs one; the pieces, buckets and
#: bits are the same).
GRAPH_BREAKS = 3

FIRST_BUCKET_PHRASE = ("First bucket should be smaller/equal to other buckets to get comms "
                       "warmed up ASAP")


def torch_ddp_class() -> type:
    """Where torch's compiler looks for the running DDP module: torch's DDP class (the
    engine's ``active_module_holder``)."""
    return _TorchDDP


def active_ddp_module():
    """The DDP module whose wrapped forward is running, torch's or miniddp's (or None)."""
    return _TorchDDP._active_ddp_module


@contextmanager
def inside_forward(ddp):
    """Around ``ddp.module(...)``: dynamo compiles what runs here as DDP's wrapped module.

    Restores the previous module on the way out, so a DDP nested inside another (as torch does).
    A compile refused because of the bucket cap gets miniddp's explanation.
    """
    holder = ddp.active_module_holder
    previous = holder._active_ddp_module
    holder._active_ddp_module = ddp
    try:
        yield
    except AssertionError as error:
        explain_assertion(ddp, error)
        raise
    finally:
        holder._active_ddp_module = previous


def explain_assertion(ddp, error: AssertionError) -> None:
    """The engine's ``explain_assertion``: a compile refused because of the bucket cap gets
    miniddp's explanation."""
    if FIRST_BUCKET_PHRASE in str(error):
        raise first_bucket_refused(ddp) from error


def forward(ddp, inputs, kwargs):
    """DDP's forward as dynamo traces it (``torch.compile(ddp)``): the graph breaks here, the
    forward runs as it runs eagerly, and dynamo compiles the frames the wrapped module runs
    (with ``ddp`` active: cut at its buckets), as under torch's DDP."""
    _skip_forward_frame()
    return _untraced_forward(ddp, inputs, kwargs)


def _untraced_forward(ddp, inputs, kwargs):
    """DDP's forward; dynamo neither inlines it nor compiles its own frame, only the frames it
    calls (torch's DDP gets the same by living in torch's files, which dynamo skips). Its
    bookkeeping runs in calls with nothing compiled inside."""
    inputs, kwargs = _before(ddp, inputs, kwargs)
    with inside_forward(ddp):
        output = ddp.module(*inputs, **kwargs)
    return _after(ddp, output)


def _before_untraced(ddp, inputs, kwargs):
    if _splits_graphs() and ddp.bucket_bytes_cap < _first_bucket_bytes():
        raise first_bucket_refused(ddp)
    return ddp._pre_forward(*inputs, **kwargs)


def _after_untraced(ddp, output):
    return ddp._post_forward(output)


def _skip_forward_frame_untraced() -> None:
    """Tell dynamo (loaded, since it is tracing) to skip :func:`_untraced_forward`'s frame but
    not the frames it calls: dynamo's ``skip``, what ``disable(recursive=False)`` was in older
    torch (2.13's wraps the function and compiles its frame). It also marks the function, so
    that dynamo does not inline it."""
    import torch._dynamo

    skip = getattr(torch._dynamo.decorators, "skip", None) or torch._dynamo.skip
    skip(_untraced_forward)


# Calls dynamo leaves out of the graph and runs as they are, with nothing inside them compiled.
# torch._disable_dynamo (torch 2.1 on) imports dynamo at the first call, which only the traced
# path makes.
_disable = getattr(torch, "_disable_dynamo", lambda fn: fn)  # absent before 2.1
_skip_forward_frame = _disable(_skip_forward_frame_untraced)
_before = _disable(_before_untraced)
_after = _disable(_after_untraced)


def _splits_graphs() -> bool:
    """Whether dynamo's DDPOptimizer is on (``torch._dynamo.config.optimize_ddp``)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False
    mode = dynamo.config.optimize_ddp
    return mode in (True, "ddp_optimizer")


def _first_bucket_bytes() -> int:
    return getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1024 * 1024)


def first_bucket_refused(ddp) -> AssertionError:
    """torch's compiled DDP refuses a bucket cap below its first bucket; so does miniddp's,
    saying why (an AssertionError, as torch raises)."""
    cap, first = ddp.bucket_bytes_cap, _first_bucket_bytes()
    return AssertionError(
        f"{FIRST_BUCKET_PHRASE}: torch's compiler splits a compiled DDP model into pieces at "
        f"DDP's bucket boundaries (dynamo's DDPOptimizer), with a first piece of "
        f"{first / 2**20:.3g} MiB (dist._DEFAULT_FIRST_BUCKET_BYTES) and the others of "
        f"bucket_cap_mb ({cap / 2**20:.3g} MiB here), and refuses a cap smaller than the first "
        "piece; torch's DDP refuses the same. Use bucket_cap_mb >= "
        f"{first / 2**20:.3g}, or set torch._dynamo.config.optimize_ddp = False (one compiled "
        "graph: no communication overlaps backward).")
