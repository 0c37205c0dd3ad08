"""What miniddp.fully_shard does not support says so, and what to do instead."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import miniddp


def test_without_a_process_group_fully_shard_says_to_create_one():
    with pytest.raises(RuntimeError, match="init_process_group"):
        miniddp.fully_shard(nn.Linear(2, 2))


def _message(fn) -> str:
    try:
        fn()
    except Exception as error:  # the test checks the type and words
        return f"{type(error).__name__}: {error}"
    return "no error"


class _Mesh3D:
    ndim = 3


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2).double()


def _errors() -> dict[str, str]:
    import torch.distributed.fsdp as torch_fsdp

    offload = getattr(torch_fsdp, "CPUOffloadPolicy", None)
    sharded = miniddp.fully_shard(nn.Linear(4, 3))
    scalar = nn.Module()
    scalar.s = nn.Parameter(torch.tensor(1.0))
    return {
        "mesh": _message(lambda: miniddp.fully_shard(nn.Linear(2, 2), mesh=object())),
        "offload": _message(lambda: miniddp.fully_shard(
            nn.Linear(2, 2), offload_policy=offload() if offload else object())),
        "int_reshard": _message(lambda: miniddp.fully_shard(nn.Linear(2, 2),
                                                            reshard_after_forward=3)),
        "hybrid_mesh_too_big": _message(lambda: miniddp.fsdp.HybridMesh(replicas=3, shards=1)),
        "mesh_3d": _message(lambda: miniddp.fully_shard(nn.Linear(2, 2), mesh=_Mesh3D())),
        "twice": _message(lambda: miniddp.fully_shard(sharded)),
        "list": _message(lambda: miniddp.fully_shard([nn.Linear(2, 2)])),
        "scalar": _message(lambda: miniddp.fully_shard(scalar)),
        "mixed_dtypes": _message(lambda: miniddp.fully_shard(Mixed())),
        "deepcopy_module": _message(lambda: copy.deepcopy(sharded)),
        "move": _message(lambda: sharded.to(torch.float64)),
        "move_nowhere": _message(lambda: sharded.to("cpu")),
        "wrong_checkpoint": _message(lambda: miniddp.fsdp.load_full_state_dict(
            sharded, {"weight": torch.zeros(5, 4), "bias": torch.zeros(3)})),
    }


EXPECTED = {
    "mesh": ("NotImplementedError", "miniddp.fsdp.HybridMesh(replicas, shards)"),
    "mesh_3d": ("NotImplementedError", "a 2-D one, replicate dim first"),
    "hybrid_mesh_too_big": ("ValueError", "replicas x shards must be the world size"),
    "offload": ("NotImplementedError", "offload_policy=None"),
    "int_reshard": ("ValueError", "a factor of the shard group's 2 ranks"),
    "twice": ("ValueError", "apply it once"),
    "list": ("NotImplementedError", "one nn.Module"),
    "scalar": ("ValueError", "'s' is a 0-d scalar"),  # torch's type
    "mixed_dtypes": ("NotImplementedError", "must share a dtype"),
    "deepcopy_module": ("NotImplementedError", "Deep-copy the model before fully_shard"),
    "move": ("NotImplementedError", "cast the model before fully_shard"),
    "wrong_checkpoint": ("ValueError", "'weight': the state dict holds shape [5, 4]"),
}


def _whole_world_mesh_is_accepted() -> str:
    try:
        from torch.distributed.device_mesh import init_device_mesh
    except ImportError:
        return "skip"
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    return type(miniddp.fully_shard(nn.Linear(4, 3), mesh=mesh)).__name__


def test_a_1d_mesh_of_every_rank_is_the_default_group(ranks):
    names = ranks(2).run(_whole_world_mesh_is_accepted)
    if names[0] == "skip":
        pytest.skip("this torch has no torch.distributed.device_mesh.init_device_mesh")
    assert names == ["FSDPLinear", "FSDPLinear"]


def test_what_is_not_supported_is_named_with_what_to_do(ranks):
    for messages in ranks(2).run(_errors):
        for case, (kind, words) in EXPECTED.items():
            assert messages[case].startswith(kind) and words in messages[case], (case,
                                                                                messages[case])
        assert messages["move_nowhere"] == "no error"  # .to() where it already is changes nothing


# ----- what torch's FSDP2 refuses, refused the same way -----

def _first_line(error: str | None) -> str:
    return "trained" if error is None else error.splitlines()[0]


def _refusals() -> dict[str, dict[str, str]]:
    """Each configuration torch refuses, run under both ``fully_shard``s: the first line of
    each one's error, per implementation."""
    from test_fsdp_models import ModelSpec, Run, train

    torch.set_num_threads(1)
    runs = {
        "tied_across_units": Run(ModelSpec(vocab=5, n_out=5, tied=True, stem_unit=True)),
        "clip_sharded_with_plain": Run(ModelSpec(root_wrapped=False), clip=(1.0, 2.0, None)),
        "clip_sharded_with_plain_one_by_one": Run(ModelSpec(root_wrapped=False),
                                                  clip=(1.0, 2.0, False)),
    }
    found = {name: {impl: _first_line(train(impl, run)[1]) for impl in ("torch", "miniddp")}
             for name, run in runs.items()}
    found["inner_unit_first"] = {impl: _inner_unit_first(impl) for impl in ("torch", "miniddp")}
    return found


def _inner_unit_first(impl: str) -> str:
    """A block's forward before the model's: torch requires the root's first."""
    from test_fsdp_models import ModelSpec, Run, build, shard

    run = Run(ModelSpec())
    model = shard(build(run.model, 0), impl, run)
    return _message(lambda: (model.blocks[0](torch.randn(2, 4)), model(torch.randn(2, 4))))


REFUSED = {
    "tied_across_units": ("ValueError", "a tied parameter must belong to one unit"),
    # the sharded gradients are DTensors: torch's own refusal, word for word
    "clip_sharded_with_plain": ("RuntimeError", "got mixed torch.Tensor and DTensor"),
    "clip_sharded_with_plain_one_by_one": ("RuntimeError", "got mixed torch.Tensor and DTensor"),
    "inner_unit_first": ("RuntimeError", "run the first forward through the outermost module"),
}


@pytest.mark.parametrize("world_size", [2, 3])
def test_what_torch_refuses_is_refused_on_every_rank_saying_why(ranks, world_size):
    for rank, found in enumerate(ranks(world_size).run(_refusals, timeout=120)):
        for case, (kind, words) in REFUSED.items():
            ours, theirs = found[case]["miniddp"], found[case]["torch"]
            assert theirs != "trained" and theirs != "no error", (rank, case, theirs)
            assert ours.startswith(kind) and words in ours, (rank, case, ours)
