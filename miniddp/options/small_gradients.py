"""Small gradients: two cheaper ways into a bucket, with the same bits.

A gradient enters its bucket as ``grad * (1 / world_size)``, one call into torch per gradient,
and leaves it by a copy back into ``.grad`` after the all_reduce. Where gradients are small,
those calls cost more than the bytes they move (about 2 µs of dispatch each on a CPU; on a GPU
a kernel launched from the thread that also launches the backward's), so the reducer has two
cheaper paths, chosen per bucket when the buckets are built (``Reducer._init_buckets``):

* **Copied in with the bucket's last gradient** (:func:`mark_copy_at_end`, a bucket of several
  gradients): one call copies them all in, one multiplies the whole bucket by the reciprocal.
  Every element is multiplied by the same operand as on the way in, so the bits are the same
  (dividing the bucket, as torch's ``batched_grad_copy`` does, is another operation and gives
  other bits). Slots of parameters without a gradient were zeroed, and stay zero. On a CPU
  this pays only for small gradients (benchmarks/README.md, "Changes made to the engine", 4);
  on a GPU always.
* **Reduced in a tensor of its own** (:func:`mark_lone`, a bucket of one gradient): the product
  ``grad * (1 / world_size)`` is a new tensor, laid out as the bucket (contiguous), which is
  all_reduced and then becomes ``.grad`` itself: no copy back (benchmarks/README.md, "Changes
  made to the engine", 9). Only where the backward made that ``.grad`` (:func:`may_hand_over`);
  the backward's own tensor is never written to, since it may share memory with another
  gradient (a view's can). Once handed over the tensor is the user's: the bucket takes a new
  one before it writes again (``Bucket.renew``). On a CPU for small gradients, where it was
  measured; not on a GPU, where it has not been.
"""

from __future__ import annotations

import torch

#: On a CPU, gradients of at most this many bytes take the cheaper paths.
SMALL_BYTES_CPU = 64 * 1024


def default_bytes(params: list[torch.Tensor]) -> tuple[float, float]:
    """``(copy_at_end, lone)`` limits for these parameters' device: -1 is none, inf every."""
    on_gpu = bool(params) and params[0].device.type != "cpu"
    return (float("inf"), -1) if on_gpu else (SMALL_BYTES_CPU, SMALL_BYTES_CPU)


def _small(view: torch.Tensor, max_bytes: float) -> bool:
    return view.numel() * view.element_size() <= max_bytes


def mark_copy_at_end(buckets, max_bytes: float, views_on: bool) -> None:
    """Buckets of several gradients, each of at most ``max_bytes``: copied in at once."""
    for bucket in buckets:
        bucket.copy_at_end = len(bucket.views) > 1 and not views_on and all(
            _small(view, max_bytes) for view in bucket.views)


def mark_lone(buckets, max_bytes: float, views_on: bool) -> list:
    """Buckets of one contiguous gradient of at most ``max_bytes``: reduced in a tensor of
    their own. Returns them."""
    for bucket in buckets:
        view = bucket.views[0]
        bucket.lone = (len(bucket.views) == 1 and not views_on and view.is_contiguous()
                       and _small(view, max_bytes))
        bucket.hand_over = bucket.hand_over and bucket.lone
    return [bucket for bucket in buckets if bucket.lone]


def may_hand_over(param: torch.Tensor) -> bool:
    """At the end of a forward: the ``.grad`` its backward gives ``param`` is its own to
    replace. There is none yet (a ``.grad`` that exists may be held elsewhere, and is copied
    into, as torch does), and no post-accumulate-grad hook will see and perhaps keep it."""
    return param.grad is None and not getattr(param, "_post_accumulate_grad_hooks", None)
