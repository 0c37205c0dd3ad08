"""miniddp.train.checkpoint: a snapshot restores it all, loads anywhere (at another world size too),
survives a crash mid-write, and a damaged one is named with what is left to resume from."""

import os
import random
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from miniddp import DistributedDataParallel, DistributedSampler
from miniddp.train import checkpoint
from miniddp.train.checkpoint import CheckpointMismatchError
from miniddp.train.data import make_dataset, make_model


def trained_model_and_optimizer(seed=0):
    """A model and an Adam that have taken two steps, so the optimizer has state to lose."""
    model = make_model(seed=seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        optimizer.step()
    return model, optimizer


def same_tensors(a: dict, b: dict) -> bool:
    """Same keys and values, wherever each tensor lives: on a machine with a GPU,
    ``nn.DataParallel`` moves its module to the first GPU (torch.equal refuses two devices)."""
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def draws():
    """One number from each generator a snapshot restores."""
    return torch.rand(3), random.random(), float(np.random.rand())


def test_round_trip_restores_model_optimizer_sampler_counters_and_rng(tmp_path):
    model, optimizer = trained_model_and_optimizer()
    dataset = make_dataset(64)
    sampler = DistributedSampler(dataset, num_replicas=2, rank=1, seed=3)
    sampler.set_epoch(4)
    it = iter(sampler)
    for _ in range(10):
        next(it)
    rest = list(it)
    torch.manual_seed(11), random.seed(11), np.random.seed(11)

    path = tmp_path / "snap.pt"
    checkpoint.save(path, model, optimizer, sampler, epoch=4, step=123, trained=10,
                    extra={"note": "hi"})
    expected = draws()
    draws()  # move every generator on

    model2 = make_model(seed=1)
    optimizer2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    sampler2 = DistributedSampler(dataset, num_replicas=2, rank=1, seed=3)
    snap = checkpoint.load(path, model2, optimizer2, sampler2)

    assert (snap["epoch"], snap["step"], snap["extra"]) == (4, 123, {"note": "hi"})
    assert same_tensors(model2.state_dict(), model.state_dict())
    state, state2 = optimizer.state_dict()["state"], optimizer2.state_dict()["state"]
    assert state.keys() == state2.keys()
    assert all(same_tensors(state[i], state2[i]) for i in state)
    sampler2.set_epoch(4)
    assert list(sampler2) == rest, "the sampler must go on where it stopped in the epoch"
    got = draws()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_snapshot_loads_with_weights_only_and_stores_plain_values(tmp_path):
    model, optimizer = trained_model_and_optimizer()
    checkpoint.save(tmp_path / "snap.pt", model, optimizer, epoch=1, step=2)
    snap = torch.load(tmp_path / "snap.pt", weights_only=True)
    assert snap["format"] == checkpoint.FORMAT
    assert same_tensors(snap["model"], model.state_dict())
    name, keys, *_ = snap["rng"][0]["numpy"]  # NumPy's state as plain ints, not an ndarray
    assert name == "MT19937" and isinstance(keys, list) and len(keys) == 624


def test_load_maps_tensors_to_the_given_device(tmp_path):
    model, optimizer = trained_model_and_optimizer()
    checkpoint.save(tmp_path / "snap.pt", model, optimizer)
    snap = checkpoint.load(tmp_path / "snap.pt", map_location="meta", restore_rng=False)
    assert {t.device.type for t in snap["model"].values()} == {"meta"}
    snap = checkpoint.load(tmp_path / "snap.pt", make_model(1))  # default: the model's device
    assert {t.device.type for t in snap["model"].values()} == {"cpu"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_snapshot_written_on_cpu_loads_onto_a_gpu_model(tmp_path):
    model, optimizer = trained_model_and_optimizer()
    checkpoint.save(tmp_path / "snap.pt", model, optimizer)
    gpu_model = make_model(1).cuda()
    gpu_optimizer = torch.optim.Adam(gpu_model.parameters(), lr=1e-2)
    checkpoint.load(tmp_path / "snap.pt", gpu_model, gpu_optimizer)
    assert same_tensors({k: v.cpu() for k, v in gpu_model.state_dict().items()},
                        model.state_dict())
    assert gpu_optimizer.state_dict()["state"][0]["exp_avg"].is_cuda


def test_state_dict_with_or_without_module_prefix_loads(tmp_path):
    model, _ = trained_model_and_optimizer()
    plain = model.state_dict()
    prefixed = {f"module.{k}": v for k, v in plain.items()}  # what ddp.state_dict() gives
    for state in (plain, prefixed):
        target = make_model(seed=1)
        checkpoint.load_model_state(target, state)
        assert same_tensors(target.state_dict(), plain)
    wrapped = nn.DataParallel(make_model(seed=1))  # a wrapper whose own keys have the prefix
    for state in (plain, prefixed):
        checkpoint.load_model_state(wrapped, state)
        assert same_tensors(wrapped.module.state_dict(), plain)


def test_a_snapshot_that_does_not_fit_names_missing_and_unexpected_keys(tmp_path):
    model, optimizer = trained_model_and_optimizer()
    checkpoint.save(tmp_path / "snap.pt", model, optimizer)
    other = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8), nn.Tanh(),
                          nn.Linear(8, 4))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as info:
        checkpoint.load(tmp_path / "snap.pt", other, restore_rng=False)
    message = str(info.value)
    assert "missing keys" in message and "'4.weight'" in message and "'4.bias'" in message
    assert "shapes that differ" in message and "2.weight: (4, 64)" in message
    assert same_tensors(other.state_dict(), before), "nothing may load unless everything fits"

    with pytest.raises(CheckpointMismatchError, match=r"unexpected keys .*'extra\.weight'"):
        checkpoint.load_model_state(make_model(), {**model.state_dict(),
                                                   "extra.weight": torch.zeros(2)})


def test_an_error_while_writing_keeps_the_previous_snapshot(tmp_path, monkeypatch):
    model, optimizer = trained_model_and_optimizer()
    path = tmp_path / "snap.pt"
    checkpoint.save(path, model, optimizer, step=1)
    real_save = torch.save

    def half_then_fail(obj, f):
        real_save(obj, f)
        f.truncate(f.tell() // 2)
        raise OSError("disk full (simulated) after half the bytes")

    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(OSError, match="simulated"):
        checkpoint.save(path, model, optimizer, step=2)
    monkeypatch.undo()
    assert checkpoint.load(path, make_model(1), restore_rng=False)["step"] == 1
    assert sorted(os.listdir(tmp_path)) == ["snap.pt"], "the temporary file must be cleaned up"


def test_a_crash_while_writing_keeps_the_previous_snapshot(tmp_path):
    """A process that dies mid-write (no exception handler runs) leaves the old snapshot."""
    model, optimizer = trained_model_and_optimizer()
    path = tmp_path / "snap.pt"
    checkpoint.save(path, model, optimizer, step=1)
    pid = os.fork()
    if pid == 0:  # the child writes half a snapshot and dies on the spot
        def half_then_die(obj, f):
            f.write(b"\x80\x02half a snapshot")
            f.flush()
            os._exit(9)
        torch.save = half_then_die
        try:
            checkpoint.save(path, model, optimizer, step=2)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9
    assert (tmp_path / ".snap.pt.tmp").exists(), "the crash should have left a partial temp file"
    assert checkpoint.load(path, make_model(1), restore_rng=False)["step"] == 1
    checkpoint.save(path, model, optimizer, step=3)  # the next save writes over the leftover
    assert checkpoint.load(path, make_model(1), restore_rng=False)["step"] == 3


def test_a_sampler_without_a_position_is_refused(tmp_path):
    model, _ = trained_model_and_optimizer()
    torch_sampler = torch.utils.data.DistributedSampler(make_dataset(8), num_replicas=1, rank=0)
    with pytest.raises(TypeError, match="cannot say where it is inside an epoch"):
        checkpoint.save(tmp_path / "snap.pt", model, sampler=torch_sampler)


# --- several ranks (the `ranks` fixture runs these module-level functions on every rank) ---

def save_with_slow_rank0(path, delay):
    """Rank 0 takes ``delay`` s to write; every rank times its save and reads the file after."""
    model, optimizer = trained_model_and_optimizer()
    real_save = torch.save

    def slow_save(obj, f, *args, **kwargs):  # torch also calls torch.save to pickle tensors
        if isinstance(obj, dict) and "format" in obj:
            time.sleep(delay)
        real_save(obj, f, *args, **kwargs)

    if dist.get_rank() == 0:
        torch.save = slow_save
    try:
        start = time.monotonic()
        checkpoint.save(path, model, optimizer, epoch=0, step=7)
        took = time.monotonic() - start
    finally:
        torch.save = real_save
    snap = torch.load(path, weights_only=True)  # right after save returned, on every rank
    return took, snap["step"]


def test_other_ranks_wait_at_the_barrier_until_the_snapshot_is_on_disk(ranks, tmp_path):
    results = ranks(2).run(save_with_slow_rank0, str(tmp_path / "snap.pt"), 1.0)
    took_rank1, step_seen_by_rank1 = results[1]
    assert step_seen_by_rank1 == 7
    assert took_rank1 >= 0.9, f"rank 1 returned after {took_rank1:.2f} s, before rank 0 wrote"


def per_rank_rng_round_trip(path):
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    checkpoint.save(path, make_model(), step=1)
    expected = draws()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)  # every rank the same state now
    checkpoint.load(path, make_model(1))
    got = draws()
    return torch.equal(got[0], expected[0]) and got[1:] == expected[1:], expected[1]


def test_each_rank_gets_its_own_random_state_back(ranks, tmp_path):
    results = ranks(2).run(per_rank_rng_round_trip, str(tmp_path / "snap.pt"))
    assert [ok for ok, _ in results] == [True, True]
    assert results[0][1] != results[1][1], "the ranks' generators should have differed"


def save_from_miniddp_ddp_load_everywhere(path):
    model, optimizer = trained_model_and_optimizer(seed=dist.get_rank())
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's weights
    checkpoint.save(path, ddp, optimizer, step=5)
    expected = model.state_dict()
    keys = list(torch.load(path, weights_only=True)["model"])
    loaded = []
    for target in (make_model(9), DistributedDataParallel(make_model(9)),
                   nn.parallel.DistributedDataParallel(make_model(9))):
        checkpoint.load(path, target)
        loaded.append(same_tensors(checkpoint.unwrap(target).state_dict(), expected))
    torch_ddp = nn.parallel.DistributedDataParallel(make_model(9))
    checkpoint.load_model_state(torch_ddp, ddp.state_dict())  # a prefixed dict into torch's DDP
    loaded.append(same_tensors(torch_ddp.module.state_dict(), expected))
    return keys, loaded


def test_snapshot_of_a_ddp_model_has_no_prefix_and_loads_into_every_wrapper(ranks, tmp_path):
    results = ranks(2).run(save_from_miniddp_ddp_load_everywhere, str(tmp_path / "snap.pt"))
    for keys, loaded in results:
        assert keys == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert loaded == [True] * 4, "plain module, miniddp DDP, torch DDP, prefixed state"


def load_in_a_bigger_world(path):
    return checkpoint.load(path, make_model())


def test_a_snapshot_of_fewer_ranks_is_refused_unless_resize(ranks, tmp_path):
    checkpoint.save(tmp_path / "snap.pt", make_model())  # one process, no group
    with pytest.raises(Exception, match=r"saved by 1 rank\(s\) and this job has 2.*resize=True"):
        ranks(2).run(load_in_a_bigger_world, str(tmp_path / "snap.pt"))


def save_with_a_seed_per_rank(path):
    torch.manual_seed(100 + dist.get_rank())
    checkpoint.save(path, make_model())
    return torch.rand(1).item()  # what each rank draws next


def resize_and_draw(path):
    torch.manual_seed(200 + dist.get_rank())
    checkpoint.load(path, make_model(), resize=True)
    return torch.rand(1).item()


def test_resized_rank_r_gets_saved_rank_rs_generators_and_a_new_rank_keeps_its_own(ranks,
                                                                                   tmp_path):
    path = str(tmp_path / "snap.pt")
    saved = ranks(2).run(save_with_a_seed_per_rank, path)
    resumed = ranks(3).run(resize_and_draw, path)
    torch.manual_seed(202)
    assert resumed == [*saved, torch.rand(1).item()]
    saved = ranks(3).run(save_with_a_seed_per_rank, path)
    assert ranks(2).run(resize_and_draw, path) == saved[:2]


# --- damaged files ---

DAMAGE = {
    "empty": lambda data: b"",
    "truncated": lambda data: data[:len(data) // 2],
    "random bytes": lambda data: bytes(random.Random(0).randrange(256) for _ in range(4096)),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_snapshot_names_the_file_and_says_the_previous_one_is_there(tmp_path, damage):
    model, optimizer = trained_model_and_optimizer()
    path = tmp_path / "snap.pt"
    checkpoint.save(path, model, optimizer, step=1)
    checkpoint.save(path, model, optimizer, step=2)
    path.write_bytes(DAMAGE[damage](path.read_bytes()))
    with pytest.raises(checkpoint.SnapshotError) as info:
        checkpoint.load(path, make_model(1), optimizer)
    message = str(info.value)
    assert f"{path} is not a complete snapshot" in message
    assert f"still there: {path}.prev" in message
    assert "weights_only=False" not in message and info.value.__cause__ is None
    assert checkpoint.load(f"{path}.prev", make_model(1), restore_rng=False)["step"] == 1


def test_a_damaged_snapshot_without_a_previous_one_says_so(tmp_path):
    path = tmp_path / "snap.pt"
    path.write_bytes(b"")
    with pytest.raises(checkpoint.SnapshotError, match="No previous snapshot .* to resume from"):
        checkpoint.load(path, make_model(1))


def test_each_save_keeps_the_snapshot_it_replaces(tmp_path):
    model, optimizer = trained_model_and_optimizer()
    path = tmp_path / "snap.pt"
    for step in (1, 2, 3):
        checkpoint.save(path, model, optimizer, step=step)
    assert checkpoint.load(path, make_model(1), restore_rng=False)["step"] == 3
    assert checkpoint.load(f"{path}.prev", make_model(1), restore_rng=False)["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["snap.pt", "snap.pt.prev"]
