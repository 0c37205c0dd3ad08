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
  probability 0 (miniddp and torch's DDP take turns, so a random mask would differ);
* ``make_batch(generator)`` returns ``(inputs, target)`` as CPU tensors, drawn from the
  ``torch.Generator`` it is given (seeded per rank); ``inputs`` is a tensor, or a tuple of them
  passed to ``model(*inputs)``;
* ``quick`` (optional parameter) asks for a tiny version, for smoke runs and tests.
"""

import torch
import torch.nn.functional as F
from torch import nn


class TinyTransformer(nn.Module):
    """A small decoder-only language model: what a reducer sees of a transformer (embeddings,
    then per layer two LayerNorms, attention and an MLP, every bias and norm its own tensor)."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, length: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.randn(length, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(length))

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.size(1)]
        return self.head(self.blocks(x, mask=self.causal, is_causal=True))


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
