"""Models from outside the benchmarks: the user's own (``--model package.module:factory``) and
two ready-made ones, ``gpt2`` (transformers) and ``resnet50`` (torchvision).

An engineer wants the best bucket cap for *their* model. A factory is any callable that returns
the model and a batch maker (see examples/my_model.py):

    def factory(quick: bool = False):         # ``quick`` is passed only if it is a parameter
        model = ...                           # an nn.Module on the CPU, random init
        def make_batch(generator):            # a torch.Generator, seeded per rank
            return inputs, target             # CPU tensors; inputs a tensor or a tuple of them
        return model, make_batch              # or (model, make_batch, loss(output, target))

The harness moves the model and the batches to each rank's device, calls ``model(*inputs)``
and ``loss(output, target)`` (mean squared error unless the factory gives a loss), and checks,
as for its own models, that miniddp's parameters end bit-identical to torch's DDP. So the model
must be deterministic: no dropout (set its probability to 0), no randomness in forward, and on
a GPU no kernels that sum in a varying order (``torch.backends.cudnn.deterministic = True`` for
convolutions; ``torch.use_deterministic_algorithms(True)`` finds the others).

The ready-made models are built with random weights; nothing is ever downloaded. Where their
library is not installed they are skipped with a message saying so.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class OutsideModel:
    """What a factory gave: the model, its batch maker and its loss."""

    model: nn.Module
    make_batch: Callable[[torch.Generator], tuple]
    loss: Callable = F.mse_loss


def is_outside(name: str) -> bool:
    return name in READY_MADE or ":" in name


def unavailable(name: str) -> str | None:
    """Why ``name`` cannot run here (a library is missing), or None."""
    if name in READY_MADE:
        library = READY_MADE[name][1]
        if importlib.util.find_spec(library) is None:
            return f"--model {name} needs {library}, which is not installed (pip install {library})"
    return None


@functools.cache
def built(name: str, quick: bool, seed: int = 0) -> OutsideModel:
    """:func:`build` once per process (a ready-made GPT-2 takes seconds to initialize); callers
    copy the model."""
    torch.manual_seed(seed)
    return build(name, quick)


def build(name: str, quick: bool) -> OutsideModel:
    """Call the factory ``name`` names (``package.module:function`` or a ready-made name)."""
    factory = READY_MADE[name][0] if name in READY_MADE else load_factory(name)
    takes_quick = "quick" in inspect.signature(factory).parameters
    made = factory(quick=quick) if takes_quick else factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise TypeError(f"--model {name}: the factory must return (model, make_batch) or "
                        f"(model, make_batch, loss), not {type(made).__name__}")
    if not isinstance(made[0], nn.Module) or not callable(made[1]):
        raise TypeError(f"--model {name}: the factory returned ({type(made[0]).__name__}, "
                        f"{type(made[1]).__name__}, ...); expected an nn.Module and a callable")
    return OutsideModel(*made)


def load_factory(spec: str) -> Callable:
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise SystemExit(f"--model {spec}: cannot import {module_name!r} ({error}); the module "
                         "must be importable from where you run (PYTHONPATH)") from error
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise SystemExit(f"--model {spec}: {module_name} has no function {attribute!r}")
    return factory


# ----- ready-made models (random init, never downloaded) -----

def gpt2(quick: bool = False):
    """GPT-2 124M from transformers (a 2-layer, 32-wide one with ``quick``), dropout off, next-
    token cross-entropy on random tokens: 148 tensors, like the models engineers train."""
    from transformers import GPT2Config, GPT2LMHeadModel

    size = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32) if quick \
        else dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    batch, length = (2, 16) if quick else (8, 512)
    last = size["vocab_size"] - 1  # GPT-2's end-of-text token
    # eager attention: plain matmuls; the fused kernels' backward may sum in a varying order
    config = GPT2Config(**size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=last, eos_token_id=last, attn_implementation="eager")
    model = GPT2LMHeadModel(config)

    def make_batch(generator):
        tokens = torch.randint(0, config.vocab_size, (batch, length), generator=generator)
        return tokens, tokens

    def next_token_loss(output, tokens):
        logits = output["logits"][:, :-1]  # a ModelOutput, or the dict DataParallel gathers
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                               tokens[:, 1:].reshape(-1))

    return model, make_batch, next_token_loss


def resnet50(quick: bool = False):
    """ResNet-50 from torchvision (random init, 161 tensors, BatchNorm buffers that DDP
    broadcasts), cross-entropy on random 224 x 224 images; with ``quick`` one bottleneck block
    per stage, 8 channels per group, 32 x 32 images."""
    from torchvision.models import resnet50 as torchvision_resnet50
    from torchvision.models.resnet import Bottleneck, ResNet

    # cuDNN may pick convolution kernels that sum in a varying order: then two copies trained
    # alike differ in their last bits, and the bit check fails for no fault of either DDP
    torch.backends.cudnn.deterministic = True
    classes = 10 if quick else 1000
    model = ResNet(Bottleneck, [1, 1, 1, 1], num_classes=classes, width_per_group=8) if quick \
        else torchvision_resnet50(weights=None, num_classes=classes)
    batch, side = (2, 32) if quick else (32, 224)

    def make_batch(generator):
        return (torch.randn(batch, 3, side, side, generator=generator),
                torch.randint(0, classes, (batch,), generator=generator))

    return model, make_batch, F.cross_entropy


#: name: (factory, the library it needs)
READY_MADE = {"gpt2": (gpt2, "transformers"), "resnet50": (resnet50, "torchvision")}
