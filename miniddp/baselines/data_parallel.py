"""DataParallel: the naive single-process baseline that DistributedDataParallel replaced.

One Python process drives every device. Each forward:

1. **scatter**: split every tensor argument along ``dim``, one chunk per replica;
2. **replicate**: copy the parameters and buffers onto every device, again, as differentiable
   copies: backward then sums every replica's gradient into the original parameters' ``.grad``,
   so an optimizer over ``dp.parameters()`` trains the one real module;
3. **parallel apply**: run each replica on its chunk in its own thread;
4. **gather**: concatenate the outputs on the output device.

Why DDP is faster, read off these steps: the weights are copied every step (DDP copies them once
and then exchanges only gradients); outputs, loss and gradients all meet on the first device,
which works more than the rest; and one process runs every replica's Python code under one GIL
(DDP runs one process per device). :attr:`DataParallel.last_forward` counts the copies.

Without a GPU, ``"cpu"`` devices run the same mechanism as threads on the CPU::

    dp = DataParallel(model, device_ids=["cpu", "cpu", "cpu"])
    loss_fn(dp(x), y).backward()  # x is split 3 ways; model's .grad is the full-batch gradient

With one device there is nothing to split or gather: it calls the module itself (after moving
the arguments to a GPU), as torch's DataParallel does, whatever the module returns.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import nn

from miniddp.core import move_to

__all__ = ["DataParallel", "ForwardStats"]


@dataclass
class ForwardStats:
    """What the last forward cost: the replicas that ran (replica 0 is the module itself and
    costs no copy) and the bytes copied to build the others, which DDP pays once, not per step."""

    replicas: int = 0
    param_bytes_copied: int = 0
    buffer_bytes_copied: int = 0


class DataParallel(nn.Module):
    """Run ``module`` on slices of the batch on several devices in one process, every forward.

    ``device_ids`` lists the devices: GPU indices or ``torch.device``/strings such as
    ``"cuda:1"``; ``"cpu"`` entries run a replica in its own thread on the CPU. The default is
    every visible GPU, or one ``"cpu"`` replica on a machine without one. ``output_device``
    (default: the first device) receives the gathered outputs; ``dim`` is the batch dimension.

    Replica 0 *is* ``module``: it uses the parameters and buffers in place, so its in-place
    buffer updates (BatchNorm's running statistics) persist. The other replicas work on copies
    that are thrown away after the forward, so their buffer updates are lost: running statistics
    end up reflecting the first chunk of each batch only, as with torch's DataParallel. (In torch,
    replica 0 is a shallow copy sharing the tensors, so attributes that ``forward`` assigns are
    lost too; here they stick on ``module``.) Non-tensor attributes are shared by all replicas.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0):
        super().__init__()
        if device_ids is None:
            n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            device_ids = list(range(n_gpus)) if n_gpus else ["cpu"]
        if len(device_ids) == 0:
            raise ValueError(
                "DataParallel got an empty device_ids list: pass the GPUs to use (e.g. [0, 1]), "
                "'cpu' entries to run CPU threads (e.g. ['cpu', 'cpu']), or None for all GPUs")
        self.module = module
        self.device_ids = [_as_device(d) for d in device_ids]
        self.output_device = _as_device(device_ids[0] if output_device is None else output_device)
        self.dim = dim
        self.last_forward = ForwardStats()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Scatter the arguments, replicate the module, run the replicas, gather the outputs."""
        first = self.device_ids[0]
        for t in chain(self.module.parameters(), self.module.buffers()):
            if t.device != first:
                raise RuntimeError(
                    f"DataParallel needs the module's parameters and buffers on the first device "
                    f"({first}), which replica 0 uses in place and the others copy from, but one "
                    f"is on {t.device}: move it with module.to({str(first)!r})")
        if len(self.device_ids) == 1:  # nothing to split or gather: the module itself, as torch
            self.last_forward = ForwardStats(replicas=1)
            if first.type != "cpu":
                args, kwargs = move_to((args, kwargs), first)
            return self.module(*args, **kwargs)
        inputs = _scatter((args, kwargs), self.device_ids, self.dim)
        devices = self.device_ids[: len(inputs)]
        stats = ForwardStats(replicas=len(devices))
        replicas = [self.module] + [_replicate(self.module, d, stats) for d in devices[1:]]
        self.last_forward = stats
        outputs = _parallel_apply(replicas, inputs, devices)
        return _gather(outputs, self.output_device, self.dim)


def _as_device(d) -> torch.device:
    """Turn a device id (GPU index, string or ``torch.device``) into a ``torch.device``."""
    try:
        device = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"DataParallel does not know the device {d!r}: pass GPU indices such "
                         f"as 0, devices such as 'cuda:1', or 'cpu'") from err
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"DataParallel runs replicas on 'cpu' or CUDA devices, not on {device}")
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.index is None and n_gpus:
        device = torch.device("cuda", torch.cuda.current_device())
    if (device.index or 0) >= n_gpus:
        raise ValueError(f"DataParallel was asked for {d!r}, but this machine has {n_gpus} "
                         f"visible GPU(s); without one, pass device_ids=['cpu', 'cpu']")
    return device


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj`` (nested tuples, lists and dicts)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    return [t for item in items for t in _tensors(item)]


def _scatter(args_kwargs: tuple, devices: list[torch.device], dim: int) -> list[tuple]:
    """Split ``(args, kwargs)`` into one ``(args, kwargs)`` per replica.

    Tensors are cut with :func:`torch.chunk`, like torch's DataParallel: 7 rows over 3 devices
    give chunks of 3, 3 and 1, and 2 rows over 3 devices give 2 chunks, so only 2 replicas run.
    Everything else is handed to every replica as is. Unlike torch (which silently drops what
    does not line up), tensors of different sizes along ``dim`` are an error.
    """
    tensors = _tensors(args_kwargs)
    if not tensors:
        return [args_kwargs]  # nothing to split: one replica on the first device
    sizes = {t.shape[dim] if -t.dim() <= dim < t.dim() else None for t in tensors}
    if len(sizes) != 1 or None in sizes:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ValueError(f"DataParallel splits every tensor argument along dim={dim}, so they "
                         f"need the same size there; got shapes {shapes}")
    n = len(tensors[0].chunk(len(devices), dim))

    def split(obj: Any) -> list:
        if isinstance(obj, torch.Tensor):
            return [c.to(d) for c, d in zip(obj.chunk(len(devices), dim), devices)]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return [type(obj)(*parts) for parts in zip(*map(split, obj))]
        if isinstance(obj, (tuple, list)):
            return [type(obj)(parts) for parts in zip(*map(split, obj))] or [obj] * n
        if isinstance(obj, dict):
            values = zip(*map(split, obj.values()))
            return [type(obj)(zip(obj.keys(), parts)) for parts in values] or [obj] * n
        return [obj] * n

    return split(args_kwargs)


def _replicate(module: nn.Module, device: torch.device, stats: ForwardStats) -> nn.Module:
    """A throwaway copy of ``module`` whose tensors are differentiable copies on ``device``.

    Each submodule is shallow-copied by its own ``_replicate_for_data_parallel`` (the hook torch
    gives classes such as RNNs that cache references to their weights), so every thread runs its
    own module objects. Patching one shared module per call, as ``torch.func.functional_call``
    does, would race between threads. Tied weights and shared submodules stay shared.
    """
    copies: dict[int, torch.Tensor] = {}
    replicas: dict[int, nn.Module] = {}

    def copy(t: torch.Tensor, counter: str) -> torch.Tensor:
        if id(t) not in copies:
            copies[id(t)] = t.to(device, copy=True)  # differentiable: grads flow back to t
            nbytes = t.numel() * t.element_size()
            setattr(stats, counter, getattr(stats, counter) + nbytes)
        return copies[id(t)]

    def replicate(m: nn.Module) -> nn.Module:
        if id(m) not in replicas:
            r = replicas[id(m)] = m._replicate_for_data_parallel()
            for name, child in m._modules.items():
                r._modules[name] = None if child is None else replicate(child)
            for name, p in m._parameters.items():
                if p is None:
                    r._parameters[name] = None
                else:  # a plain attribute: a copy is no leaf, so it cannot be a Parameter
                    setattr(r, name, copy(p, "param_bytes_copied"))
            for name, b in m._buffers.items():
                if b is not None:
                    setattr(r, name, copy(b, "buffer_bytes_copied"))
        return replicas[id(m)]

    return replicate(module)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    """Whether autocast is on for ``device_type`` in this thread, and its dtype."""
    try:
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError):  # torch < 2.4: one function per device type
        if device_type == "cuda":
            return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
        return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()


def _parallel_apply(replicas: list[nn.Module], inputs: list[tuple], devices: list) -> list:
    """Run ``replicas[i](*args, **kwargs)`` for ``inputs[i]`` in one thread per replica.

    Grad mode, autocast and the current CUDA stream are per-thread state in torch: a new thread
    starts with grad on, autocast off and default streams whatever the caller set, so each worker
    re-enters the caller's. An exception in a worker is re-raised here, same type, naming the
    replica and its device.
    """
    grad_enabled = torch.is_grad_enabled()
    streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in devices]
    autocast = {t: _autocast_state(t) for t in {"cpu"} | {d.type for d in devices}}
    results: list[Any] = [None] * len(replicas)
    errors: list[BaseException | None] = [None] * len(replicas)

    def work(i: int) -> None:
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.set_grad_enabled(grad_enabled))
                for device_type, (enabled, dtype) in autocast.items():
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
                if devices[i].type == "cuda":
                    stack.enter_context(torch.cuda.device(devices[i]))
                    stack.enter_context(torch.cuda.stream(streams[i]))
                args, kwargs = inputs[i]
                results[i] = replicas[i](*args, **kwargs)
        except BaseException as err:  # noqa: B036 (re-raised in the caller below)
            errors[i] = err

    threads = [threading.Thread(target=work, args=(i,), name=f"DataParallel-replica-{i}")
               for i in range(len(replicas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, err in enumerate(errors):
        if err is not None:
            where = f"in replica {i} of {len(replicas)} (device {devices[i]})"
            try:
                raised = type(err)(f"{type(err).__name__} {where}: {err}")
            except Exception:  # a type that needs other arguments
                raised = RuntimeError(f"{type(err).__name__} {where}: {err}")
            raise raised from err
    return results


def _gather(outputs: list, device: torch.device, dim: int) -> Any:
    """Join the replicas' outputs on ``device``: tensors are concatenated along ``dim``."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if len(outputs) == 1:
            return first.to(device)
        if first.dim() == 0:
            warnings.warn(
                "DataParallel: the replicas returned scalars, so the result holds one per replica; "
                "chunks can differ in size, so their mean need not be the batch mean", stacklevel=2)
            return torch.stack([o.to(device) for o in outputs])
        return torch.cat([o.to(device) for o in outputs], dim)
    if first is None:
        return None
    if isinstance(first, dict):
        return type(first)((k, _gather([o[k] for o in outputs], device, dim)) for k in first)
    if isinstance(first, (tuple, list)):
        parts = [_gather(list(items), device, dim) for items in zip(*outputs)]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    raise TypeError(f"DataParallel gathers tensors and tuples, lists and dicts of them, but the "
                    f"module's output holds an object of type {type(first).__name__}")
