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

import contextlib
import copy
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import miniddp
from miniddp.fsdp import collectives, init, param, param_group, shard, state

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
    reshard_after_forward: bool | None = None  # torch 2.13: the root keeps its parameters
    frozen: bool = False
    frozen_after_sharding: bool = False  # the same layer frozen once both are sharded
    micro_batches: int = 1
    # two: the second forward reads the stepped parameters (ZeRO-2's kept gathered copy, a
    # tied weight) and the second step momentum's and Adam's state
    steps: int = 2
    breakage: str | None = None
    device: str = "cpu"
    clip: float | None = None  # clip_grad_norm_ to this before each step
    clip_foreach: bool | None = None  # False: one torch.linalg.vector_norm per gradient
    sync_micro_batches: bool = False  # every micro-batch's backward synchronized, added up
    model: str = "mlp"  # or "tokens": TokenNet
    checkpointed: bool = False  # activation checkpointing inside each block
    composable_checkpoint: bool = False  # torch's checkpoint(block) on each block
    mesh: tuple[int, ...] | None = None  # (replicas, shards): HSDP; both on torch's DeviceMesh
    hybrid_mesh: bool = False  # miniddp's on miniddp.fsdp.HybridMesh(replicas, shards) instead
    skip_all_reduce: bool = False  # HSDP: the micro-batches but the last without all-reduce

    def __str__(self):
        return ", ".join(f"{k}={v}" for k, v in self.__dict__.items() if v != getattr(Case, k))


class Block(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.checkpointed = False  # the parent recomputes it in backward instead of saving

    def forward(self, x):
        return torch.tanh(self.lin(x))


def call(block, x):
    """``block(x)``, under activation checkpointing when the block asks for it: the block's
    forward (its hooks too) runs again inside backward."""
    if block.checkpointed:
        from torch.utils import checkpoint

        # the whole re-forward, forward hook included (early stop would skip that hook)
        whole = getattr(checkpoint, "set_checkpoint_early_stop", None)
        with whole(False) if whole else contextlib.nullcontext():
            return checkpoint.checkpoint(block, x, use_reentrant=False)
    return block(x)


class Net(nn.Module):
    """Blocks of 31, 17 and 2 rows (uneven at 3 ranks; the last leaves rank 2 empty), and a
    root parameter of its own beside them."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(12, 31), Block(31, 17), Block(17, 2)])
        self.head = nn.Linear(2, 5)

    def forward(self, x):
        for block in self.blocks:
            x = call(block, x)
        return self.head(x)


class TokenNet(nn.Module):
    """What a language model looks like to FSDP: an embedding fed token ids (its unit's input
    needs no gradient), blocks, and a head whose weight is the embedding's (tied, in the root)."""

    VOCAB = 23

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, 12)
        self.blocks = nn.ModuleList([Block(12, 31), Block(31, 12)])
        self.head = nn.Linear(12, self.VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = call(block, x)
        return self.head(x)


def batch_and_loss(case, gen):
    """One micro-batch of this rank's data, and the loss of a model's output on it."""
    if case.model == "tokens":
        ids = torch.randint(TokenNet.VOCAB, (4, 6), generator=gen).to(case.device)
        return ids, lambda out: nn.functional.cross_entropy(
            out.float().reshape(-1, TokenNet.VOCAB), ids.roll(-1, 1).reshape(-1))
    x = torch.randn(8, 12, generator=gen).to(case.device)
    return x, lambda out: out.float().pow(2).mean()


def shard_model(model, shard, policy, case, **mesh):
    for block in model.blocks:
        shard(block, reshard_after_forward=case.reshard_after_forward, mp_policy=policy, **mesh)
    shard(model, reshard_after_forward=case.reshard_after_forward, mp_policy=policy, **mesh)
    return model


#: This rank's meshes, by what they were built from, each beside the default group it was built
#: in: a 2-D mesh makes process groups, every rank meeting every other through the store, which
#: costs more than a case's training; one mesh of each shape serves every case of a rank's life
_MESHES: dict = {}


def _kept(key, build):
    """``build()``, or the mesh it gave before under ``key`` in this same default group."""
    world = dist.group.WORLD
    if key not in _MESHES or _MESHES[key][0] is not world:
        _MESHES[key] = world, build()
    return _MESHES[key][1]


def device_mesh(device: str, shape: tuple[int, ...] | None = None):
    """A mesh of every rank on ``device`` (torch's default would be the GPU wherever there is
    one, and move CPU parameters there): 1-D, or of ``shape`` (replicas, shards) for HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    if shape is None or len(shape) == 1:
        return init_device_mesh(device, shape or (dist.get_world_size(),))
    return _kept(("device", device, tuple(shape)), lambda: init_device_mesh(
        device, shape, mesh_dim_names=("replicate", "shard")))


def meshes(case):
    """(miniddp's mesh, torch's mesh) for ``case``: the same DeviceMesh, or miniddp's own."""
    theirs = device_mesh(case.device, case.mesh)
    if case.mesh is None:
        return None, theirs
    if not case.hybrid_mesh:
        return theirs, theirs
    return _kept(("hybrid", tuple(case.mesh)), lambda: miniddp.fsdp.HybridMesh(*case.mesh)), theirs


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
        elif a is not None and (a.shape, a.dtype) != (b.shape, b.dtype):
            problems.append(f"{where} {name}: {a.dtype} {list(a.shape)} beside {b.dtype} "
                            f"{list(b.shape)}")
        elif a is not None and not torch.equal(a.detach(), b.detach()):
            differ = int((a.detach() != b.detach()).sum())
            problems.append(f"{where} {name}: {differ} of {a.numel()} elements differ")


def _train_beside_torch(case: Case) -> list[str]:
    torch.manual_seed(0)
    model = (TokenNet() if case.model == "tokens" else Net()).to(case.device)
    if case.frozen:
        model.blocks[1].requires_grad_(False)
    for block in model.blocks:
        block.checkpointed = case.checkpointed
    reference = copy.deepcopy(model)
    if case.composable_checkpoint:
        from torch.distributed._composable import checkpoint

        for block in [*model.blocks, *reference.blocks]:
            checkpoint(block)
    dtypes = dict(param_dtype=DTYPES[case.param_dtype], reduce_dtype=DTYPES[case.reduce_dtype])
    our_mesh, their_mesh = meshes(case)
    ours = shard_model(model, miniddp.fully_shard, miniddp.MixedPrecisionPolicy(**dtypes), case,
                       **({} if our_mesh is None else {"mesh": our_mesh}))
    theirs = shard_model(reference, torch_fully_shard, TorchPolicy(**dtypes), case,
                         mesh=their_mesh)
    if case.frozen_after_sharding:
        ours.blocks[1].requires_grad_(False)
        theirs.blocks[1].requires_grad_(False)
    opt_ours, opt_theirs = make_optimizer(ours, case.optimizer), make_optimizer(theirs,
                                                                                case.optimizer)
    problems: list[str] = []
    rank = dist.get_rank()
    for step in range(case.steps):
        for micro in range(case.micro_batches):
            last = micro == case.micro_batches - 1
            for model_ in (ours, theirs):
                model_.set_requires_gradient_sync(last or case.sync_micro_batches
                                                  or case.skip_all_reduce)
                if case.skip_all_reduce:
                    model_.set_requires_all_reduce(last)
            gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x, loss = batch_and_loss(case, gen)
            for model_ in (ours, theirs):
                loss(model_(x)).backward()
            count_differences(f"step {step} micro {micro} grad",
                              [(n, p.grad) for n, p in ours.named_parameters()],
                              [(n, p.grad) for n, p in theirs.named_parameters()], problems)
        if case.clip is not None:
            norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), case.clip,
                                                    foreach=case.clip_foreach)
                     for m in (ours, theirs)]
            count_differences(f"step {step} total norm", [("norm", norms[0])],
                              [("norm", norms[1].full_tensor())], problems)
            count_differences(f"step {step} clipped grad",
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

def _scale_before_sum(buffer, mesh=collectives.EVERY_RANK, partial=None, all_reduce=True):
    """DDP's arithmetic: every rank divides by W, then the sum (plain FSDP only)."""
    if buffer.dtype in (torch.float32, torch.bfloat16):
        buffer.div_(dist.get_world_size(mesh.shard_group))
        return collectives.reduce_scatter_sum(buffer, mesh.shard_group), None
    return _average(buffer, mesh, partial, all_reduce)


def _avg_in_fp16(world_size):
    """fp16 averaged as fp32 is: the sum, then one division by W."""
    return 1, world_size


def _all_reduce_mean(flat, group):
    """The average of every rank's ``flat`` (gloo's reduce-scatter is this, then a slice)."""
    world_size = dist.get_world_size(group)
    summed = torch.cat([flat, flat.new_zeros(-flat.numel() % world_size)])
    dist.all_reduce(summed, group=group)
    return summed.div_(world_size)


def _flat_layout(self, with_grad):
    """FSDP1's layout: whole flattened gradients one after another; each rank keeps its rows
    of each."""
    dtype = with_grad[0][0].reduce_dtype or with_grad[0][1].dtype
    summed = _all_reduce_mean(torch.cat([g.reshape(-1).to(dtype) for _, g in with_grad]),
                              self.mesh.shard_group)
    shards, offset = [], 0
    for p, g in with_grad:
        full = summed[offset:offset + g.numel()].view(g.shape).to(p.orig_dtype)
        shards.append(p.spec.cut(full))
        offset += g.numel()
    return shards


def _no_padding(self, with_grad):
    """Rank-major, but each chunk unpadded: rank r's chunks sit back to back after rank r-1's,
    so that the buffer's rows no longer line up with the ranks."""
    world_size = with_grad[0][0].spec.world_size
    dtype = with_grad[0][0].reduce_dtype or with_grad[0][1].dtype
    pieces = [(r, p, g.narrow(0, min(r * p.spec.chunk_rows, g.shape[0]),
                              replace(p.spec, rank=r).rows))
              for r in range(world_size) for p, g in with_grad]
    summed = _all_reduce_mean(torch.cat([c.reshape(-1).to(dtype) for _, _, c in pieces]),
                              self.mesh.shard_group)
    shards, offset = [], 0
    for r, p, chunk in pieces:
        if r == p.spec.rank:
            shards.append(summed[offset:offset + chunk.numel()].view(chunk.shape)
                          .to(p.orig_dtype))
        offset += chunk.numel()
    return shards


def _overwrite_sharded_grad(self, local):
    """A second synchronized backward replaces the shard's ``.grad`` instead of adding to it."""
    self.sharded.grad = shard.as_dtensor(local, self.dspec)


def _module_parameters_order(root, ignored):
    """A unit's parameters in ``module.parameters()``'s order (a module's own first), not
    torch's (children first)."""
    order = [id(p) for p in root.parameters()]
    return sorted(_managed_params(root, ignored), key=lambda pn: order.index(id(pn[0])))


def _post_backward_at_the_end(self, args, kwargs):
    """No post-backward from a unit's inputs: every unit reduces at the end of the backward."""
    return args, kwargs


def _no_backward_prefetch(self):
    """A unit's pre-backward gathers only itself."""


def _unshard_and_copy_out(self):
    """The rows copied out as soon as they are gathered, a prefetch's too."""
    _unshard(self)
    self.wait_for_unshard()


def _unnamed(name):
    """No profiler names for the hooks' work."""
    return contextlib.nullcontext()


_managed_params = init.managed_params
_unshard = param_group.ParamGroup.unshard
_average = collectives.average
BREAKAGES = {
    "module_parameters_order": (init, "managed_params", _module_parameters_order),
    "post_backward_at_the_end": (param_group.ParamGroup, "_call_post_backward_from_inputs",
                                 _post_backward_at_the_end),
    "no_backward_prefetch": (param_group.ParamGroup, "_backward_prefetch", _no_backward_prefetch),
    "prefetch_copies_out": (param_group.ParamGroup, "unshard", _unshard_and_copy_out),
    "no_profiler_names": [(param_group, "record_function", _unnamed),
                          (state, "record_function", _unnamed)],
    "overwrite_sharded_grad": (param.FSDPParam, "add_sharded_grad", _overwrite_sharded_grad),
    "scale_before_sum": (collectives, "average", _scale_before_sum),
    "avg_in_fp16": (collectives, "fp16_divide_factors", _avg_in_fp16),
    "flat_layout": (param_group.ParamGroup, "reduce_scatter", _flat_layout),
    "no_padding": (param_group.ParamGroup, "reduce_scatter", _no_padding),
}


@contextlib.contextmanager
def shared_breakage(name: str):
    """One of ``tests/support/breakage``'s breakages (those lessons' tests apply too), then
    undone."""
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parents[1] / "support" / "breakage")
    if here not in sys.path:
        sys.path.insert(0, here)
    import breakages

    breakages.apply(name)
    try:
        yield
    finally:
        breakages.undo()


@contextlib.contextmanager
def broken(breakage: str | None):
    """miniddp with one of :data:`BREAKAGES` (one patch, or a list) patched in, for the time of
    the block; or, for a name of ``tests/support/breakage`` (HSDP's: ``hsdp_...``), that
    breakage."""
    if breakage and breakage not in BREAKAGES:
        with shared_breakage(breakage):
            yield
        return
    patches = BREAKAGES[breakage] if breakage else []
    patches = patches if isinstance(patches, list) else [patches]
    rights = [vars(owner)[name] for owner, name, _ in patches]
    for owner, name, wrong in patches:
        setattr(owner, name, wrong)
    try:
        yield
    finally:
        for (owner, name, _), right in zip(patches, rights):
            setattr(owner, name, right)


def beside_torch(cases: list[Case]) -> list[list[str]]:
    """On every rank: each case's differences from torch's FSDP2 (empty: bit-identical)."""
    torch.set_num_threads(1)
    results = []
    for case in cases:
        with broken(case.breakage):
            results.append(_train_beside_torch(case))
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
@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.slow), 2, 3])
def test_every_precision_bit_identical_to_torch(ranks, world_size):
    cases = [replace(c, optimizer=opt) for c in PRECISIONS for opt in ("sgd", "adam")]
    check_identical(ranks(world_size).run(beside_torch, cases, timeout=120), cases)


@needs_torch_fsdp2
@pytest.mark.parametrize("world_size", [2, 3])
def test_zero2_frozen_accumulation_clipping_tied_embedding_checkpoints_identical(ranks, world_size):
    cases = [Case(reshard_after_forward=False), Case(reshard_after_forward=False,
                                                     optimizer="adam", param_dtype="bf16"),
             Case(frozen=True), Case(frozen=True, reshard_after_forward=False),
             Case(frozen_after_sharding=True, optimizer="adam"),
             Case(micro_batches=3), Case(micro_batches=2, param_dtype="fp16",
                                         reduce_dtype="fp32", optimizer="adam"),
             Case(micro_batches=2, param_dtype="bf16", reshard_after_forward=False),
             Case(clip=0.05), Case(clip=0.05, optimizer="adam", param_dtype="bf16"),
             Case(clip=0.05, clip_foreach=False),
             Case(micro_batches=2, sync_micro_batches=True, optimizer="adam"),
             Case(model="tokens", optimizer="adam"), Case(model="tokens", param_dtype="bf16",
                                                          reshard_after_forward=False),
             Case(checkpointed=True), Case(composable_checkpoint=True, micro_batches=2,
                                           optimizer="adam", param_dtype="fp16")]
    check_identical(ranks(world_size).run(beside_torch, cases, timeout=120), cases)


@needs_torch_fsdp2
@pytest.mark.skipif(torch.cuda.device_count() == 0, reason="no GPU here")  # NVML: no CUDA init
def test_bit_identical_to_torch_with_parameters_on_a_gpu(ranks):
    """Two gloo ranks sharing the GPU: the same arithmetic, in CUDA kernels."""
    cases = [Case(device="cuda"), Case(device="cuda", param_dtype="bf16", optimizer="adam"),
             Case(device="cuda", param_dtype="fp16", micro_batches=2)]
    check_identical(ranks(2).run(beside_torch, cases, timeout=120), cases)


@needs_torch_fsdp2
def test_each_bit_deciding_detail_broken_differs_from_torch_at_3_ranks(ranks):
    """One step each: every breakage shows in the first step's gradients."""
    cases = [replace(case, steps=1) for case in [
        Case(breakage="scale_before_sum"), Case(breakage="flat_layout"),
        Case(breakage="no_padding"), Case(breakage="avg_in_fp16", param_dtype="fp16"),
        Case(breakage="overwrite_sharded_grad", micro_batches=2, sync_micro_batches=True)]]
    check_all_differ(ranks(3).run(beside_torch, cases, timeout=120), cases)


# ----- what a sharded model looks like, and its memory -----

def _layout_facts() -> dict:
    torch.manual_seed(0)
    model = Net()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    miniddp.fully_shard(model.blocks[0])
    miniddp.fully_shard(model.blocks[1], reshard_after_forward=False)
    miniddp.fully_shard(model.blocks[2])
    miniddp.fully_shard(model)
    facts = {
        "names": [n for n, _ in model.named_parameters()],
        "shapes": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()},
        "global_shapes": [tuple(p.shape) for p in model.parameters()],
        "sharded": all(isinstance(p, shard.DTensor) and isinstance(p, nn.Parameter)
                       for p in model.parameters()),
        "full_tensor_equal": all(torch.equal(p.full_tensor(), full[n])
                                 for n, p in model.named_parameters()),
        "to_local_plain": all(type(p.to_local()) is torch.Tensor for p in model.parameters()),
        "class": type(model).__name__,
    }
    model(torch.randn(4, 12)).sum().backward()  # first forward: model becomes the root
    x = torch.randn(4, 12)
    out = model(x)
    facts["after_forward"] = {name: _kind(module.weight) for name, module in
                              [("block0", model.blocks[0].lin), ("block1", model.blocks[1].lin),
                               ("root", model.head)]}
    facts["block0_storage"] = model.blocks[0]._fsdp_state.group.params[0].unsharded \
        .untyped_storage().size()
    out.sum().backward()
    facts["after_backward_sharded"] = all(isinstance(p, shard.DTensor)
                                          for p in model.parameters())
    facts["grad_shapes_match"] = all(p.grad.shape == p.shape for p in model.parameters())
    facts["grad_full_tensor_shape"] = tuple(model.blocks[0].lin.weight.grad.full_tensor().shape)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # code for FSDP2 logs it so:
    facts["clip_norm"] = (f"{norm.full_tensor():.1f}", type(norm.full_tensor()).__name__,
                          norm.item() > 0)
    model.blocks[0].unshard()
    facts["unshard_method"] = tuple(model.blocks[0].lin.weight.shape)
    model.blocks[0].reshard()
    facts["reshard_method"] = tuple(model.blocks[0].lin.weight.to_local().shape)
    return facts


def _kind(param) -> str:
    return "sharded" if isinstance(param, shard.DTensor) else type(param).__name__


def test_parameters_keep_their_names_and_hold_torch_chunks_cut(ranks):
    facts = ranks(3).run(_layout_facts)
    names = [n for n, _ in Net().named_parameters()]
    for rank, f in enumerate(facts):
        assert f["names"] == names and f["sharded"] and f["class"] == "FSDPNet"
        assert f["global_shapes"] == [tuple(p.shape) for p in Net().parameters()]
        assert f["full_tensor_equal"] and f["to_local_plain"]
        # torch.chunk of 31 rows in 3: 11, 11, 9; of 2 rows: 1, 1 and none
        assert f["shapes"]["blocks.0.lin.weight"] == ((11, 12), (11, 12), (9, 12))[rank]
        assert f["shapes"]["blocks.2.lin.weight"] == ((1, 17), (1, 17), (0, 17))[rank]
        assert f["shapes"]["head.bias"] == ((2,), (2,), (1,))[rank]


def test_zero3_frees_after_forward_zero2_and_the_root_keep_parameters_gathered(ranks):
    for f in ranks(3).run(_layout_facts):
        assert f["after_forward"] == {"block0": "sharded", "block1": "Parameter",
                                      "root": "Parameter"}
        assert f["block0_storage"] == 0
        assert f["after_backward_sharded"] and f["grad_shapes_match"]
        assert f["grad_full_tensor_shape"] == (31, 12)
        assert f["clip_norm"][1:] == ("Tensor", True) and float(f["clip_norm"][0]) > 0
        assert f["unshard_method"] == (31, 12) and f["reshard_method"][0] in (9, 11)


def _no_sync_facts() -> dict:
    counted = {"calls": 0}
    right = collectives.average

    def counting(*args, **kwargs):
        counted["calls"] += 1
        return right(*args, **kwargs)

    collectives.average = counting
    try:
        torch.manual_seed(0)
        model = shard_model(Net(), miniddp.fully_shard, miniddp.MixedPrecisionPolicy(), Case())
        model.set_requires_gradient_sync(False)
        model(torch.randn(4, 12)).sum().backward()
        without = counted["calls"], [p.grad for p in model.parameters()].count(None)
        model.set_requires_gradient_sync(True)
        model(torch.randn(4, 12)).sum().backward()
        return {"without_sync": without, "with_sync": counted["calls"] - without[0]}
    finally:
        collectives.average = right


def test_no_gradient_sync_means_no_reduce_scatter(ranks):
    for f in ranks(2).run(_no_sync_facts):
        assert f["without_sync"] == (0, 8)  # no collective, no sharded gradient yet
        assert f["with_sync"] == 4  # one reduce-scatter per unit: three blocks and the root


def _ignored_facts() -> dict:
    torch.manual_seed(0)
    model = Net()
    kept = model.head.weight
    miniddp.fully_shard(model, ignored_params={kept})
    model(torch.randn(4, 12) * (1 + dist.get_rank())).sum().backward()
    return {"same_object": model.head.weight is kept, "shape": tuple(kept.shape),
            "grad": kept.grad.clone(), "bias_sharded": isinstance(model.head.bias, shard.DTensor)}


def test_ignored_params_are_neither_sharded_nor_reduced(ranks):
    facts = ranks(2).run(_ignored_facts)
    assert all(f["same_object"] and f["shape"] == (5, 2) and f["bias_sharded"] for f in facts)
    assert not torch.equal(facts[0]["grad"], facts[1]["grad"])  # each rank's own gradient


# ----- the benchmark, smoke-tested -----

@pytest.mark.slow
@needs_torch_fsdp2
def test_the_benchmark_runs_checks_bits_and_saves_its_results(tmp_path, monkeypatch):
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    monkeypatch.delitem(sys.modules, "fsdp", raising=False)
    import fsdp as benchmark

    result = benchmark.main(["--quick", "--device", "cpu", "--world-size", "3", "--pairs", "2",
                             "--out", str(tmp_path)])
    saved = (tmp_path / "fsdp-cpu-gloo-ws3.json").read_text()
    assert '"bit_identical": true' in saved
    run = result["runs"][0]
    assert run["world_size"] == 3 and len(run["step"]["miniddp"]["times_ms"]) == 2
    assert run["step"]["miniddp"]["ratio"] > 0
    # ZeRO-3 at 3 ranks: a rank holds about a third of the unsharded parameters and gradients
    whole = 2 * run["model"]["gradient_mb"]
    assert len(run["memory_mib_per_rank"]["miniddp"]) == 3
    assert max(run["memory_mib_per_rank"]["miniddp"]) < whole / 2
    assert run["memory_mib_per_rank"]["miniddp"] == run["memory_mib_per_rank"]["torch"]
    # HSDP on 2 x 2: bits checked, torch's timed twice (the A/A control), FSDP over 4 beside it
    hsdp = benchmark.main(["--hsdp", "--quick", "--device", "cpu", "--pairs", "2", "--out",
                           str(tmp_path)])["runs"][0]
    assert '"bit_identical": true' in (tmp_path / "fsdp-hsdp-cpu-gloo-ws4.json").read_text()
    assert hsdp["mesh"] == [2, 2] and hsdp["step"]["torch HSDP again"]["ratio"] > 0
    memory = hsdp["memory_mib_per_rank"]
    assert memory["miniddp HSDP"] == memory["torch HSDP"]
    assert memory["miniddp FSDP"] == memory["torch FSDP"]
    assert min(memory["torch HSDP"]) > max(memory["torch FSDP"])  # 1/2 of the state, not 1/4


def _gathers_per_step(checkpointed: bool) -> int:
    counted = {"calls": 0}
    right = collectives.all_gather_flat

    def counting(output, input, group=None):
        counted["calls"] += 1
        return right(output, input, group)

    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        block.checkpointed = checkpointed
    shard_model(model, miniddp.fully_shard, miniddp.MixedPrecisionPolicy(), Case())
    model(torch.randn(4, 12)).sum().backward()  # the first step picks the root
    collectives.all_gather_flat = counting
    try:
        model(torch.randn(4, 12)).sum().backward()
    finally:
        collectives.all_gather_flat = right
    return counted["calls"]


def test_a_unit_recomputed_in_backward_is_gathered_once_for_it(ranks):
    """ZeRO-3: each block gathered for forward and again for backward, the root once; activation
    checkpointing's re-forward in backward finds the block gathered and keeps it so."""
    assert ranks(2).run(_gathers_per_step, False) == [7, 7]
    assert ranks(2).run(_gathers_per_step, True) == [7, 7]
