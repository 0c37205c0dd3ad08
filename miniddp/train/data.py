"""A learning task made in code: inputs, a hidden "teacher" that labels them, a student to train.

The reference job learns it, and so do the lessons (through ``course/data.py``, which adds how
they cut it into shards). Both need data that costs no download, is identical on every run and
every rank, and has something in it to learn. Random targets do not (a model fitting noise shows
no progress, so a bug that stops learning goes unnoticed). Here every target is ``teacher(x)``, a
fixed random two-layer network, and the student has room to represent the teacher exactly: the
loss can fall towards zero, and when it does not, something is broken.

Everything is a pure function of a seed, so a second run, a second rank, or a restarted process
rebuilds the same tensors bit for bit without anyone sending them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

IN_FEATURES = 16
OUT_FEATURES = 4
TEACHER_HIDDEN = 32
TEACHER_SEED = 1234  # one fixed teacher: every dataset, whatever its seed, is the same task


def _teacher(x: torch.Tensor) -> torch.Tensor:
    """The hidden function the student must learn: ``tanh(x @ W1) @ W2``, weights fixed forever."""
    g = torch.Generator().manual_seed(TEACHER_SEED)
    w1 = torch.randn(IN_FEATURES, TEACHER_HIDDEN, generator=g) / IN_FEATURES**0.5
    w2 = torch.randn(TEACHER_HIDDEN, OUT_FEATURES, generator=g) / TEACHER_HIDDEN**0.5
    return torch.tanh(x @ w1) @ w2


def make_dataset(n: int = 4096, seed: int = 0) -> TensorDataset:
    """``n`` pairs ``(x, teacher(x))`` with ``x ~ N(0, 1)``, on the CPU.

    The seed picks the inputs only; the teacher is always the same, so ``make_dataset(n, seed=1)``
    is a held-out set for a model trained on ``seed=0``.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN_FEATURES, generator=g)
    return TensorDataset(x, _teacher(x))


def make_model(seed: int = 0, hidden: int = 64) -> nn.Module:
    """The student: ``Linear -> Tanh -> Linear``, wide enough to contain the teacher.

    Its initial weights depend on ``seed`` alone; the global random state is left untouched, so
    building a model never changes what a later ``torch.randn`` returns.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(IN_FEATURES, hidden), nn.Tanh(),
                             nn.Linear(hidden, OUT_FEATURES))
