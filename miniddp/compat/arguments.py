"""torch's constructor arguments, release by release: which work, which are refused, and why.

A script written for ``torch.nn.parallel.DistributedDataParallel`` must run unchanged with
miniddp's, so miniddp's DDP takes exactly the installed torch's arguments, names, order and
defaults: :func:`takes_torchs_arguments` binds each call against torch's own signature (an
argument the installed torch lacks is a ``TypeError``, as it would be with torch's). Most
arguments work as torch's. A few make no sense in a teaching reimplementation and are refused
by :func:`refuse_unsupported` with a message naming the argument and what to use instead.

The buffer flags changed in torch 2.13: ``broadcast_buffers`` is deprecated (default ``None``)
in favour of ``forward_sync_buffers``, and the two differ in one place, the broadcast at
construction. ``broadcast_buffers=False`` leaves buffers out of it; ``forward_sync_buffers=False``
still broadcasts them there, and only stops the broadcast before each forward
(:func:`buffer_sync_flags`).
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch.distributed as dist
from torch import nn
from torch._utils import _get_device_index

#: The installed torch's DDP constructor, ``self`` first: the one miniddp's DDP follows.
TORCH_DDP_SIGNATURE = inspect.signature(nn.parallel.DistributedDataParallel.__init__)

#: Whether the installed torch has deprecated ``broadcast_buffers`` (2.13 did).
BROADCAST_BUFFERS_DEPRECATED = "forward_sync_buffers" in TORCH_DDP_SIGNATURE.parameters


def takes_torchs_arguments(init, torchs: inspect.Signature = TORCH_DDP_SIGNATURE):
    """Make ``init`` take the installed torch's DDP arguments: its names, order and defaults.

    ``init`` is written with the newest torch's arguments as keywords. A call is bound against
    the installed torch's signature first, so a positional argument lands where torch would
    put it, and a default is torch's default on that release. An argument of a torch newer
    than miniddp is refused by name unless left at its default. ``torchs``: the signature to
    follow (another release's, in the tests).
    """
    ours = inspect.signature(init).parameters

    @functools.wraps(init)
    def bound(self, *args, **kwargs):
        call = torchs.bind(self, *args, **kwargs)
        call.apply_defaults()
        arguments = {name: value for name, value in call.arguments.items() if name != "self"}
        for name in [name for name in arguments if name not in ours]:
            if arguments.pop(name) is not torchs.parameters[name].default:
                raise NotImplementedError(
                    f"miniddp does not know torch's DistributedDataParallel argument {name!r} "
                    "(newer than miniddp): leave it at its default.")
        init(self, **arguments)

    bound.__signature__ = torchs
    return bound


def refuse_unsupported(delay_all_reduce_named_params, param_to_hook_all_reduce,
                       mixed_precision) -> None:
    """Raise for the arguments miniddp does not implement, naming each and the alternative."""
    if delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None:
        raise NotImplementedError(
            "miniddp does not implement delay_all_reduce_named_params / "
            "param_to_hook_all_reduce (torch's extra all_reduce of chosen parameters, started "
            "from another parameter's gradient hook and never waited for). Leave both None: "
            "the buckets already overlap communication with backward. To keep parameters out "
            "of DDP altogether, use "
            "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model.")
    if mixed_precision is not None:
        raise NotImplementedError(
            "miniddp does not implement mixed_precision (torch's experimental DDP-native "
            "_MixedPrecision, which keeps low-precision copies of the parameters). Leave it "
            "None and train under torch.autocast, which miniddp matches bit for bit "
            "(lessons/10_mixed_precision.py).")


def buffer_sync_flags(broadcast_buffers, forward_sync_buffers) -> tuple[bool, bool]:
    """Return ``(forward_sync_buffers, broadcast_buffers_at_construction)`` as torch decides.

    ``forward_sync_buffers`` given: it decides the broadcast before each forward, and buffers
    are always broadcast at construction. Otherwise the (deprecated) ``broadcast_buffers``
    decides both, ``None`` meaning ``True``.
    """
    if BROADCAST_BUFFERS_DEPRECATED and broadcast_buffers is not None:
        both = forward_sync_buffers is not None
        warnings.warn(  # torch's opening words first: warning filters match from the start
            "Both `broadcast_buffers` and `forward_sync_buffers` were specified: the deprecated "
            "broadcast_buffers is ignored." if both else "`broadcast_buffers` is deprecated. Use "
            "`forward_sync_buffers` instead. Unlike broadcast_buffers=False, "
            "forward_sync_buffers=False still broadcasts rank 0's buffers at construction.",
            FutureWarning, stacklevel=4)
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    every_time = True if broadcast_buffers is None else bool(broadcast_buffers)
    return every_time, every_time


def warn_check_reduction(check_reduction) -> None:
    if check_reduction:
        warnings.warn("The `check_reduction` argument in `DistributedDataParallel` module is "
                      "deprecated: it does nothing, in torch's DDP as in miniddp's; leave it out.",
                      FutureWarning, stacklevel=4)


def group_of(process_group, device_mesh):
    """The process group to reduce over: ``process_group``, or a 1-D ``device_mesh``'s."""
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise RuntimeError("Cannot specify both process_group and device_mesh arguments. Pass "
                           "one of them to DistributedDataParallel, not both.")
    if device_mesh.ndim != 1:
        raise RuntimeError(f"Only 1D device mesh is supported, got {device_mesh}: "
                           "pass DistributedDataParallel the data-parallel dimension "
                           "(mesh['dp']).")
    root = getattr(device_mesh, "_get_root_mesh", lambda: device_mesh)()
    if root != device_mesh:
        raise NotImplementedError(
            "miniddp does not combine data parallelism with tensor parallelism: its "
            "device_mesh must be a whole 1-D mesh, not a slice of a larger one.")
    return device_mesh.get_group(mesh_dim=0)


def is_default_group(process_group) -> bool:
    return process_group is None or process_group == dist.group.WORLD


def refuse_unsupported_layers(module: nn.Module, devices: set) -> None:
    """Lazy layers not yet initialized (torch's words first), sparse embeddings (miniddp
    reduces dense gradients only), and SyncBatchNorm on a CPU (refused where torch refuses it,
    in its words)."""
    lazy = [name for name, p in module.named_parameters()
            if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise RuntimeError(
            "Modules with uninitialized parameters can't be used with `DistributedDataParallel`."
            f" Run a dummy forward pass to correctly initialize the modules: {', '.join(lazy)} "
            "belong to lazy layers, whose shapes are known only after a first forward, and DDP "
            "needs them to check the shapes across ranks, broadcast rank 0's values and lay "
            "out the buckets.")
    sparse = [name for name, m in module.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
              and m.weight.requires_grad]
    if sparse:
        raise ValueError(
            "miniddp does not reduce sparse gradients, and these embeddings make them "
            f"(sparse=True): {', '.join(sparse)}. Build them with sparse=False.")
    if any(isinstance(m, nn.SyncBatchNorm) for m in module.modules()) and all(
            d.type == "cpu" for d in devices):
        raise ValueError(
            "SyncBatchNorm layers only work with GPU modules: nn.SyncBatchNorm computes "
            "its batch statistics across ranks only for GPU inputs, and this module is on "
            "the CPU. Move the module to a GPU, or train on the CPU with nn.BatchNorm* "
            "(each rank normalizes with its own batch; DDP gives every rank rank 0's "
            "running statistics).")


def device_ids_of(device_ids, output_device, devices: set):
    """torch's ``device_ids`` / ``output_device`` checked against the module's devices:
    ``(None, None)`` for a CPU module, ``([gpu], gpu)`` for a module on one GPU. As torch does,
    it tests them for truth (``output_device=0`` on a CPU module passes, as it does there) and
    takes ``len(device_ids)`` (an int is a TypeError there too)."""
    if device_ids is not None and len(device_ids) > 1:  # torch's words first
        raise ValueError("device_ids can only be None or contain a single element: one process "
                         f"drives one GPU, got device_ids={device_ids}.")
    if len({d.type for d in devices}) > 1:
        raise ValueError(
            "DistributedDataParallel needs a module whose parameters are all on one kind "
            f"of device, got {sorted(map(str, devices))}: move the module with .to(device).")
    on_gpu = all(d.type == "cuda" for d in devices)
    if not device_ids or not on_gpu or len(devices) > 1:
        if device_ids or output_device:
            raise ValueError(
                "device_ids and output_device only work for a module on one GPU; they must be "
                f"None for CPU or multi-device modules: got device_ids={device_ids}, "
                f"output_device={output_device} for a module on {sorted(map(str, devices))}.")
        return None, None

    # torch keeps GPU indices (0, "cuda:0" and torch.device("cuda", 0) alike) through its own
    # private helper, whose rules (a CPU device refused, a number that is not an int read as
    # no device) this takes as they are
    return ([_get_device_index(d, True) for d in device_ids],
            _get_device_index(device_ids[0] if output_device is None else output_device, True))
