"""Models and a training loop that runs miniddp's DDP and torch's DDP side by side on every rank.

Used by the equivalence tests: each rank builds the same *architecture* from a rank-dependent
seed (so the broadcast from rank 0 at construction is exercised), copies it, wraps one copy in
each DDP, trains both on the same rank-dependent data, and records every tensor that is not
bit-identical (``bit_difference``: same dtype, shape and bits, so identical NaNs are equal)
after every backward and every optimizer step.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import miniddp
from miniddp.buckets import MIB
from miniddp.checks.bits import bit_difference
from miniddp.torch_versions import EXPLICIT_CAP_COVERS_FIRST_BUCKET


class MLP(nn.Sequential):
    def __init__(self, width=32, depth=3, d_in=16, d_out=4):
        layers, d = [], d_in
        for _ in range(depth - 1):
            layers += [nn.Linear(d, width), nn.ReLU()]
            d = width
        super().__init__(*layers, nn.Linear(d, d_out))


class ConvBN(nn.Module):
    """Convolutions with BatchNorm: buffers (running stats) must follow rank 0."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))

    def forward(self, x):
        return self.body(x)


class ConvSyncBN(ConvBN):
    """ConvBN with SyncBatchNorm: batch statistics gathered from every rank (GPU modules only;
    on the CPU both DDPs refuse it)."""

    def __init__(self):
        super().__init__()
        self.body = nn.SyncBatchNorm.convert_sync_batchnorm(self.body)


class TiedFrozen(nn.Module):
    """An embedding tied to the output layer, and a frozen projection in between."""

    def __init__(self, vocab=20, dim=12):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.weight.requires_grad_(False)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.mix(self.frozen(self.embed(tokens)))))


class Branchy(nn.Module):
    """``never`` is never used; ``sometimes`` is used on some ranks and steps only."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.sometimes = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x, use_branch: bool):
        h = torch.relu(self.trunk(x))
        if use_branch:
            h = h + torch.relu(self.sometimes(h))
        return self.head(h)


class TwoHeads(nn.Module):
    """Returns two outputs; the loss ignores the second one on some ranks and steps."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.head_a = nn.Linear(16, 4)
        self.head_b = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return {"a": self.head_a(h), "b": self.head_b(h)}


@dataclass
class Heads:
    a: torch.Tensor
    b: torch.Tensor


class DataclassOut(TwoHeads):
    """TwoHeads returning a dataclass, which torch's pytree cannot take apart."""

    def forward(self, x):
        out = super().forward(x)
        return Heads(out["a"], out["b"])


class Big(nn.Sequential):
    """About 4 MiB of fp32 parameters: the default 1 MiB first bucket and the rebuild matter."""

    def __init__(self):
        super().__init__(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 4))


class Strided(nn.Module):
    """Parameters whose gradients are not contiguous (a transposed weight, a channels_last
    convolution): their bucket views follow the parameters' strides."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 48, 3).to(memory_format=torch.channels_last)
        # (48, 64), strides (1, 48): large enough that at 3 ranks and more the all_reduce sums
        # some elements in another order if they are laid out otherwise (a contiguous .grad
        # must still enter the bucket in the parameter's layout)
        self.mix = nn.Parameter(torch.randn(64, 48).t() / 8)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.conv(x).mean(dim=(2, 3)) @ self.mix)


class SharedGrads(nn.Module):
    """Two weights used through views of one sum: autograd hands each a view of the same
    gradient tensor, so their .grad share memory (a reducer that scaled a .grad in place would
    scale the other too)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(16, 4)), nn.Parameter(torch.randn(16, 4))
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(x @ (self.a.view(-1) + self.b.view(-1)).view(16, 4))


MODELS = {"mlp": MLP, "conv_bn": ConvBN, "conv_sync_bn": ConvSyncBN, "tied_frozen": TiedFrozen,
          "branchy": Branchy, "two_heads": TwoHeads, "dataclass_out": DataclassOut, "big": Big,
          "strided": Strided, "shared_grads": SharedGrads}


def batch(model_name: str, step: int, micro: int, rank: int):
    """Rank- and step-dependent inputs and targets; kwargs for forward."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    if model_name == "tied_frozen":
        x = torch.randint(0, 20, (6, 5), generator=g)
        return (x,), {}, torch.randint(0, 20, (6, 5), generator=g)
    if model_name in ("conv_bn", "conv_sync_bn", "strided"):
        return (torch.randn(6, 3, 4, 4, generator=g),), {}, torch.randn(6, 4, generator=g)
    x, y = torch.randn(6, 16, generator=g), torch.randn(6, 4, generator=g)
    if model_name == "branchy":
        # also per micro-batch: a parameter used only in a no_sync micro-batch counts as used
        return (x,), {"use_branch": (rank + step + micro) % 3 == 0}, y
    if model_name == "two_heads":
        return (x,), {}, (y, (rank + step) % 2 == 0)
    if model_name == "dataclass_out":
        return (x,), {}, y
    return (x,), {}, y


def to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def loss_of(model_name: str, out, y):
    if model_name == "dataclass_out":
        return F.mse_loss(out.a, y) + F.mse_loss(out.b, y)
    if model_name == "two_heads":
        y, use_b = y
        return F.mse_loss(out["a"], y) + (F.mse_loss(out["b"], y) if use_b else 0)
    if model_name == "tied_frozen":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss(out, y)


def make_optimizer(name: str, params):
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _diff(tag, step, name, a, b, problems):
    if (a is None) != (b is None):
        problems.append(f"step {step} {tag} {name}: one is None ({a is None}, {b is None})")
    elif a is not None and (difference := bit_difference(a, b)) is not None:
        problems.append(f"step {step} {tag} {name}: {difference}")


def compare_with_torch(model_name="mlp", steps=4, optimizer="sgd", micro_batches=1,
                       set_to_none=True, width=32, depth=3, sabotage=None, device="cpu",
                       penalty=False, user_hook=False, nan=False, copy_at_end=None,
                       contiguous_grads=False, clip=None, torch_bucket_cap_mb=None,
                       **ddp_kwargs) -> dict:
    """Train both DDPs side by side on this rank; return mismatches and bucket layouts.

    Each micro-batch runs on our DDP, then on torch's, and the bucket layouts are compared
    after every one (so a rebuild at the wrong forward is caught). ``penalty`` adds a gradient
    penalty (``torch.autograd.grad`` with ``create_graph`` through the outputs, as WGAN-GP does);
    ``user_hook`` registers, after wrapping, a post-accumulate-grad hook halving every gradient.
    ``sabotage`` breaks miniddp on purpose (negative controls, proving the check can fail):
    ``"divide"`` scales gradients by ``/ world_size`` instead of ``* (1 / world_size)``;
    ``"layout"`` gives miniddp a different bucket cap from torch's; ``"nan_in_ours"`` puts a
    NaN into miniddp's first weight after wrapping. ``nan=True`` puts a NaN into that weight of
    the model both wrap (it spreads through every step on both sides: equal bits, no problem).
    ``copy_at_end`` (bytes) overrides which buckets have their gradients copied in with the
    last one (``Reducer.copy_buckets_at_end``; -1: none, ``math.inf``: all, as on a GPU).
    ``contiguous_grads``: every ``.grad`` is set to contiguous
    zeros before the first step, whatever its parameter's layout (with ``set_to_none=False``,
    backward then accumulates into them). ``clip``: ``clip_grad_norm_`` to that norm before each
    step (it scales .grads in place: .grads that share memory are scaled twice, in torch too).
    Which .grads share memory must match torch's too. ``torch_bucket_cap_mb`` gives torch's DDP
    a cap of its own (where it refuses miniddp's).
    """
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)  # different on each rank: construction must broadcast
    module = MLP(width, depth) if model_name == "mlp" else MODELS[model_name]()
    module.to(device)
    if nan:
        _put_nan(module)
    our_kwargs = dict(ddp_kwargs)
    if sabotage == "layout":
        our_kwargs["bucket_cap_mb"] = 0.0002
    if torch_bucket_cap_mb is not None:
        ddp_kwargs["bucket_cap_mb"] = torch_bucket_cap_mb
    if ddp_kwargs.get("bucket_cap_mb", 0) is None:
        del ddp_kwargs["bucket_cap_mb"]  # torch < 2.4 takes no None: its default is 25
    with first_bucket_as_small_as(ddp_kwargs.get("bucket_cap_mb")):
        ours = miniddp.DistributedDataParallel(copy.deepcopy(module), **our_kwargs)
        theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(module), **ddp_kwargs)
    if copy_at_end is not None:
        ours.reducer.copy_buckets_at_end(copy_at_end)
    if sabotage == "divide":
        def divide_instead(source, out):  # gradient by gradient, or a whole bucket at once
            torch.div(source, dist.get_world_size(), out=out)
        ours.reducer._scale = divide_instead
    if sabotage == "nan_in_ours":
        _put_nan(ours.module)
    both = [(ours, make_optimizer(optimizer, ours.parameters())),
            (theirs, make_optimizer(optimizer, theirs.parameters()))]
    if contiguous_grads:
        for ddp, _ in both:
            for p in ddp.parameters():
                p.grad = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
    if user_hook:
        for ddp, _ in both:
            for p in ddp.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(halve_grad)
    problems, layouts = [], []
    state = lambda m: list(m.module.named_parameters()) + list(m.module.named_buffers())
    for name, a in state(ours):
        _diff("initial", -1, name, a, dict(state(theirs))[name], problems)
    for step in range(steps):
        for _, opt in both:
            opt.zero_grad(set_to_none=set_to_none)
        for micro in range(micro_batches):
            args, kwargs, y = to_device(batch(model_name, step, micro, rank), device)
            for ddp, _ in both:
                sync = micro == micro_batches - 1
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    if penalty:
                        x = args[0].clone().requires_grad_(True)
                        out = ddp(x, *args[1:], **kwargs)
                        slope, = torch.autograd.grad(out.sum(), x, create_graph=True)
                        loss = loss_of(model_name, out, y) + 0.1 * slope.pow(2).sum()
                    else:
                        loss = loss_of(model_name, ddp(*args, **kwargs), y)
                    loss.backward()
            ours_now = [info.param_indices for info in ours.buckets]
            if ours_now != torch_bucket_layout(theirs):
                problems.append(f"step {step} micro {micro}: bucket layout differs from torch's")
        for (name, a), b in zip(ours.module.named_parameters(), theirs.module.parameters()):
            _diff("grad", step, name, a.grad, b.grad, problems)
        if grads_sharing_memory(ours) != grads_sharing_memory(theirs):
            problems.append(f"step {step}: .grads sharing memory {grads_sharing_memory(ours)}, "
                            f"torch's {grads_sharing_memory(theirs)}")
        for ddp, opt in both:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip)
            opt.step()
        for (name, a), (_, b) in zip(state(ours), state(theirs)):
            _diff("param", step, name, a, b, problems)
        layouts.append([info.param_indices for info in ours.buckets])
    return {"problems": problems[:10], "layouts": layouts,
            "torch_layout": torch_bucket_layout(theirs)}


def grads_sharing_memory(ddp) -> list[tuple[str, str]]:
    """Pairs of parameters whose .grad overlap in memory."""
    def span(g):
        return g.data_ptr(), g.data_ptr() + g.numel() * g.element_size()
    grads = [(n, span(p.grad)) for n, p in ddp.module.named_parameters()
             if p.grad is not None and p.grad.numel()]
    return [(a, b) for k, (a, (a0, a1)) in enumerate(grads) for b, (b0, b1) in grads[k + 1:]
            if a0 < b1 and b0 < a1]


def _put_nan(module: nn.Module) -> None:
    with torch.no_grad():
        next(module.parameters()).view(-1)[0] = float("nan")


@contextlib.contextmanager
def first_bucket_as_small_as(bucket_cap_mb):
    """Make a cap below 1 MiB cover the first bucket too, on any torch.

    torch < 2.4 keeps the first bucket at ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) whatever
    the cap, so the small test models would sit in one bucket and the cases about many buckets
    would test nothing. Lowering that constant while both DDPs are built (each reads it at
    construction) gives them torch 2.4's buckets. Caps of 1 MiB and more are left alone, so
    that a case with such a cap compares the installed torch's own rule.
    """
    if EXPLICIT_CAP_COVERS_FIRST_BUCKET or bucket_cap_mb is None or bucket_cap_mb >= 1:
        yield
        return
    saved = dist._DEFAULT_FIRST_BUCKET_BYTES
    dist._DEFAULT_FIRST_BUCKET_BYTES = int(bucket_cap_mb * MIB)
    try:
        yield
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = saved


def halve_grad(param) -> None:
    param.grad.mul_(0.5)


def torch_bucket_layout(theirs) -> list[list[int]]:
    """torch's current buckets, as indices into the list of trainable parameters."""
    trainable = [p for p in theirs.module.parameters() if p.requires_grad]
    index = {id(p): i for i, p in enumerate(trainable)}
    return [[index[id(p)] for p in gb.parameters()]
            for gb in theirs.reducer._get_zeros_like_grad_buckets()]
