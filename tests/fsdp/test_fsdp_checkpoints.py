"""A miniddp-sharded model in the code around it, beside torch's ``fully_shard`` as the oracle:
what its parameters look like to code written for FSDP2, ``torch.distributed.checkpoint`` round
trips (at the same world size, resharded to 1 and 3 ranks, from a 2x2 HSDP mesh to a 1-D one;
``model.state_dict()`` and ``get_state_dict``; full state dicts), and meta-device init.

A round trip is right when every saved element comes back and the resumed step is bit for bit
the uninterrupted run's (at the same world size) or torch's resumed step (resharded). The
negative control is the bug this replaced: shards saved as plain tensors, which DCP takes for
replicated, so that every rank gets rank 0's rows back.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from test_fsdp import Net, device_mesh, needs_torch_fsdp2, torch_fully_shard
from torch import nn

import miniddp

pytestmark = needs_torch_fsdp2

EVEN, UNEVEN = "even", "uneven"


class EvenNet(nn.Module):
    """Every dim 0 a multiple of 12: no rank's shard is padded at 1, 2, 3 or 4 ranks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(12, 24), nn.Linear(24, 12)])
        self.head = nn.Linear(12, 12)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def build(impl: str, shape: str, mesh: tuple[int, int] | None, seed: int = 0,
          meta: bool = False):
    """The model (``Net``: 31, 17 and 2 rows, uneven from 2 ranks on; or :class:`EvenNet`)
    under ``impl``'s ``fully_shard``, each block then the root, on a 1-D mesh of every rank or a
    2-D (replicas, shards) one; and its AdamW."""
    torch.manual_seed(seed)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = Net() if shape == UNEVEN else EvenNet()
    fully_shard = torch_fully_shard if impl == "torch" else miniddp.fully_shard
    on = {"mesh": device_mesh("cpu", mesh)} if mesh else {}
    for block in model.blocks:
        fully_shard(block, **on)
    fully_shard(model, **on)
    return model, lambda: torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def step(model, optimizer, index: int) -> None:
    gen = torch.Generator().manual_seed(100 * index + dist.get_rank())
    model(torch.randn(4, 12, generator=gen)).pow(2).mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    optimizer.zero_grad()


def local_rows(model) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def full_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every element of the model and its optimizer's state, gathered (a collective), copied
    (at 1 rank the gathered tensor is the parameter itself)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    found = {f"model.{k}": v for k, v in msd.items()}
    for name, state in osd["state"].items():
        found.update({f"optim.{name}.{k}": v for k, v in state.items()})
    return {k: v.clone() for k, v in found.items()}


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """What a rank holds of ``tensor``: its local rows if it is a DTensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def differences(where: str, ours, theirs) -> list[str]:
    if isinstance(ours, dict):
        if ours.keys() != theirs.keys():
            return [f"{where}: keys {sorted(ours)[:3]}... beside {sorted(theirs)[:3]}..."]
        ours, theirs = list(ours.items()), list(theirs.items())
    else:
        ours, theirs = list(enumerate(ours)), list(enumerate(theirs))
    found = []
    for (name, a), (_, b) in zip(ours, theirs):
        if a.shape != b.shape or not torch.equal(a, b):
            wrong = "shape" if a.shape != b.shape else f"{int((a != b).sum())} elements"
            found.append(f"{where} {name}: {wrong} of {b.numel()} differ")
    return found


# ----- a sharded parameter is torch's -----

def _looks() -> dict:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.tensor import DTensor, Replicate

    found = {}
    for mesh in (None, (2, 2)) if dist.get_world_size() == 4 else (None,):
        for impl in ("torch", "miniddp"):
            model, make_optimizer = build(impl, UNEVEN, mesh)
            optimizer = make_optimizer()
            step(model, optimizer, 0)
            model(torch.randn(2, 12)).sum().backward()
            p, sd = model.blocks[0].lin.weight, model.state_dict()
            state = optimizer.state[p]
            found[(mesh, impl)] = {
                "DTensor": [isinstance(q, DTensor) for q in model.parameters()],
                "Parameter": [isinstance(q, nn.Parameter) for q in model.parameters()],
                "shape": [tuple(q.shape) for q in model.parameters()],
                "numel": sum(q.numel() for q in model.parameters()),
                "local": [tuple(q.to_local().shape) for q in model.parameters()],
                "placements": [q.placements for q in model.parameters()],
                "mesh": [(q.device_mesh.shape, q.device_mesh.get_coordinate())
                         for q in model.parameters()],
                "grad": [(type(q.grad).__name__, tuple(q.grad.shape), q.grad.placements)
                         for q in model.parameters()],
                "state_dict": {k: (type(v).__name__, tuple(v.shape)) for k, v in sd.items()},
                "optimizer": {k: (type(v).__name__, tuple(v.shape)) for k, v in state.items()},
                "full_tensor": p.full_tensor(),
                "redistribute": p.redistribute(p.device_mesh, [Replicate()] * p.device_mesh.ndim
                                               ).to_local(),
                "is_FSDPModule": [isinstance(m, TorchFSDPModule) for m in model.modules()],
            }
    return found


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_sharded_parameter_its_gradient_and_state_are_torchs_dtensors(ranks, world_size):
    """At 4 ranks, also on a 2x2 HSDP mesh: ``(Replicate(), Shard(0))``."""
    for rank, found in enumerate(ranks(world_size).run(_looks, timeout=120)):
        for mesh in {m for m, _ in found}:
            ours, theirs = found[(mesh, "miniddp")], found[(mesh, "torch")]
            differ = [what for what in theirs
                      if not (torch.equal(ours[what], theirs[what])
                              if isinstance(theirs[what], torch.Tensor)
                              else ours[what] == theirs[what])]
            assert differ == [], (rank, mesh, {what: ours[what] for what in differ})
            assert all(ours["DTensor"]) and ours["numel"] == sum(
                p.numel() for p in Net().parameters())


# ----- torch.distributed.checkpoint round trips -----

def _save(path: str, shape: str, mesh, how: str, leak_local: bool = False) -> dict:
    """Train two steps under each ``fully_shard``, save with DCP (``how``: "state_dict",
    ``model.state_dict()`` only, or "get_state_dict", model and optimizer), then a third step:
    what was saved, gathered, and the third step's rows."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    found = {}
    for impl in ("torch", "miniddp"):
        model, make_optimizer = build(impl, shape, mesh)
        optimizer = make_optimizer()
        for index in range(2):
            step(model, optimizer, index)
        if how == "state_dict":
            state = model.state_dict()
        else:
            msd, osd = get_state_dict(model, optimizer)
            state = {"model": msd, "optim": osd}
        if leak_local and impl == "miniddp":  # the bug: each rank's rows as a plain tensor
            state = {k: v.to_local() for k, v in state.items()}
        dcp.save(state, checkpoint_id=f"{path}/{impl}")
        found[impl] = {"saved": full_state(model, optimizer)}
        step(model, optimizer, 2)
        found[impl]["third"] = local_rows(model)
    return found


def _load(path: str, shape: str, mesh, how: str, leak_local: bool = False) -> dict:
    """A fresh model of each (another seed), loaded from its checkpoint, then its third step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    found = {}
    for impl in ("torch", "miniddp"):
        model, make_optimizer = build(impl, shape, mesh, seed=7)
        optimizer = make_optimizer()
        if leak_local and impl == "miniddp":  # read into each rank's rows, as they were saved
            dcp.load({k: v.to_local() for k, v in model.state_dict().items()},
                     checkpoint_id=f"{path}/{impl}")
        elif how == "state_dict":
            state = model.state_dict()
            dcp.load(state, checkpoint_id=f"{path}/{impl}")
            model.load_state_dict(state)
        else:
            msd, osd = get_state_dict(model, optimizer)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=f"{path}/{impl}")
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        restored = full_state(model, optimizer)
        if how == "state_dict":  # the optimizer starts afresh: compare the model alone
            restored = {k: v for k, v in restored.items() if k.startswith("model.")}
        step(model, optimizer, 2)
        found[impl] = {"restored": restored, "third": local_rows(model)}
    return found


def round_trip(ranks, tmp_path, saved_at, loaded_at, shape=UNEVEN, how="get_state_dict",
               leak_local: bool = False) -> list[str]:
    """``saved_at`` and ``loaded_at``: (world size, mesh or None). What differs: restored
    elements (against what was saved), the resumed step (against the uninterrupted run at the
    same layout, and against torch's resumed step)."""
    saved = ranks(saved_at[0]).run(_save, str(tmp_path), shape, saved_at[1], how, leak_local,
                                   timeout=120)
    loaded = ranks(loaded_at[0]).run(_load, str(tmp_path), shape, loaded_at[1], how,
                                     leak_local, timeout=120)
    problems = []
    for rank, found in enumerate(loaded):
        for impl in ("torch", "miniddp"):
            kept = found[impl]["restored"]
            problems += differences(f"rank {rank} {impl} restored", kept,
                                    {k: v for k, v in saved[0][impl]["saved"].items()
                                     if k in kept})
        if saved_at == loaded_at and how == "get_state_dict":  # (else Adam starts afresh)
            problems += differences(f"rank {rank} resumed beside uninterrupted",
                                    found["miniddp"]["third"], saved[rank]["miniddp"]["third"])
        problems += differences(f"rank {rank} resumed beside torch's resumed",
                                found["miniddp"]["third"], found["torch"]["third"])
    return problems


@pytest.mark.parametrize("how", ["state_dict", "get_state_dict"])
@pytest.mark.parametrize("shape", [EVEN, UNEVEN])
@pytest.mark.parametrize("world_size", [2, 3])
def test_dcp_round_trip_at_the_same_world_size(ranks, tmp_path, world_size, shape, how):
    assert round_trip(ranks, tmp_path, (world_size, None), (world_size, None), shape, how) == []


@pytest.mark.parametrize("loaded_at", [1, 3])
def test_dcp_saved_at_2_ranks_loads_resharded(ranks, tmp_path, loaded_at):
    assert round_trip(ranks, tmp_path, (2, None), (loaded_at, None)) == []


def test_dcp_saved_on_a_2x2_hsdp_mesh_loads_on_2_ranks_of_a_1d_mesh(ranks, tmp_path):
    assert round_trip(ranks, tmp_path, (4, (2, 2)), (2, None)) == []


def test_shards_saved_as_plain_tensors_come_back_wrong_and_the_check_sees_it(ranks, tmp_path):
    """The negative control: every rank's rows saved under one name as if replicated, so every
    rank reads rank 0's rows back (EVEN: the shapes agree, so nothing raises)."""
    problems = round_trip(ranks, tmp_path, (2, None), (2, None), EVEN, "state_dict",
                          leak_local=True)
    assert any("miniddp restored" in p for p in problems), problems


def _full_state_dicts() -> dict:
    """``full_state_dict=True, cpu_offload=True``: the whole model and optimizer state on rank 0
    (torchtune's and HF's way), loaded with ``broadcast_from_rank0`` into a fresh model."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
    )

    save = StateDictOptions(full_state_dict=True, cpu_offload=True)
    load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    found = {}
    for impl in ("torch", "miniddp"):
        model, make_optimizer = build(impl, UNEVEN, None)
        optimizer = make_optimizer()
        step(model, optimizer, 0)
        msd = get_model_state_dict(model, options=save)
        osd = get_optimizer_state_dict(model, optimizer, options=save)
        optim = [v for s in osd.get("state", {}).values() for v in s.values()]
        found[impl] = {"model": {k: plain(v) for k, v in msd.items()},
                       "types": [sorted({type(v).__name__ for v in vs}) for vs in (msd.values(),
                                                                                   optim)],
                       "optim": [plain(v) for v in optim]}
        fresh, _ = build(impl, UNEVEN, None, seed=7)
        set_model_state_dict(fresh, msd if dist.get_rank() == 0 else {}, options=load)
        found[impl].update({
            "loaded": local_rows(fresh), "trained": local_rows(model)})
    return found


def test_a_full_state_dict_is_the_whole_model_on_rank_0_and_loads_from_it(ranks):
    for rank, found in enumerate(ranks(3).run(_full_state_dicts, timeout=120)):
        ours, theirs = found["miniddp"], found["torch"]
        assert differences("model", ours["model"], theirs["model"]) == []
        assert differences("optimizer", ours["optim"], theirs["optim"]) == []
        assert ours["types"] == theirs["types"]
        assert differences("loaded", ours["loaded"], ours["trained"]) == []
        if rank == 0:
            assert ours["types"][0] == ["Tensor"]  # the model: whole tensors
            assert {k: tuple(v.shape) for k, v in ours["model"].items()} == {
                k: tuple(v.shape) for k, v in Net().state_dict().items()}


def _other_models_checkpoint(path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    model, _ = build("miniddp", UNEVEN, None)
    dcp.save(model.state_dict(), checkpoint_id=path)
    other, _ = build("miniddp", EVEN, None)
    state = {"blocks.0.lin.weight": other.state_dict()["blocks.0.weight"]}  # [24, 12]
    found = {}
    for what, load in (("dcp", lambda: dcp.load(state, checkpoint_id=path)),
                       ("full", lambda: miniddp.fsdp.load_full_state_dict(
                           other, {"blocks.0.weight": torch.zeros(31, 12)}, strict=False)),
                       ("plain", lambda: other.load_state_dict(
                           {"blocks.0.weight": torch.zeros(24, 12)}, strict=False))):
        try:
            load()
            found[what] = "loaded"
        except BaseException as error:  # (DCP's CheckpointException is a BaseException)
            found[what] = str(error)
    return found


def test_another_models_checkpoint_is_refused_naming_the_parameter_and_both_shapes(
        ranks, tmp_path):
    for found in ranks(2).run(_other_models_checkpoint, str(tmp_path)):
        assert "blocks.0.lin.weight" in found["dcp"] and "[31, 12]" in found["dcp"] \
            and "[24, 12]" in found["dcp"], found["dcp"]
        assert "'blocks.0.weight'" in found["full"] and "[31, 12]" in found["full"] \
            and "another model" in found["full"], found["full"]
        assert "load_full_state_dict" in found["plain"], found["plain"]


# ----- meta-device init -----

def init_weights(model) -> None:
    """torchtitan's way: every weight from a truncated normal, every bias zero."""
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("bias"):
                p.zero_()
            else:
                nn.init.trunc_normal_(p, std=0.02, a=-0.04, b=0.04)


def _meta_init(how: str, mesh=None) -> dict:
    found = {}
    for impl in ("torch", "miniddp"):
        model, make_optimizer = build(impl, UNEVEN, mesh, meta=True)
        model.to_empty(device="cpu")
        torch.manual_seed(3)
        if how == "reset_parameters":
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        else:
            init_weights(model)
        found[impl] = {"init": local_rows(model),
                       "materialized": all(not p.is_meta for p in model.parameters())}
        optimizer = make_optimizer()
        for index in range(2):
            step(model, optimizer, index)
        found[impl]["trained"] = local_rows(model)
    return found


@pytest.mark.parametrize("how", ["reset_parameters", "init_weights"])
@pytest.mark.parametrize("world_size, mesh", [(2, None), (3, None), (4, (2, 2))])
def test_meta_device_init_then_to_empty_equals_torchs_at_init_and_after_steps(
        ranks, world_size, mesh, how):
    for found in ranks(world_size).run(_meta_init, how, mesh, timeout=120):
        assert found["miniddp"]["materialized"]
        for when in ("init", "trained"):
            assert differences(when, found["miniddp"][when], found["torch"][when]) == []
        assert not all(math.isclose(float(t.abs().sum()), 0.0)
                       for t in found["miniddp"]["init"])


def _meta_init_without_repadding() -> str:
    """The materialized shards left where ``to_empty`` put them, not padded into the buffers
    the unit gathers from (``FSDPParam.reset_sharded`` made a no-op)."""
    from miniddp.fsdp import param

    kept = param.FSDPParam.reset_sharded
    param.FSDPParam.reset_sharded = lambda self: None
    try:
        found = _meta_init("init_weights")
        return "; ".join(differences("trained", found["miniddp"]["trained"],
                                     found["torch"]["trained"])) or "no difference"
    except Exception as error:  # the test reads what happened
        return f"{type(error).__name__}: {error}"
    finally:
        param.FSDPParam.reset_sharded = kept


def test_meta_device_init_without_repadding_the_shards_is_caught(ranks):
    for found in ranks(2).run(_meta_init_without_repadding, timeout=120):
        assert found != "no difference", found

