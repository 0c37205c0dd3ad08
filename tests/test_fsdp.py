"""miniddp.fully_shard beside torch's FSDP2, bit for bit, on gloo at 2 and 3 ranks.

Each case builds one small model twice (miniddp's and torch's ``fully_shard`` on each block,
bottom-up, then on the root), trains both for a few steps on per-rank data, and compares every
rank's local gradient shard after every backward and its parameter shard after every optimizer
step. The model's sizes are chosen so that the cut is uneven at 3 ranks (one rank holds fewer
rows, one rank none of a 2-row layer). Several cases run per call to a rank pool.

Negative controls: each bit-deciding detail, broken on purpose, must make a case differ at 3
ranks (at 2 ranks every wrong variant still agrees, which is why 3 is the test).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import miniddp
from miniddp.fsdp import collectives, param_group

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
except ImportError:
    try:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed._composable.fsdp import fully_shard as torch_fully_shard
    except ImportError:
        torch_fully_shard = TorchPolicy = None

needs_torch_fsdp2 = pytest.mark.skipif(torch_fully_shard is None,
                                       reason="this torch has no FSDP2 (fully_shard) to compare")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, None: None}


@dataclass(frozen=True)
class Case:
    """One training run, described by names so that it travels to the ranks by pickle."""

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    optimizer: str = "sgd"
    reshard_after_forward: bool = True
    frozen: bool = False
    micro_batches: int = 1
    steps: int = 3
    breakage: str | None = None

    def __str__(self):
        return ", ".join(f"{k}={v}" for k, v in self.__dict__.items() if v != getattr(Case, k))


class Block(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    """Blocks of 31, 17 and 2 rows (uneven at 3 ranks; the last leaves rank 2 empty), and a
    root parameter of its own beside them."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(12, 31), Block(31, 17), Block(17, 2)])
        self.head = nn.Linear(2, 5)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def shard_model(model, shard, policy, case):
    for block in model.blocks:
        shard(block, reshard_after_forward=case.reshard_after_forward, mp_policy=policy)
    shard(model, reshard_after_forward=case.reshard_after_forward, mp_policy=policy)
    return model


def make_optimizer(model, name):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def local(tensor):
    if tensor is None:
        return None
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def count_differences(where, ours, theirs, problems):
    for (name, a), (_, b) in zip(ours, theirs):
        a, b = local(a), local(b)
        if (a is None) != (b is None):
            problems.append(f"{where} {name}: one is None")
        elif a is not None and not torch.equal(a.detach(), b.detach()):
            differ = int((a.detach() != b.detach()).sum())
            problems.append(f"{where} {name}: {differ} of {a.numel()} elements differ")


def _train_beside_torch(case: Case) -> list[str]:
    torch.manual_seed(0)
    model = Net()
    if case.frozen:
        model.blocks[1].requires_grad_(False)
    reference = copy.deepcopy(model)
    dtypes = dict(param_dtype=DTYPES[case.param_dtype], reduce_dtype=DTYPES[case.reduce_dtype])
    ours = shard_model(model, miniddp.fully_shard, miniddp.MixedPrecisionPolicy(**dtypes), case)
    theirs = shard_model(reference, torch_fully_shard, TorchPolicy(**dtypes), case)
    opt_ours, opt_theirs = make_optimizer(ours, case.optimizer), make_optimizer(theirs,
                                                                                case.optimizer)
    problems: list[str] = []
    rank = dist.get_rank()
    for step in range(case.steps):
        for micro in range(case.micro_batches):
            last = micro == case.micro_batches - 1
            ours.set_requires_gradient_sync(last)
            theirs.set_requires_gradient_sync(last)
            gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x = torch.randn(8, 12, generator=gen)
            for model_ in (ours, theirs):
                model_(x).float().pow(2).mean().backward()
            count_differences(f"step {step} micro {micro} grad",
                              [(n, p.grad) for n, p in ours.named_parameters()],
                              [(n, p.grad) for n, p in theirs.named_parameters()], problems)
        opt_ours.step()
        opt_theirs.step()
        opt_ours.zero_grad()
        opt_theirs.zero_grad()
        count_differences(f"step {step} param", list(ours.named_parameters()),
                          list(theirs.named_parameters()), problems)
    return problems


# ----- the details that decide the bits, broken one at a time (negative controls) -----

def _scale_before_sum(buffer, group=None):
    """DDP's arithmetic: every rank divides by W, then the sum."""
    if buffer.dtype in (torch.float32, torch.bfloat16):
        buffer.div_(dist.get_world_size(group))
        return collectives.reduce_scatter_sum(buffer, group)
    return _average(buffer, group)


def _avg_in_fp16(world_size):
    """fp16 averaged as fp32 is: the sum, then one division by W."""
    return 1, world_size


def _flat_layout(self, with_grad):
    """FSDP1's layout: whole flattened gradients one after another, all-reduced, each rank
    keeping its rows of each."""
    world_size = with_grad[0][0].spec.world_size
    dtype = with_grad[0][0].reduce_dtype or with_grad[0][1].dtype
    flat = torch.cat([g.reshape(-1).to(dtype) for _, g in with_grad])
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % world_size)])
    whole = collectives.average(flat.view(world_size, -1).clone(), self.group)
    del whole  # only to keep the same collectives; the real sum is below
    summed = flat.clone()
    dist.all_reduce(summed, group=self.group)
    summed.div_(world_size)
    shards, offset = [], 0
    for p, g in with_grad:
        full = summed[offset:offset + g.numel()].view(g.shape).to(p.orig_dtype)
        shards.append(p.spec.cut(full))
        offset += g.numel()
    return shards


def _no_padding(self, with_grad):
    """Each rank's row of the buffer holds its chunks unpadded, back to back, with the padding
    only at the end of the row."""
    world_size = with_grad[0][0].spec.world_size
    dtype = with_grad[0][0].reduce_dtype or with_grad[0][1].dtype
    rows = [torch.cat([g.reshape(g.shape[0], -1)[p.spec.chunk_rows * r:][: p.spec.chunk_rows]
                       .reshape(-1) for p, g in with_grad]) for r in range(world_size)]
    width = max(row.numel() for row in rows)
    buffer = torch.zeros(world_size, width, dtype=dtype)
    for r, row in enumerate(rows):
        buffer[r, : row.numel()] = row
    output = collectives.average(buffer, self.group)
    shards, offset = [], 0
    for p, _ in with_grad:
        n = p.spec.local_shape.numel()
        shards.append(output[offset:offset + n].view(p.spec.local_shape).to(p.orig_dtype))
        offset += n
    return shards


_average = collectives.average
BREAKAGES = {
    "scale_before_sum": (collectives, "average", _scale_before_sum),
    "avg_in_fp16": (collectives, "fp16_divide_factors", _avg_in_fp16),
    "flat_layout": (param_group.ParamGroup, "reduce_scatter", _flat_layout),
    "no_padding": (param_group.ParamGroup, "reduce_scatter", _no_padding),
}


def beside_torch(cases: list[Case]) -> list[list[str]]:
    """On every rank: each case's differences from torch's FSDP2 (empty: bit-identical)."""
    torch.set_num_threads(1)
    results = []
    for case in cases:
        if case.breakage is None:
            results.append(_train_beside_torch(case))
            continue
        owner, name, wrong = BREAKAGES[case.breakage]
        right = getattr(owner, name)
        setattr(owner, name, wrong)
        try:
            results.append(_train_beside_torch(case))
        finally:
            setattr(owner, name, right)
    return results


def check_identical(results, cases):
    failures = [f"rank {rank}, {case}: {problems[:4]}"
                for rank, per_case in enumerate(results)
                for case, problems in zip(cases, per_case) if problems]
    assert not failures, "\n".join(failures)


def check_all_differ(results, cases):
    agreeing = [str(case) for i, case in enumerate(cases)
                if not any(per_case[i] for per_case in results)]
    assert not agreeing, f"broken on purpose, yet bit-identical to torch: {agreeing}"


PRECISIONS = [Case(), Case(param_dtype="fp16"), Case(param_dtype="fp16", reduce_dtype="fp32"),
              Case(param_dtype="bf16")]


@needs_torch_fsdp2
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_precision_bit_identical_to_torch(ranks, world_size):
    cases = [replace(c, optimizer=opt) for c in PRECISIONS for opt in ("sgd", "adam")]
    check_identical(ranks(world_size).run(beside_torch, cases, timeout=120), cases)


@needs_torch_fsdp2
@pytest.mark.parametrize("world_size", [2, 3])
def test_zero2_frozen_layer_and_accumulation_bit_identical_to_torch(ranks, world_size):
    cases = [Case(reshard_after_forward=False), Case(reshard_after_forward=False,
                                                     optimizer="adam", param_dtype="bf16"),
             Case(frozen=True), Case(frozen=True, reshard_after_forward=False),
             Case(micro_batches=3), Case(micro_batches=2, param_dtype="fp16",
                                         reduce_dtype="fp32", optimizer="adam"),
             Case(micro_batches=2, param_dtype="bf16", reshard_after_forward=False)]
    check_identical(ranks(world_size).run(beside_torch, cases, timeout=120), cases)


@needs_torch_fsdp2
def test_each_bit_deciding_detail_broken_differs_from_torch_at_3_ranks(ranks):
    cases = [Case(breakage="scale_before_sum"), Case(breakage="flat_layout"),
             Case(breakage="no_padding"), Case(breakage="avg_in_fp16", param_dtype="fp16")]
    check_all_differ(ranks(3).run(beside_torch, cases, timeout=120), cases)
