"""The synthetic task: the same tensors from the same seed, shards that split it, and learnable."""

import pytest
import torch
import torch.nn.functional as F

from course.data import shard
from miniddp.train.data import IN_FEATURES, OUT_FEATURES, _teacher, make_dataset, make_model


def test_same_seed_same_data_other_seed_other_inputs():
    a, b, c = make_dataset(64, seed=0), make_dataset(64, seed=0), make_dataset(64, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors))
    assert not torch.equal(a.tensors[0], c.tensors[0])
    assert a.tensors[0].shape == (64, IN_FEATURES) and a.tensors[1].shape == (64, OUT_FEATURES)


def test_every_seed_is_labelled_by_the_same_teacher():
    """Targets are one fixed function of the inputs (random targets leave nothing to learn)."""
    for seed in (0, 1, 2):
        x, y = make_dataset(128, seed=seed).tensors
        assert torch.equal(y, _teacher(x))
        assert y.std() > 0.3  # not a constant either


def test_model_depends_on_seed_only_and_leaves_global_rng_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    a = make_model(seed=0)
    assert torch.equal(torch.rand(3), expected)
    b, c = make_model(seed=0), make_model(seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_student_learns_the_teacher():
    data = make_dataset(512, seed=0)
    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    x, y = data.tensors
    first = F.mse_loss(model(x), y).item()
    for _ in range(200):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1 * first


@pytest.mark.parametrize("n, world_size", [(10, 2), (11, 2), (10, 3), (7, 1), (64, 4)])
def test_shards_are_disjoint_equal_and_cover_all_but_the_remainder(n, world_size):
    data = make_dataset(n, seed=0)
    shards = [shard(data, rank, world_size) for rank in range(world_size)]
    indices = [list(s.indices) for s in shards]
    assert len({len(i) for i in indices}) == 1
    flat = sorted(i for part in indices for i in part)
    assert flat == list(range(n - n % world_size))
    x, _ = shards[world_size - 1][0]
    assert torch.equal(x, data.tensors[0][world_size - 1])


def test_shard_rejects_a_rank_outside_the_world():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        shard(make_dataset(8), 2, 2)
