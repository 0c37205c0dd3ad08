"""Your own model in the benchmarks: which bucket cap is best for *it*, against torch's DDP.

Every benchmark takes ``--model package.module:factory``. The factory returns the model and a
batch maker (and, if mean squared error is not its loss, the loss); the benchmark copies the
model for each contestant, moves everything to each rank's device, and checks that miniddp's
parameters end bit-identical to torch's DDP before it reports a single time:

    PYTHONPATH=. python benchmarks/bucket_sweep.py --model examples.my_model:factory
    PYTHONPATH=. python benchmarks/bucket_sweep.py --model examples.my_model:factory --quick
    bash benchmarks/gpu.sh --model examples.my_model:factory   # everything, on a GPU machine

Rules for a factory (benchmarks/models.py says the same):

* the model is built on the CPU with random weights (the benchmark seeds torch first, so every
  call builds the same one) and has no randomness in its forward: no dropout, or its
  probability 0 (miniddp and torch's DDP take turns, so a random mask would differ), and on a
  GPU no kernels that sum in a varying order (see ``Block``);
* ``make_batch(generator)`` returns ``(inputs, target)`` as CPU tensors, drawn from the
  ``torch.Generator`` it is given (seeded per rank); ``inputs`` is a tensor, or a tuple of them
  passed to ``model(*inputs)``;
* ``quick`` (optional parameter) asks for a tiny version, for smoke runs and tests.
"""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP. Attention is written out in matmuls: fused
    attention kernels may sum in a varying order on a GPU, and the benchmark's bit check would
    then fail for no fault of either DDP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        batch, length, dim = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        scores = q @ k.transpose(-2, -1) / (dim // self.heads) ** 0.5
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
        attended = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A small decoder-only language model: what a reducer sees of a transformer (embeddings,
    then per layer two LayerNorms, attention and an MLP, every bias and norm its own tensor)."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, length: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(length, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.size(1)]
        return self.head(self.norm(self.blocks(x)))


def factory(quick: bool = False):
    vocab, dim, layers, heads, length, batch = (64, 16, 2, 2, 8, 4) if quick \
        else (8192, 512, 8, 8, 256, 16)
    model = TinyTransformer(vocab, dim, layers, heads, length)

    def make_batch(generator: torch.Generator):
        tokens = torch.randint(0, vocab, (batch, length + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]  # predict the next token

    def loss(logits, target):
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    return model, make_batch, loss
