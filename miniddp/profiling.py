"""Spans in torch.profiler's trace, none when no profiler records: ask ``on = recording()``
once a step; ``with span(on and f"miniddp...{n} bytes"):`` then formats no name, makes no span."""
from contextlib import nullcontext

from torch.autograd import _profiler_enabled as recording  # noqa: F401  (used as profiling.*)
from torch.autograd.profiler import record_function

NO_SPAN = nullcontext()  # (engine code that counts its lines asks first: span() is a call)


def span(name):
    return record_function(name) if name else NO_SPAN


def bucket_span(step: str, bucket, work, args: tuple):
    """``work(*args)`` inside a span named for the reducer's step, the bucket, its tensors and
    bytes (``Reducer._spanned`` calls it only while a profiler records)."""
    with span(f"miniddp.ddp.{step} bucket {bucket.index} ({len(bucket.params)} tensors, "
              f"{bucket.buffer.nbytes} bytes)"):
        return work(*args)
