"""A peer course's kind of FSDP tests, run through torch's call shape against torch's FSDP2 and
miniddp's ``fully_shard``: whatever torch's passes, miniddp's must pass too.

Each probe trains a tiny transformer (built in code) sharded per block and at the root, with data
differing per rank, and checks it the way a student of FSDP2 would: against a one-process
reference within tolerances, through ``full_tensor()``, ``state_dict()``,
``get_model_state_dict``, ``p.grad.full_tensor()``, parameter counts, ``to_local()`` sizes,
``clip_grad_norm_``, gradient accumulation and the optimizer's state_dict. A probe records its
failure message rather than raising, so the test can name every probe where the two differ.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import miniddp

try:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
except ImportError:
    torch_fully_shard = TorchFSDPModule = None

needs_torch_fsdp2 = pytest.mark.skipif(torch_fully_shard is None,
                                       reason="this torch has no FSDP2 (fully_shard) to compare")

VOCAB, DIM, SEQ = 32, 16, 8


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(x)


class TinyLM(nn.Module):
    def __init__(self, tied=True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def batch(step, rank, world):
    g = torch.Generator().manual_seed(1000 + step)
    every = torch.randint(0, VOCAB, (2 * world, SEQ + 1), generator=g)
    return every, every[2 * rank:2 * rank + 2]


def shard(impl, model):
    fully_shard = torch_fully_shard if impl == "torch" else miniddp.fully_shard
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _probes(impl):
    """Every probe's verdict on this rank: None when it passed, else the failure's message."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = TinyLM()
    model = shard(impl, copy.deepcopy(reference))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    verdicts = {}

    def probe(name, check):
        try:
            check()
            verdicts[name] = None
        except Exception as e:  # noqa: BLE001 -- the verdict is the message
            verdicts[name] = f"{type(e).__name__}: {e}"

    fsdp_module = TorchFSDPModule if impl == "torch" else miniddp.FSDPModule
    probe("isinstance FSDPModule", lambda: _true(isinstance(model, fsdp_module)
                                                 and isinstance(model.layers[0], fsdp_module)))
    probe("parameter count", lambda: _equal(len(list(model.parameters())),
                                            len(list(reference.parameters()))))

    def local_sizes():
        total = sum(p.numel() for p in reference.parameters())
        local = sum(p.to_local().numel() for p in model.parameters())
        _true(local <= total // world + 64 * world, f"{local} local of {total}")
    probe("to_local about 1/W", local_sizes)
    probe("full_tensor equals reference", lambda: [
        torch.testing.assert_close(full(p), q)
        for p, q in zip(model.parameters(), reference.parameters())])

    losses = []
    for step in range(3):
        every, mine = batch(step, rank, world)
        ref_opt.zero_grad()
        loss_of(reference, every).backward()
        opt.zero_grad()
        loss = loss_of(model, mine)
        loss.backward()
        if step == 0:
            probe("grad full_tensor", lambda: [
                torch.testing.assert_close(full(p.grad), q.grad, atol=1e-5, rtol=1e-4)
                for p, q in zip(model.parameters(), reference.parameters())])
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        probe(f"clip_grad_norm_ {step}", lambda n=ref_norm: torch.testing.assert_close(
            full(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)), n,
            atol=1e-5, rtol=1e-4))
        ref_opt.step()
        opt.step()
        losses.append(loss.detach())
    probe("trained parameters close", lambda: [
        torch.testing.assert_close(full(p), q, atol=1e-4, rtol=1e-3)
        for p, q in zip(model.parameters(), reference.parameters())])

    def state_dict_full():
        sd = model.state_dict()
        ref = reference.state_dict()
        _equal(sorted(sd), sorted(ref))
        for k in ref:
            torch.testing.assert_close(full(sd[k]), ref[k], atol=1e-4, rtol=1e-3)
    probe("state_dict full_tensor", state_dict_full)

    def dcp_full():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        ref = reference.state_dict()
        for k in ref:
            torch.testing.assert_close(sd[k], ref[k], atol=1e-4, rtol=1e-3)
    probe("get_model_state_dict full", dcp_full)
    def miniddp_full():
        sd = miniddp.fsdp.full_state_dict(model) if impl == "miniddp" else {
            k: full(v) for k, v in model.state_dict().items()}
        ref = reference.state_dict()
        for k in ref:
            torch.testing.assert_close(sd[k], ref[k], atol=1e-4, rtol=1e-3)
    probe("full_state_dict", miniddp_full)
    probe("optimizer state_dict", lambda: _equal(
        len(opt.state_dict()["state"]), len(ref_opt.state_dict()["state"])))

    def reshard_unshard():
        model.unshard()
        model.reshard()
        loss_of(model, batch(9, rank, world)[1])
    probe("unshard reshard", reshard_unshard)

    def accumulation():
        every, mine = batch(7, rank, world)
        ref = copy.deepcopy(reference)
        loss_of(ref, every).backward()
        opt.zero_grad()
        half = mine.shape[0] // 2
        model.set_requires_gradient_sync(False)
        (loss_of(model, mine[:half]) / 2).backward()
        model.set_requires_gradient_sync(True)
        (loss_of(model, mine[half:]) / 2).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(full(p.grad), q.grad, atol=1e-4, rtol=1e-3)
    probe("gradient accumulation", accumulation)
    return verdicts


def _true(ok, why="expected True"):
    if not ok:
        raise AssertionError(why)


def _equal(a, b):
    if a != b:
        raise AssertionError(f"{a!r} != {b!r}")


def _both():
    return {impl: _probes(impl) for impl in ("torch", "miniddp")}


def _gaps(results, names):
    return [f"rank {rank}, {name}: {verdicts['miniddp'][name]}"
            for rank, verdicts in enumerate(results) for name in names(verdicts)
            if verdicts["torch"][name] is None and verdicts["miniddp"][name] is not None]


@pytest.fixture(scope="module")
def probed(ranks):
    """``probed(world_size)``: every rank's verdicts of both; one run of the probes per world
    size serves every test here that reads them."""
    results: dict[int, list] = {}

    def get(world_size: int) -> list:
        if world_size not in results:
            results[world_size] = ranks(world_size).run(_both, timeout=240)
        return results[world_size]
    return get


@needs_torch_fsdp2
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_miniddp_passes_every_peer_probe_that_torch_fsdp2_passes(probed, world_size):
    results = probed(world_size)
    for verdicts in results:
        assert all(v is None for v in verdicts["torch"].values()), verdicts["torch"]
    gaps = _gaps(results, lambda v: set(v["miniddp"]))
    assert not gaps, "\n".join(gaps)
