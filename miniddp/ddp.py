"""``miniddp.DistributedDataParallel``: torch's DDP, rebuilt in readable Python.

Same constructor arguments, same meanings and the same bits as
``torch.nn.parallel.DistributedDataParallel``, so swapping the import in a working script
changes nothing else. What happens where:

* construction (here): check every rank has the same parameter shapes, broadcast parameters
  (frozen ones too) and buffers from rank 0, hand the trainable parameters to the reducer;
* forward (here): rebuild buckets once, broadcast buffers from rank 0, run the module, and —
  when this forward will be followed by a synchronized backward — prepare the reducer;
* backward (``miniddp.reducer``): hooks fill buckets and launch asynchronous all_reduces;
* bucket layout and its one rebuild (``miniddp.buckets``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from miniddp.buckets import BucketInfo, bucket_limits
from miniddp.consistency import ConsistencyChecks, checks_from_environment
from miniddp.reducer import Reducer
from miniddp.sync import broadcast_from_rank0, verify_same_shapes


def _move_to(obj, device):
    """Move every tensor in a (nested) input to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        moved = [_move_to(x, device) for x in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
    if isinstance(obj, dict):
        return type(obj)((k, _move_to(v, device)) for k, v in obj.items())
    return obj


class DistributedDataParallel(nn.Module):
    """Data parallelism across processes: every rank trains a replica on its own data, and
    gradients are averaged during backward, so every replica takes the same optimizer step.

    ``device_ids`` / ``output_device``: for a module on one GPU, ``[gpu]`` (as torch); ``None``
    for CPU modules. ``broadcast_buffers``: copy rank 0's buffers before each synced forward.
    ``bucket_cap_mb``: bucket size (default: 1 MiB first bucket, then 25 MiB; an explicit cap
    covers the first bucket too from torch 2.4, as in torch).
    ``find_unused_parameters``: allow parameters that take no part in the loss.
    ``gradient_as_bucket_view``: ``.grad`` aliases the bucket (saves one copy of the gradients).
    ``init_sync=False`` skips the construction-time check and broadcast. The arguments are
    torch's (2.13), in torch's order.

    Subclasses change how gradients are reduced by swapping ``reducer_class`` (the bucket
    layout) or ``overlap`` (launch during backward, or only after it); see ``miniddp.naive``.
    """

    reducer_class = Reducer
    overlap = True

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool = True, init_sync: bool = True, process_group=None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False):
        super().__init__()
        # dim and check_reduction are accepted (in torch's positions) so that scripts written
        # for torch's DDP run unchanged: dim only matters to single-process DataParallel, and
        # torch ignores check_reduction. static_graph changes behaviour, and is not built here.
        if static_graph:
            raise NotImplementedError("miniddp does not implement static_graph=True; leave it "
                                      "False (use find_unused_parameters for unused ones)")
        self.dim = dim
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel needs a process group: call "
                "torch.distributed.init_process_group(...) first (or start the script with "
                "miniddp.launch.launch / torchrun).")
        bucket_limits(bucket_cap_mb)  # reject a bad cap before any collective runs
        self.module = module
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True  # false right after a no_sync / no_grad forward

        all_params = list(module.named_parameters())  # shared parameters appear once
        trainable = [(name, p) for name, p in all_params if p.requires_grad]
        if not trainable:
            raise ValueError(
                "DistributedDataParallel got a module with no parameter that requires grad: "
                "there is nothing to synchronize. Train it without DDP, or unfreeze a "
                "parameter.")
        sparse = [name for name, m in module.named_modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
                  and m.weight.requires_grad]
        if sparse:
            raise ValueError(
                f"miniddp does not reduce sparse gradients, and {', '.join(sparse)} "
                "produce them: build those embeddings with sparse=False.")
        devices = {p.device for _, p in all_params}
        self.device = trainable[0][1].device
        self.device_ids, self.output_device = self._check_devices(device_ids, output_device,
                                                                  devices)

        if init_sync:  # torch's opt-out, for models already identical on every rank
            verify_same_shapes(all_params, process_group)
            broadcast_from_rank0([p.detach() for _, p in all_params], process_group)
            buffers = [b for _, b in module.named_buffers()]
            if broadcast_buffers and buffers:
                broadcast_from_rank0(buffers, process_group)

        self.reducer = self.reducer_class(
            [p for _, p in trainable], [name for name, _ in trainable], process_group,
            bucket_cap_mb, find_unused_parameters, gradient_as_bucket_view, self.overlap)
        self.bucket_bytes_cap = self.reducer.bucket_bytes
        self.reducer.consistency = checks_from_environment(self)  # miniddp.consistency

    @staticmethod
    def _check_devices(device_ids, output_device, devices):
        if len({d.type for d in devices}) > 1:
            raise ValueError(
                "DistributedDataParallel needs a module whose parameters are all on one kind "
                f"of device, got {sorted(map(str, devices))}: move the module with .to(device).")
        on_gpu = all(d.type == "cuda" for d in devices)
        if not device_ids:
            if output_device is not None:
                raise ValueError("output_device only works together with device_ids, for a "
                                 f"module on one GPU; got output_device={output_device}.")
            return None, None
        if not on_gpu or len(devices) > 1 or len(device_ids) != 1:
            raise ValueError(
                "device_ids must be None for CPU or multi-device modules and a single GPU "
                f"for a module on one GPU; got device_ids={device_ids} for a module on "
                f"{sorted(map(str, devices))}.")

        def index(d):  # torch keeps GPU indices: 0, "cuda:0" and torch.device("cuda", 0) alike
            return d if isinstance(d, int) else torch.device(d).index

        return [index(device_ids[0])], index(device_ids[0] if output_device is None
                                             else output_device)

    @property
    def buckets(self) -> list[BucketInfo]:
        """The current buckets, in the order their all_reduces are launched."""
        return self.reducer.bucket_info()

    @property
    def allreduce_calls(self) -> int:
        """All_reduce calls made by the backward of the last forward with grad enabled: one
        per bucket after a synced forward, 0 after a forward inside ``no_sync``."""
        return self.reducer.allreduce_calls

    def check_every(self, steps: int | None, detail: bool = False) -> None:
        """Compare every rank's step, and every ``steps`` steps its parameters; raise on every
        rank when they differ (see ``miniddp.consistency``). ``detail=True`` also compares
        each collective before it is launched. ``None`` switches the checks off. Call it at
        the same point on every rank."""
        self.reducer.consistency = ConsistencyChecks(self, steps, detail) if steps else None

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the forward must run inside the context.

        The flag is read at forward time (as in torch): a forward inside ``no_sync`` followed by
        a backward outside it does not synchronize. The first synced backward afterwards
        averages the whole accumulated gradient once.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def forward(self, *inputs, **kwargs):
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self.reducer.begin_forward()
        checks = self.reducer.consistency  # miniddp.consistency
        if grad_enabled and checks is not None:
            checks.at_forward(self.require_backward_grad_sync)
        if self.require_forward_param_sync and self.broadcast_buffers:
            buffers = [b for _, b in self.module.named_buffers()]  # re-read: may be reassigned
            if buffers:
                if checks is not None:
                    checks.before_collective("the broadcast of buffers", None, buffers)
                broadcast_from_rank0(buffers, self.process_group)
        if self.device_ids:
            device = torch.device("cuda", self.device_ids[0])
            inputs, kwargs = _move_to(inputs, device), _move_to(kwargs, device)
        output = self.module(*inputs, **kwargs)
        sync = grad_enabled and self.require_backward_grad_sync
        self.require_forward_param_sync = sync
        if sync:
            output = self.reducer.prepare_for_backward(output)
        return output
