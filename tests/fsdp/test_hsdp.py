"""HSDP: miniddp.fully_shard on a 2-D mesh beside torch's FSDP2 on the same mesh, bit for bit.

``init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))``: each
rank holds its shard of its replica group's parameters; gathers run within the shard group; a
gradient is reduce-scattered within the shard group, then all-reduced across the replicate
group. Each case trains test_fsdp's model under both and compares every rank's gradient shards
after every backward and parameter shards after every step (``test_fsdp.beside_torch``), at 4
ranks (2 x 2) in the fast tier, at 6 (2 x 3 and 3 x 2) in the slow one.

Negative controls: each detail that decides the bits, broken on purpose, must differ from
torch's; each was found by measurement (docs/fsdp.md says where each shows first).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from test_fsdp import (
    Case,
    beside_torch,
    check_all_differ,
    check_identical,
    needs_torch_fsdp2,
)

import miniddp.fsdp.collectives  # noqa: F401  (so the breakages patch it at once)

HSDP_2x2 = Case(mesh=(2, 2), steps=2)
PRECISIONS = [{}, {"param_dtype": "fp16"}, {"param_dtype": "fp16", "reduce_dtype": "fp32"},
              {"param_dtype": "bf16"}, {"param_dtype": "bf16", "reduce_dtype": "fp32"}]


def precisions(mesh: tuple[int, int], optimizers=("sgd", "adam")) -> list[Case]:
    """fp32, bf16 and fp16, each with and without an fp32 reduce dtype (fp32 has none), with
    each of ``optimizers``."""
    return [Case(mesh=mesh, steps=2, optimizer=opt, **p) for p in PRECISIONS for opt in optimizers]


def paths(mesh: tuple[int, int]) -> list[Case]:
    """Accumulation both ways and HSDP's own (the reduce-scatter every micro-batch, the
    all-reduce across the replicas at the last only), ZeRO-2, clipping, a tied embedding, and
    miniddp's own HybridMesh in place of torch's DeviceMesh."""
    base = Case(mesh=mesh, steps=2)
    return [replace(base, micro_batches=2, hybrid_mesh=True),
            replace(base, micro_batches=2, sync_micro_batches=True, optimizer="adam"),
            replace(base, micro_batches=3, skip_all_reduce=True),
            replace(base, micro_batches=2, skip_all_reduce=True, param_dtype="bf16",
                    reduce_dtype="fp32", optimizer="adam"),
            replace(base, micro_batches=3, skip_all_reduce=True, param_dtype="fp16",
                    hybrid_mesh=True),
            replace(base, reshard_after_forward=False, param_dtype="bf16"),
            replace(base, clip=0.05, optimizer="adam"),
            replace(base, model="tokens", optimizer="adam", hybrid_mesh=True)]


#: The fast tier's share of the 2 x 2 cases; the slow tier runs the rest
FAST_2x2 = [Case(mesh=(2, 2), steps=2), *paths((2, 2))[:5]]


def cases_2x2_slow() -> list[Case]:
    return [c for c in precisions((2, 2)) + paths((2, 2))[5:] if c not in FAST_2x2]


@needs_torch_fsdp2
def test_hsdp_2x2_bit_identical_to_torch(ranks):
    check_identical(ranks(4).run(beside_torch, FAST_2x2, timeout=240), FAST_2x2)


@needs_torch_fsdp2
@pytest.mark.slow
def test_hsdp_2x2_every_precision_and_optimizer_bit_identical_to_torch(ranks):
    cases = cases_2x2_slow()
    check_identical(ranks(4).run(beside_torch, cases, timeout=240), cases)


# ----- the details that decide the bits, broken one at a time (negative controls) -----

def beside_torch_broken(named_cases: list[tuple[str, Case]]) -> list[list[str]]:
    """On every rank: each case's differences from torch's, with miniddp broken by the named
    breakage of ``tests/support/breakage`` (``sharding.HSDP``; lesson 18's tests apply the same)."""
    return [beside_torch([replace(case, breakage=f"hsdp_{name}")])[0]
            for name, case in named_cases]


#: One step each: each differs from torch's at the first step
NEGATIVE_2x2 = [(name, replace(HSDP_2x2, steps=1, **change)) for name, change in [
    ("replicas_first", {}), ("fp16_post_before_all_reduce", {"param_dtype": "fp16"}),
    ("no_all_reduce", {}),
    ("all_reduce_each_micro_batch", {"micro_batches": 3, "skip_all_reduce": True})]]
#: One step each: each differs from torch's at the first backward
NEGATIVE_6 = [(name, replace(case, steps=1)) for name, case in [
    ("one_division", Case(mesh=(2, 3))),
    ("fp16_factors_of_the_shard_group", Case(mesh=(2, 3), param_dtype="fp16")),
    ("fp16_factors_of_the_shard_group", Case(mesh=(3, 2), param_dtype="fp16")),
    ("fp16_post_before_all_reduce", Case(mesh=(2, 3), param_dtype="fp16")),
    ("fp16_post_before_all_reduce", Case(mesh=(3, 2), param_dtype="fp16"))]]


@needs_torch_fsdp2
def test_each_hsdp_bit_deciding_detail_broken_differs_from_torch_at_2x2(ranks):
    results = ranks(4).run(beside_torch_broken, NEGATIVE_2x2, timeout=240)
    check_all_differ(results, [f"{name}: {case}" for name, case in NEGATIVE_2x2])


# ----- 6 ranks: the cases and their negative controls in one run of the pool -----

def six_rank_cases(mesh: tuple[int, int], optimizer: str) -> list[Case]:
    """Every precision with ``optimizer``, and the paths of accumulation (both ways, and HSDP's
    without all-reduce), one step each: what 6 ranks add to 2 x 2 is the arithmetic of the
    reductions (S or R not a power of two), which shows at the first backward; the second step
    (the gather of stepped parameters, the optimizer's state) is 2 x 2's to check."""
    return [replace(c, steps=1) for c in precisions(mesh, (optimizer,)) + paths(mesh)[1:5]]


#: SGD on 2 x 3, Adam on 3 x 2
SIX_RANKS = six_rank_cases((2, 3), "sgd") + six_rank_cases((3, 2), "adam")


def beside_torch_whole_and_broken(cases: list[Case], named_cases: list[tuple[str, Case]]):
    """On every rank: :func:`beside_torch` of ``cases``, and :func:`beside_torch_broken` of
    ``named_cases``, in one run of the pool."""
    return beside_torch(cases), beside_torch_broken(named_cases)


@needs_torch_fsdp2
@pytest.mark.slow
def test_hsdp_at_6_ranks_bit_identical_to_torch_and_its_factors_broken_differ(ranks):
    results = ranks(6).run(beside_torch_whole_and_broken, SIX_RANKS, NEGATIVE_6, timeout=300)
    check_identical([identical for identical, _ in results], SIX_RANKS)
    check_all_differ([broken for _, broken in results],
                     [f"{name}: {case}" for name, case in NEGATIVE_6])


# ----- checkpoints: a full state dict saved at one mesh shape loads at another -----

def _model_at(mesh: tuple[int, int] | None, impl: str, seed: int):
    from test_fsdp import Net, TorchPolicy, meshes, shard_model, torch_fully_shard

    import miniddp

    torch.manual_seed(seed)
    case = Case(mesh=mesh)
    ours, theirs = meshes(case)
    if impl == "torch":
        return shard_model(Net(), torch_fully_shard, TorchPolicy(), case, mesh=theirs)
    return shard_model(Net(), miniddp.fully_shard, miniddp.MixedPrecisionPolicy(), case,
                       **({} if ours is None else {"mesh": ours}))


def _step_beside(models: dict, step: int) -> list[str]:
    """One SGD step of each model on this rank's batch; what differs from torch's."""
    from test_fsdp import count_differences

    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x = torch.randn(8, 12, generator=gen)
    for model in models.values():
        model(x).pow(2).mean().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    problems: list[str] = []
    count_differences(f"step {step} param", list(models["miniddp"].named_parameters()),
                      list(models["torch"].named_parameters()), problems)
    return problems


def checkpoint_across_meshes(saved_at: tuple[int, int], loaded_at: list) -> list[str]:
    """Trained a step at ``saved_at`` under both, miniddp's full state dict saved (it must be
    torch's, gathered), loaded at each mesh of ``loaded_at`` into a fresh model of each (torch's
    through its own ``set_model_state_dict``), then a step more beside torch's there."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    import miniddp

    models = {impl: _model_at(saved_at, impl, 0) for impl in ("miniddp", "torch")}
    problems = _step_beside(models, 0)
    saved = miniddp.fsdp.full_state_dict(models["miniddp"])
    torchs = {k: v.full_tensor() for k, v in models["torch"].state_dict().items()}
    problems += [f"saved {k} differs from torch's" for k in torchs
                 if not torch.equal(saved[k], torchs[k])]
    for mesh in loaded_at:
        fresh = {impl: _model_at(mesh, impl, 1) for impl in ("miniddp", "torch")}
        miniddp.fsdp.load_full_state_dict(fresh["miniddp"], saved)
        set_model_state_dict(fresh["torch"], dict(saved), options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        problems += [f"loaded at {mesh}: {p}" for p in _step_beside(fresh, 1)]
    return problems


@needs_torch_fsdp2
def test_a_full_state_dict_saved_at_2x2_loads_at_other_meshes(ranks):
    for rank, problems in enumerate(ranks(4).run(checkpoint_across_meshes, (2, 2),
                                                 [None, (4, 1), (1, 4)])):
        assert not problems, (rank, problems[:4])


# ----- reshard_after_forward as an int -----

def _int_reshard() -> dict:
    import warnings

    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    import miniddp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    found = {}
    try:
        miniddp.fully_shard(nn.Linear(4, 4), reshard_after_forward=2)  # 2 of 4 ranks
    except NotImplementedError as error:
        found["smaller_group"] = str(error)
    whole = miniddp.fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=2)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        one = miniddp.fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=1)
    found["whole_shard_group"] = whole._fsdp_state.group.reshard_after_forward
    found["one"] = (one._fsdp_state.group.reshard_after_forward, [str(w.message) for w in warned])
    return found


def test_reshard_after_forward_as_an_int_is_read_as_torch_reads_it_or_refused(ranks):
    for found in ranks(4).run(_int_reshard):
        assert "Use True" in found["smaller_group"] and "or False" in found["smaller_group"]
        assert found["whole_shard_group"] is True  # the shard group's size: True
        kept, warned = found["one"]
        assert kept is False and any("as with reshard_after_forward=False" in w for w in warned)
