"""Communication hooks: replace the bucket's all_reduce with a function of your own.

By default each bucket holds ``grad * (1 / world_size)`` and is summed across ranks with one
all_reduce. ``ddp.register_comm_hook(state, hook)`` hands that step to ``hook(state, bucket)``
instead, as torch's DDP does: compress the bucket before sending it (fp16, bf16, PowerSGD), send
it elsewhere, or skip communication to measure what it costs. What changes, as in torch's reducer:

* gradients are copied into the bucket **unscaled**: averaging is the hook's job (torch's
  ``allreduce_hook`` divides by the group's size, then sums);
* with ``gradient_as_bucket_view``, a ``.grad`` that already is its bucket view is left as it is
  (without a hook it would be divided in place);
* the hook gets a :class:`GradBucket`, torch's interface (``buffer()``, ``set_buffer()``,
  ``index()``, ``is_last()``, ``gradients()``, ``parameters()``), and returns a
  ``torch.futures.Future`` whose value is the reduced flat buffer. At the end of backward the
  reducer waits for it and writes that value back into ``.grad``;
* one hook per model, registered once (before or after the first backward); a second
  registration is refused.

So torch's own hooks (``torch.distributed.algorithms.ddp_comm_hooks``) run here unchanged and
give torch's bits. This module also writes the three common ones out small,
:func:`allreduce`, :func:`fp16_compress` and :func:`bf16_compress`, bit-identical to torch's.

Where they run, with gloo and CPU tensors (torch 2.13): all of torch's hooks, PowerSGD with one
bucket only (with several in flight, its callbacks start nested all_reduces that interleave
differently on each rank, and torch's DDP aborts too; NCCL has no such problem). Torch's DDP
refuses its own ``bf16_compress_hook`` and ``bf16_compress_wrapper`` unless torch
was built with CUDA and NCCL >= 2.10 (a check on the hook's name, not on the backend), and
miniddp refuses them in the same places; :func:`bf16_compress` is not refused, and runs wherever
the backend can all_reduce bf16 (gloo can from about torch 2.2).
"""

import inspect

import torch
import torch.distributed as dist

from miniddp import errors

#: What a hook returns: the annotation torch's DDP checks for (so these hooks run there too).
FutureTensor = torch.futures.Future[torch.Tensor]

#: torch's hooks that its DDP refuses without CUDA and NCCL >= 2.10 (it checks these names).
BF16_HOOK_NAMES = ("bf16_compress_hook", "bf16_compress_wrapper_hook")


class GradBucket:
    """One bucket as a hook sees it: the interface of torch's ``dist.GradBucket``."""

    def __init__(self, index: int, bucket_count: int, buffer: torch.Tensor,
                 params: list[torch.Tensor]):
        self._index, self._bucket_count = index, bucket_count
        self._buffer, self._params = buffer, params

    def index(self) -> int:
        """The bucket's position in launch order (0 first). The buckets are rebuilt once,
        after the first step: state kept per index must not rely on the first step's."""
        return self._index

    def is_last(self) -> bool:
        """True for the last bucket of this backward: stateful hooks count steps with it."""
        return self._index == self._bucket_count - 1

    def buffer(self) -> torch.Tensor:
        """The flat buffer of gradients, unscaled. Changing it in place changes the bucket."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace what ``buffer()`` and ``gradients()`` return (e.g. by an fp16 copy)."""
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        """One view of ``buffer()`` per parameter, in the parameter's shape (row-major)."""
        views, offset = [], 0
        for p in self._params:
            views.append(self._buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return views

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in the order their gradients sit in the buffer."""
        return list(self._params)


class HookFuture:
    """The future a hook returned, as the reducer waits for it: a failure inside it (the hook
    called ``set_exception``, or a callback chained in it raised) comes out of backward as a
    RuntimeError that names the hook and the bucket, as torch's DDP raises a RuntimeError
    there. A collective's own failure is a RuntimeError already, and comes out unchanged."""

    def __init__(self, future: FutureTensor, hook_name: str, bucket_index: int):
        self.future, self.hook_name, self.bucket_index = future, hook_name, bucket_index

    def wait(self):
        try:
            return self.future.wait()
        except RuntimeError:
            raise
        except Exception as error:
            raise RuntimeError(
                f"the future of communication hook {self.hook_name} for bucket "
                f"{self.bucket_index} failed: {type(error).__name__}: {error}") from error

    def get_future(self):
        return self.future


class CommHook:
    """What the reducer holds as ``reducer.comm_hook`` in place of its default all_reduce
    (``miniddp.buckets.AllReduceSum``): starts a bucket's reduction through the user's hook,
    and puts the hook's result back into the bucket at the end of backward."""

    averages = True  # the bucket holds the gradients unscaled: averaging is the hook's job

    def __init__(self, state, hook):
        self.state, self.hook = state, hook
        self.name = getattr(hook, "__qualname__", repr(hook))

    def launch(self, bucket, bucket_count: int) -> HookFuture:
        future = self.hook(self.state, GradBucket(bucket.index, bucket_count, bucket.buffer,
                                                  list(bucket.params)))
        if not isinstance(future, torch._C.Future):  # what Work.get_future() gives, too
            got = type(future).__qualname__
            raise RuntimeError(
                f"the communication hook {self.name} returned {got}, not a "
                "torch.futures.Future. Return a future that holds the reduced buffer, e.g. "
                "dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0]), "
                "or a completed torch.futures.Future() when nothing is sent. (In torch's words: "
                f"DDP communication hook's callback must return a torch.futures.Future object, "
                f"but got {got}.)")
        return HookFuture(future, self.name, bucket.index)

    def finish(self, bucket) -> None:
        """Copy the (waited-for) future's tensor into the bucket unless it already is it.

        Going through the bucket keeps ``.grad`` in the parameter's dtype when the result is
        fp16 (torch makes a missing ``.grad`` from the fp16 result itself: an fp16 ``.grad`` on
        an fp32 parameter, which miniddp does not copy).
        """
        value = bucket.work.future.value()
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]  # as Work.get_future() gives; torch 2.13's DDP fails on it
        if not isinstance(value, torch.Tensor) or value.numel() != bucket.numel:
            got = (f"a tensor of {value.numel()} elements" if isinstance(value, torch.Tensor)
                   else type(value).__qualname__)
            raise RuntimeError(
                f"the future of communication hook {self.name} for bucket {bucket.index} holds "
                f"{got}; it must hold the bucket's reduced flat buffer ({bucket.numel} "
                "elements), e.g. bucket.buffer() after an in-place all_reduce.")
        if value.data_ptr() != bucket.buffer.data_ptr():
            bucket.buffer.copy_(value.reshape(-1))  # e.g. an fp16 result: back to the dtype


def register(ddp, state, hook) -> None:
    """``ddp.register_comm_hook``: check ``hook`` as torch does, then attach it to the reducer.
    A refusal is also recorded where ``_get_ddp_logging_data()`` reports errors, as torch's is."""
    reducer = ddp.reducer
    try:
        check_hook(hook)
        if isinstance(reducer.comm_hook, CommHook):
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once. This "
                f"DDP model already has the hook {reducer.comm_hook.name}; to combine two, "
                "register one hook that calls both (as torch's fp16_compress_wrapper does).")
    except (TypeError, ValueError, RuntimeError) as error:
        errors.logged(ddp, error)
        raise
    reducer.attach(comm_hook=CommHook(state, hook))


def check_hook(hook) -> None:
    """Refuse what torch's DDP refuses: a hook that is not callable, annotations other than
    ``bucket: dist.GradBucket`` and ``-> torch.futures.Future[torch.Tensor]``, and torch's bf16
    hooks where torch is built without CUDA and NCCL >= 2.10."""
    if not callable(hook):
        raise TypeError("Communication hook must be callable.")
    signature = inspect.signature(hook)
    bucket = signature.parameters.get("bucket")
    if bucket is None:  # torch fails here with KeyError: 'bucket'
        raise TypeError(
            f"communication hook {hook!r} must take two arguments named (state, bucket), as "
            "torch's DDP requires the name 'bucket'; got the signature " + str(signature))
    if bucket.annotation not in (inspect.Parameter.empty, dist.GradBucket, GradBucket):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    if signature.return_annotation not in (inspect.Signature.empty, FutureTensor):
        raise ValueError("Communication hook: return annotation should be "
                         "torch.futures.Future[torch.Tensor].")
    if getattr(hook, "__name__", None) in BF16_HOOK_NAMES and not torch_allows_bf16_hooks():
        raise TypeError(
            "BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+ or XPU and "
            "XCCL (torch's DDP refuses this hook on this torch build too). "
            "miniddp.options.comm_hooks.bf16_compress does the same without this check.")


def torch_allows_bf16_hooks() -> bool:
    """torch's own condition for its bf16 hooks: a CUDA (or ROCm) build with NCCL >= 2.10, or
    XPU with XCCL."""
    cuda_build = torch.version.cuda is not None or torch.version.hip is not None
    if cuda_build and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10):
        return True
    xccl = getattr(dist, "is_xccl_available", lambda: False)()
    return bool(xccl and hasattr(torch, "xpu") and torch.xpu.is_available())


# ----- miniddp's own hooks: each bit-identical to torch's hook of the same idea -----

def allreduce(process_group, bucket) -> FutureTensor:
    """Average the bucket: divide by the group's size, then sum across ranks.

    Divide *before* the sum (as torch's ``allreduce_hook``), so that an fp16 buffer does not
    overflow. Dividing is not multiplying by ``1 / world_size`` (the reducer's way without a
    hook): at 3 ranks the bits differ, so this hook does not reproduce hook-less DDP exactly.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    sent = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return sent.then(lambda done: done.value()[0])


def _compressed_average(dtype: torch.dtype, process_group, bucket) -> FutureTensor:
    """Send the bucket as ``dtype``: half the bytes of fp32, at the cost of ``dtype``'s rounding.

    The order is what makes torch's bits: cast, then divide in ``dtype``, sum in ``dtype``, and
    cast the sum back into the bucket's own buffer.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(dist.get_world_size(group))
    sent = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(done):
        return buffer.copy_(done.value()[0])

    return sent.then(decompress)


def fp16_compress(process_group, bucket) -> FutureTensor:
    """Average in fp16 (torch's ``fp16_compress_hook``): half the bytes on the wire."""
    return _compressed_average(torch.float16, process_group, bucket)


def bf16_compress(process_group, bucket) -> FutureTensor:
    """Average in bf16 (torch's ``bf16_compress_hook``): half the bytes, fp32's range."""
    return _compressed_average(torch.bfloat16, process_group, bucket)
