"""``batched_grad_copy=True`` (torch 2.13): copy a bucket's gradients in once it is complete.

By default each gradient is copied into its bucket as soon as it is ready, scaled on the way
(``grad * (1 / world_size)``): two small kernels per parameter. With many small parameters
those launches add up, so torch can instead note which gradients are ready and, when the
bucket's last one arrives, copy them all in together and divide the whole flat bucket once.

The bits change: ``x / 3`` and ``x * (1 / 3)`` differ in about a third of the float32 values,
so at 3 ranks and more this option gives other parameters than the default, and miniddp follows
torch here too. What it does, as torch's reducer does:

* a gradient that exists and is not already its bucket view: noted, copied at the flush;
* no gradient: its slot is zeroed at once; a gradient that is already the bucket view (with
  ``gradient_as_bucket_view``): nothing to copy, and no division of its own;
* at the flush: the noted copies, ``.grad`` pointed at the bucket with
  ``gradient_as_bucket_view``, then ``bucket.div_(world_size)``, unless a comm hook does its
  own scaling;
* a gradient that requires grad (``create_graph=True``) takes the usual path, which refuses it.
"""

from __future__ import annotations

from miniddp.options.gradient_views import same_storage


class BatchedGradCopy:
    """The reducer's copy-in when ``batched_grad_copy=True``."""

    def __init__(self, reducer):
        self.reducer = reducer
        self.noted: dict[int, list[int]] = {}  # bucket index -> slots to copy at the flush

    def copy_in(self, index: int, bucket, slot: int) -> None:
        """``index`` is ready: zero, note, or (create_graph) copy its gradient as usual."""
        grad, view = self.reducer.params[index].grad, bucket.views[slot]
        if bucket.pending == len(bucket.param_indices):  # its first gradient this backward
            self.noted[bucket.index] = []
        if grad is None:
            view.zero_()
        elif grad.requires_grad:
            self.reducer._copy_into_bucket(self.reducer.params[index], view)
        elif not same_storage(grad, view):
            self.noted.setdefault(bucket.index, []).append(slot)

    def flush(self, bucket) -> None:
        """The bucket is complete: copy the noted gradients in, then scale the whole bucket."""
        params = self.reducer.params
        for slot in self.noted.pop(bucket.index, []):
            param = params[bucket.param_indices[slot]]
            bucket.views[slot].copy_(param.grad)
            if self.reducer.views is not None:  # gradient_as_bucket_view
                param.grad = bucket.views[slot]
        if self.reducer.comm_hook is None:
            bucket.buffer.div_(self.reducer.divisor)
