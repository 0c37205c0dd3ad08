"""``gradient_as_bucket_view=True``: each ``.grad`` *is* its slice of a bucket.

By default a gradient lives twice: in ``.grad``, and scaled in its bucket, from which the average
is copied back. With this option, after the first synchronized step ``.grad`` is made a view of
the bucket, so backward accumulates straight into the bucket and the copy back disappears: one
copy of the gradients less in memory, and one pass less over them.

What changes, as in torch's reducer:

* copying in: a gradient that is already its bucket view is divided in place
  (``view.div_(world_size)``, not a multiply by the reciprocal: at 3 ranks and more the bits
  differ, and torch divides here); any other gradient is copied in as usual and ``.grad`` is
  pointed at the view;
* writing back: nothing to copy, the average is already in ``.grad``; a ``.grad`` the user
  replaced with another tensor is an error;
* a bucket rebuild moves existing gradients into the new buckets.
"""

from __future__ import annotations

import torch


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class GradientsAsBucketViews:
    """The reducer's copy-in and write-back when ``.grad`` aliases the bucket."""

    def copy_in(self, param: torch.Tensor, view: torch.Tensor, divisor: int,
                scale: bool) -> None:
        """Put ``param``'s gradient into ``view``, divided by ``divisor`` when ``scale``."""
        grad = param.grad
        if grad is None:
            view.zero_()
        elif same_storage(grad, view):
            if scale:
                view.div_(divisor)
        else:
            if scale:
                torch.mul(grad, 1.0 / divisor, out=view)
            else:
                view.copy_(grad)
            param.grad = view

    def write_back(self, bucket, names: list[str], used: list[bool] | None = None) -> None:
        """End of backward: the averages are in ``.grad`` already (each is its view); a missing
        ``.grad`` becomes its view, and one the user replaced is an error. A parameter no rank
        used (``used``) keeps its ``.grad``."""
        for i, param, view in zip(bucket.param_indices, bucket.params, bucket.views):
            if used is not None and not used[i]:
                continue
            if param.grad is None:
                param.grad = view
            elif not same_storage(param.grad, view):
                raise RuntimeError(
                    f"the .grad of {names[i]!r} is no longer a view of its bucket; with "
                    "gradient_as_bucket_view=True, don't replace .grad (zero it in place, or set "
                    "it to None)")

    @staticmethod
    def move_into(buckets, params: list[torch.Tensor]) -> None:
        """After a rebuild: gradients that exist move into their new buckets."""
        for bucket in buckets:
            for slot, i in enumerate(bucket.param_indices):
                grad = params[i].grad
                if grad is not None and not same_storage(grad, bucket.views[slot]):
                    bucket.views[slot].copy_(grad)
                    params[i].grad = bucket.views[slot]
