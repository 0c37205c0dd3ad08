"""miniddp.fully_shard beside torch's FSDP2 on models as users build them, bit for bit.

A model is described by small frozen dataclasses (:class:`ModelSpec`, :class:`BlockSpec`, and
:class:`Run` for how it is trained), so that a description travels to the ranks by pickle and
prints whole when a case fails. Each rank trains the model under torch's ``fully_shard`` and then
under miniddp's, records every local gradient shard after every backward, every parameter shard
after every step, the clip norm and every eval output, or the error a run raised, and the two
records must agree bit for bit (or both runs raise).

Here: four minimal models that once crashed where torch trains, or differed from it (each test
failed before its cause was fixed); ``tests/fsdp/test_fsdp_random.py`` draws random ones.
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field, replace

import pytest
import torch
import torch.distributed as dist
from test_fsdp import (
    DTYPES,
    TorchPolicy,
    broken,
    count_differences,
    device_mesh,
    local,
    needs_torch_fsdp2,
    torch_fully_shard,
)
from torch import nn

import miniddp

#: How a block's activations are recomputed in backward: around its call
#: (``torch.utils.checkpoint``, non-reentrant with early stop, whole, reentrant, or selective:
#: the matmuls' outputs saved, the rest recomputed), torch's
#: composable ``checkpoint(block)``, ``checkpoint_wrapper`` (non-reentrant, reentrant), or
#: inside the block, around its first layer (non-reentrant, reentrant).
CHECKPOINTS = ("", "call", "call_whole", "call_reentrant", "call_selective", "composable",
               "wrapper", "wrapper_reentrant", "inside", "inside_reentrant")


@dataclass(frozen=True)
class BlockSpec:
    d_out: int = 4
    hidden: int = 4
    wrapped: bool = True
    reshard: bool | None = None  # reshard_after_forward of its unit
    inner_unit: bool = False  # fc1 a unit of its own inside the block's
    frozen: str = ""  # "fc1", "fc2" or "all"
    gamma: bool = False  # a layer-scale parameter the block holds itself
    norm: bool = False  # a LayerNorm first
    residual: bool = False  # x + f(x) (d_in == d_out)
    checkpoint: str = ""
    twice: bool = False  # applied twice in a row (d_in == d_out)
    dropout: bool = False
    output: str = ""  # the block returns a "tuple", a "dict" or a "dataclass" holding its output


@dataclass(frozen=True)
class ModelSpec:
    d_in: int = 4  # features of a dense input; with ``vocab``, token ids and an embedding
    vocab: int = 0
    d_model: int = 4
    blocks: tuple[BlockSpec, ...] = (BlockSpec(),)
    n_out: int = 3
    tied: bool = False  # head.weight is embed.weight
    root_param: str = ""  # "pos": added before the blocks; "scale": times the head's output
    frozen_stem: bool = False
    frozen_head: bool = False
    stem_unit: bool = False  # the stem (or embedding) a unit of its own
    root_wrapped: bool = True
    root_reshard: bool | None = None


@dataclass(frozen=True)
class Run:
    model: ModelSpec = field(default_factory=ModelSpec)
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    optimizer: str = "sgd"  # "sgd", "momentum", "adam", "adamw"
    steps: int = 2
    micro_batches: int = 1
    sync_micro_batches: bool = False  # else set_requires_gradient_sync(False) but for the last
    clip: tuple[float, float, bool | None] | None = None  # max_norm, norm_type, foreach
    batch_sizes: tuple[int, ...] = (5,)  # cycled over (step, micro-batch, rank)
    eval_at: str = ""  # "after_step", "before_step" or "between_micro_batches"
    keep_gathered: bool = False  # set_reshard_after_backward(False) while accumulating
    zero_to_none: bool = True  # optimizer.zero_grad(set_to_none=...)
    two_forwards: bool = False  # two forwards, their losses summed, one backward
    seed: int = 0
    mesh: tuple[int, int] | None = None  # (replicas, shards): HSDP, on torch's DeviceMesh
    meta_init: bool = False  # built on the meta device, sharded, to_empty, then initialized
    reload: bool = False  # after the first step, the state (model, optimizer) into a fresh model


class Block(nn.Module):
    def __init__(self, d_in: int, spec: BlockSpec):
        super().__init__()
        self.spec = spec
        self.norm = nn.LayerNorm(d_in) if spec.norm else None
        self.fc1 = nn.Linear(d_in, spec.hidden)
        self.fc2 = nn.Linear(spec.hidden, spec.d_out)
        if spec.gamma:
            self.gamma = nn.Parameter(torch.rand(spec.d_out) + 0.5)
        self.dropout = nn.Dropout(0.25) if spec.dropout else nn.Identity()

    def first(self, h):
        return self.dropout(torch.relu(self.fc1(h)))

    def forward(self, x):
        h = self.norm(x) if self.norm is not None else x
        if self.spec.checkpoint.startswith("inside"):
            h = torch.utils.checkpoint.checkpoint(
                self.first, h, use_reentrant=self.spec.checkpoint == "inside_reentrant")
        else:
            h = self.first(h)
        h = self.fc2(h)
        if self.spec.gamma:
            h = h * self.gamma
        h = x + h if self.spec.residual else h
        if self.spec.output == "tuple":
            return h, h.detach().sum()
        if self.spec.output == "dict":
            return {"h": h}
        return BlockOutput(h) if self.spec.output == "dataclass" else h


@dataclass
class BlockOutput:
    h: torch.Tensor


def _unpack(output):
    if isinstance(output, tuple):
        return output[0]
    if isinstance(output, dict):
        return output["h"]
    return output.h if isinstance(output, BlockOutput) else output


class Net(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        if spec.vocab:
            self.embed = nn.Embedding(spec.vocab, spec.d_model)
        else:
            self.stem = nn.Linear(spec.d_in, spec.d_model)
        if spec.root_param == "pos":
            self.pos = nn.Parameter(torch.randn(spec.d_model) / 4)
        widths = [spec.d_model] + [b.d_out for b in spec.blocks]
        self.blocks = nn.ModuleList(Block(d, b) for d, b in zip(widths, spec.blocks))
        self.head = nn.Linear(widths[-1], spec.n_out, bias=not spec.tied)
        if spec.tied:
            self.head.weight = self.embed.weight
        if spec.root_param == "scale":
            self.scale = nn.Parameter(torch.rand(spec.n_out) + 0.5)

    def forward(self, x):
        h = self.embed(x) if self.spec.vocab else self.stem(x)
        if self.spec.root_param == "pos":
            h = h + self.pos
        for block, spec in zip(self.blocks, self.spec.blocks):
            for _ in range(1 + spec.twice):
                h = _unpack(call_block(block, spec.checkpoint, h))
        out = self.head(h)
        return out * self.scale if self.spec.root_param == "scale" else out


def call_block(block, how: str, h):
    from torch.utils import checkpoint

    if how in ("call", "call_whole"):
        whole = getattr(checkpoint, "set_checkpoint_early_stop", None)
        with whole(False) if whole and how == "call_whole" else contextlib.nullcontext():
            return checkpoint.checkpoint(block, h, use_reentrant=False)
    if how == "call_reentrant":
        return checkpoint.checkpoint(block, h, use_reentrant=True)
    if how == "call_selective":
        return checkpoint.checkpoint(block, h, use_reentrant=False, context_fn=_save_matmuls)
    return block(h)


def _save_matmuls():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return (CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.addmm.default,
                                                     torch.ops.aten.mm.default)
                else CheckpointPolicy.PREFER_RECOMPUTE)
    return create_selective_checkpoint_contexts(policy)


def build(spec: ModelSpec, seed: int, meta: bool = False) -> Net:
    """The model, its frozen layers frozen and its checkpointing applied, before any sharding."""
    torch.manual_seed(seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = Net(spec)
    for block, b in zip(model.blocks, spec.blocks):
        for name in ("fc1", "fc2") if b.frozen == "all" else [b.frozen] if b.frozen else []:
            getattr(block, name).requires_grad_(False)
    for frozen, module in ((spec.frozen_stem, model.embed if spec.vocab else model.stem),
                           (spec.frozen_head, model.head)):
        if frozen:
            module.requires_grad_(False)
    for i, b in enumerate(spec.blocks):
        if b.checkpoint == "composable":
            from torch.distributed._composable import checkpoint

            checkpoint(model.blocks[i])
        elif b.checkpoint.startswith("wrapper"):
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                CheckpointImpl,
                checkpoint_wrapper,
            )

            impl = (CheckpointImpl.REENTRANT if b.checkpoint == "wrapper_reentrant"
                    else CheckpointImpl.NO_REENTRANT)
            model.blocks[i] = checkpoint_wrapper(model.blocks[i], checkpoint_impl=impl)
    return model


def shard(model: Net, impl: str, run: Run) -> Net:
    """``fully_shard`` bottom-up: inner units, blocks, the stem, then the root."""
    spec = model.spec
    if impl == "torch":
        fully_shard, extra = torch_fully_shard, {"mesh": device_mesh("cpu", run.mesh)}
        policy_type = TorchPolicy
    else:
        fully_shard, policy_type = miniddp.fully_shard, miniddp.MixedPrecisionPolicy
        extra = {"mesh": device_mesh("cpu", run.mesh)} if run.mesh else {}
    policy = policy_type(param_dtype=DTYPES[run.param_dtype],
                         reduce_dtype=DTYPES[run.reduce_dtype])
    for block, b in zip(model.blocks, spec.blocks):
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        if b.inner_unit:
            fully_shard(inner.fc1, mp_policy=policy, **extra)
        if b.wrapped:
            fully_shard(block, reshard_after_forward=b.reshard, mp_policy=policy, **extra)
    if spec.stem_unit:
        fully_shard(model.embed if spec.vocab else model.stem, mp_policy=policy, **extra)
    if spec.root_wrapped:
        fully_shard(model, reshard_after_forward=spec.root_reshard, mp_policy=policy, **extra)
    return model


def built(impl: str, run: Run, seed: int) -> Net:
    """Built and sharded; with ``meta_init``, on the meta device first, then materialized and
    every parameter drawn afresh through its DTensor (torchtitan's ``init_weights``)."""
    model = shard(build(run.model, seed, meta=run.meta_init), impl, run)
    if run.meta_init:
        model.to_empty(device="cpu")
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                nn.init.trunc_normal_(p, std=0.3)
    return model


def reloaded(model, optimizer, impl: str, run: Run):
    """A fresh model and optimizer (another seed) given ``model``'s and ``optimizer``'s state
    through torch's ``get_state_dict`` and ``set_state_dict``, as a resumed job gets it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    fresh = built(impl, run, run.seed + 1)
    fresh_optimizer = make_optimizer(fresh, run.optimizer)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=msd, optim_state_dict=osd)
    return fresh, fresh_optimizer


def make_optimizer(model, name):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05)
    if name == "momentum":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    kind = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return kind(model.parameters(), lr=0.01, weight_decay=0.1 if name == "adamw" else 0.0)


def batch(spec: ModelSpec, size: int, gen: torch.Generator):
    if spec.vocab:
        ids = torch.randint(spec.vocab, (size, 3), generator=gen)
        return ids, lambda out: nn.functional.cross_entropy(
            out.float().reshape(-1, spec.n_out), ids.roll(-1, 1).reshape(-1) % spec.n_out)
    x = torch.randn(size, spec.d_in, generator=gen)
    return x, lambda out: out.float().pow(2).mean()


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class Recorder:
    """What one run shows, as (label, tensor) pairs."""

    def __init__(self, model):
        self.model, self.seen = model, []

    def grads(self, where: str) -> None:
        self.seen += [(f"{where} grad {n}", _copy(local(p.grad)))
                      for n, p in self.model.named_parameters()]

    def params(self, where: str) -> None:
        self.seen += [(f"{where} param {n}", _copy(local(p)))
                      for n, p in self.model.named_parameters()]

    def add(self, label: str, tensor) -> None:
        self.seen.append((label, _copy(_full(tensor))))


def _copy(tensor):
    return None if tensor is None else tensor.detach().clone().as_subclass(torch.Tensor)


def train(impl: str, run: Run):
    """One run: ``(recorded, None)``, or ``(recorded so far, error)`` if it raised."""
    seen = Recorder(None)
    try:
        model = seen.model = built(impl, run, run.seed)
        optimizer = make_optimizer(model, run.optimizer)
        sizes = iter(run.batch_sizes * 1000)
        for step in range(run.steps):
            for micro in range(run.micro_batches):
                _micro_batch(model, run, seen, (step, micro), sizes)
            if run.eval_at == "before_step":
                _eval(model, run, seen, step)
            if run.clip is not None:
                max_norm, norm_type, foreach = run.clip
                seen.add(f"step {step} norm", torch.nn.utils.clip_grad_norm_(
                    model.parameters(), max_norm, norm_type, foreach=foreach))
                seen.grads(f"step {step} clipped")
            optimizer.step()
            optimizer.zero_grad(set_to_none=run.zero_to_none)
            if run.reload and step == 0:
                model, optimizer = reloaded(model, optimizer, impl, run)
                seen.model = model
            seen.params(f"step {step}")
            if run.eval_at == "after_step":
                _eval(model, run, seen, step)
    except Exception as error:  # noqa: BLE001 -- the run's verdict: compared, not hidden
        return seen.seen, f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=-3)}"
    return seen.seen, None


def _micro_batch(model, run: Run, seen: Recorder, when: tuple[int, int], sizes) -> None:
    """One forward (two, with ``two_forwards``) and backward, on this rank's batch."""
    (step, micro), rank = when, dist.get_rank()
    if run.eval_at == "between_micro_batches" and micro:
        _eval(model, run, seen, f"{step}.{micro}")
    last = micro == run.micro_batches - 1
    set_sync(model, run.sync_micro_batches or last)
    if run.keep_gathered:
        set_reshard_after_backward(model, last)
    size = [next(sizes) for _ in range(dist.get_world_size())][rank]
    gen = torch.Generator().manual_seed(run.seed + 1000 * step + 10 * micro + rank)
    total = 0
    for _ in range(1 + run.two_forwards):
        x, loss = batch(run.model, size, gen)
        total = total + loss(model(x))
    total.backward()
    seen.grads(f"step {step} micro {micro}")


def set_sync(model, sync: bool) -> None:
    """On every unit: the root may be no unit of its own."""
    for module in model.modules():
        if hasattr(module, "set_requires_gradient_sync"):
            module.set_requires_gradient_sync(sync, recurse=False)


def set_reshard_after_backward(model, reshard: bool) -> None:
    for module in model.modules():
        if hasattr(module, "set_reshard_after_backward"):
            module.set_reshard_after_backward(reshard, recurse=False)


def _eval(model, run: Run, seen: Recorder, when) -> None:
    x, _ = batch(run.model, 3, torch.Generator().manual_seed(run.seed + 7))
    model.eval()
    with torch.no_grad():
        seen.add(f"eval {when}", model(x))
    model.train()


# ----- two runs compared -----

def compare(run: Run, first: str = "torch", second: str = "miniddp",
            breakage: str | None = None) -> list[str]:
    """On every rank: how the two runs differ (empty: bit for bit, or both refused). The second
    runs first, with ``breakage`` (of ``test_fsdp.BREAKAGES``) patched into miniddp."""
    torch.set_num_threads(1)
    with broken(breakage):
        seen_second, error_second = train(second, run)
    if first == "torch" and error_second and "holds none of its rows" in error_second:
        return []  # torch raises on that rank alone and its others time out: see test_fsdp_errors
    seen_first, error_first = train(first, run)
    problems = []
    if (error_first is None) != (error_second is None):
        problems.append(f"{first}: {error_first or 'trained'}; {second}: "
                        f"{error_second or 'trained'}")
    labels = [label for label, _ in seen_first], [label for label, _ in seen_second]
    if labels[0] != labels[1]:
        problems.append(f"recorded {len(labels[0])} and {len(labels[1])} tensors")
    count_differences("", seen_first, seen_second, problems)
    return problems


def compare_all(runs: list[Run], **kwargs) -> list[list[str]]:
    return [compare(run, **kwargs) for run in runs]


def check_identical(results, runs) -> None:
    failures = [f"rank {rank}, {run}:\n  " + "\n  ".join(problems[:6])
                for rank, per_run in enumerate(results)
                for run, problems in zip(runs, per_run) if problems]
    assert not failures, "\n".join(failures)


# ----- the four causes of issue 44, each a minimal model, fp32 and bf16 -----

def _both_precisions(run: Run) -> list[Run]:
    return [run, replace(run, param_dtype="bf16")]


#: stem -> block(fc1 frozen, relu, fc2) -> head: autograd needs the frozen fc1's weight after
#: the block's last trainable gradient, for the gradient of the block's input. And a frozen head
#: whose output a trainable root parameter scales, with nothing else trainable in the root.
FROZEN_STILL_NEEDED = [Run(ModelSpec(blocks=(BlockSpec(frozen="fc1"),))),
                       Run(ModelSpec(root_param="scale", frozen_head=True, frozen_stem=True))]
#: The same model, the block recomputed by reentrant checkpointing around the unit's call.
REENTRANT_CHECKPOINT = [Run(ModelSpec(blocks=(BlockSpec(checkpoint="call_reentrant"),))),
                        Run(ModelSpec(blocks=(BlockSpec(checkpoint="wrapper_reentrant"),)))]
#: One unit over everything, its root holding a parameter of its own (a layer-scale on the
#: head's output) beside its children's: torch lays it out after theirs.
ROOT_OWN_PARAMETER = [Run(ModelSpec(d_model=7, n_out=5, blocks=(BlockSpec(
    d_out=7, hidden=9, wrapped=False),), root_param="scale"), steps=3)]
#: A block applied twice; two micro-batches, the first without gradient sync.
CALLED_TWICE_AFTER_NO_SYNC = [Run(ModelSpec(blocks=(BlockSpec(twice=True),)), micro_batches=2)]

#: An eval forward (no gradients) between the backward and the optimizer step: torch leaves the
#: root gathered after it (the root does not reshard after forward), so the next forward computes
#: with the root's parameters from before the step. miniddp does the same, bit for bit.
EVAL_BETWEEN_BACKWARD_AND_STEP = [Run(ModelSpec(root_param="pos"), eval_at="before_step",
                                      steps=3)]

#: A unit inside a block that reentrant checkpointing recomputes, the block called twice: torch
#: reduces only the second call's gradient in that backward and leaves the unit gathered with the
#: first's. miniddp does the same, bit for bit.
NESTED_UNIT_REENTRANT_TWICE = [Run(ModelSpec(blocks=(BlockSpec(
    inner_unit=True, checkpoint="call_reentrant", twice=True),)), steps=3)]

#: A unit inside a block under selective activation checkpointing: torch trains it (its backward
#: prefetch has the unit's all-gather done before the recomputation), and refuses it when the
#: next block, recomputed reentrantly and called twice, has a unit of its own (the recomputation
#: makes more of FSDP's profiler calls than the forward did), or when the units stay gathered
#: between micro-batches (the recomputation copies the prefetched rows out, the forward did not).
#: miniddp trains and refuses alike.
SELECTIVE_CHECKPOINT_AROUND_A_UNIT = [
    Run(ModelSpec(blocks=(BlockSpec(wrapped=False, inner_unit=True, checkpoint="call_selective"),
                          BlockSpec()))),
    Run(ModelSpec(blocks=(BlockSpec(wrapped=False, inner_unit=True, checkpoint="call_selective"),
                          BlockSpec(inner_unit=True, checkpoint="wrapper_reentrant",
                                    twice=True)))),
    Run(ModelSpec(blocks=(BlockSpec(inner_unit=True, checkpoint="call_selective"),)),
        micro_batches=3, keep_gathered=True)]


@needs_torch_fsdp2
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("runs", [FROZEN_STILL_NEEDED, REENTRANT_CHECKPOINT, ROOT_OWN_PARAMETER,
                                  CALLED_TWICE_AFTER_NO_SYNC, EVAL_BETWEEN_BACKWARD_AND_STEP,
                                  NESTED_UNIT_REENTRANT_TWICE, SELECTIVE_CHECKPOINT_AROUND_A_UNIT],
                         ids=["frozen_layer_needed_after_the_last_gradient",
                              "reentrant_checkpoint_around_a_unit",
                              "root_parameter_after_its_childrens",
                              "unit_called_twice_after_a_no_sync_micro_batch",
                              "eval_forward_between_backward_and_step",
                              "unit_in_a_block_recomputed_reentrantly_twice",
                              "unit_in_a_selectively_checkpointed_block"])
def test_minimal_model_trains_bit_for_bit_as_torch(ranks, world_size, runs):
    runs = [r for run in runs for r in _both_precisions(run)]
    check_identical(ranks(world_size).run(compare_all, runs, timeout=120), runs)


@needs_torch_fsdp2
@pytest.mark.parametrize("runs, breakage", [
    (ROOT_OWN_PARAMETER, "module_parameters_order"),
    (CALLED_TWICE_AFTER_NO_SYNC, "post_backward_at_the_end"),
    (SELECTIVE_CHECKPOINT_AROUND_A_UNIT[:1], "no_backward_prefetch"),
    (SELECTIVE_CHECKPOINT_AROUND_A_UNIT[1:2], "no_profiler_names"),
    (SELECTIVE_CHECKPOINT_AROUND_A_UNIT[2:], "prefetch_copies_out")])
def test_minimal_model_tells_its_mechanism_broken_at_3_ranks(ranks, runs, breakage):
    """Negative controls: a unit's parameters in ``module.parameters()``'s order; every unit
    reduced at the end of the backward instead of from its inputs; no backward prefetch (miniddp
    then refuses where torch trains); no profiler names, or a prefetch that copies the rows out
    at once (miniddp then trains where torch refuses)."""
    runs = [r for run in runs for r in _both_precisions(run)]
    results = ranks(3).run(compare_all, runs, breakage=breakage, timeout=120)
    agreeing = [run for i, run in enumerate(runs) if not any(r[i] for r in results)]
    assert not agreeing, f"broken on purpose ({breakage}), yet bit-identical: {agreeing}"
