"""The sampler: torch's DistributedSampler is the oracle, index for index; resuming mid-epoch
yields exactly the rest; wrong use gets a message that says what to do."""

import io
import itertools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from miniddp.sampler import DistributedSampler

FAST = settings(deadline=None, derandomize=True, max_examples=60, database=None)

# Small lengths get their own branch: padding longer than the dataset only happens below R.
lengths = st.one_of(st.integers(0, 10), st.integers(0, 200))
worlds = st.integers(1, 8)
seeds = st.integers(0, 2**32)
epochs = st.integers(0, 50)


def ours(n, world, rank, shuffle=True, seed=0, drop_last=False, epoch=0):
    sampler = DistributedSampler(range(n), world, rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    sampler.set_epoch(epoch)
    return sampler


def torchs(n, world, rank, shuffle=True, seed=0, drop_last=False, epoch=0):
    sampler = TorchSampler(range(n), world, rank, shuffle=shuffle, seed=seed,
                           drop_last=drop_last)
    sampler.set_epoch(epoch)
    return sampler


def shards(n, world, **kw):
    return [list(ours(n, world, r, **kw)) for r in range(world)]


def assert_same_as_torch(n, world, **kw):
    for rank in range(world):
        mine, theirs = ours(n, world, rank, **kw), torchs(n, world, rank, **kw)
        assert len(mine) == len(theirs), (n, world, rank, kw)
        assert list(mine) == list(theirs), (n, world, rank, kw)


# --- the same indices as torch ---------------------------------------------------------------

@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_indices_as_torch_on_a_grid(shuffle, drop_last):
    # Lengths around multiples of the world size, and ones smaller than it (heavy padding).
    for n, world in itertools.product([0, 1, 2, 3, 5, 7, 8, 9, 16, 17, 64, 101], range(1, 9)):
        for epoch in (0, 1):
            assert_same_as_torch(n, world, shuffle=shuffle, drop_last=drop_last, seed=3,
                                 epoch=epoch)


@FAST
@given(n=lengths, world=worlds, shuffle=st.booleans(), seed=seeds, epoch=epochs,
       drop_last=st.booleans())
def test_same_indices_as_torch_property(n, world, shuffle, seed, epoch, drop_last):
    assert_same_as_torch(n, world, shuffle=shuffle, seed=seed, epoch=epoch, drop_last=drop_last)


def test_iterating_twice_without_set_epoch_repeats_the_epoch_like_torch():
    mine, theirs = ours(10, 3, 1), torchs(10, 3, 1)
    assert list(mine) == list(mine) == list(theirs) == list(theirs)
    assert len(mine) == len(theirs)


# --- what every rank gets --------------------------------------------------------------------

@FAST
@given(n=lengths, world=worlds, shuffle=st.booleans(), seed=seeds, epoch=epochs)
def test_ranks_together_cover_the_dataset(n, world, shuffle, seed, epoch):
    everything = [i for shard in shards(n, world, shuffle=shuffle, seed=seed, epoch=epoch)
                  for i in shard]
    assert set(everything) == set(range(n))


@FAST
@given(n=lengths, world=worlds, shuffle=st.booleans(), drop_last=st.booleans())
def test_every_rank_gets_an_equal_share(n, world, shuffle, drop_last):
    sizes = {len(s) for s in shards(n, world, shuffle=shuffle, drop_last=drop_last)}
    lens = {len(ours(n, world, r, shuffle=shuffle, drop_last=drop_last)) for r in range(world)}
    assert len(sizes) == 1 and sizes == lens


@FAST
@given(per_rank=st.integers(0, 25), world=worlds, shuffle=st.booleans(), seed=seeds,
       drop_last=st.booleans())
def test_shards_are_disjoint_when_the_world_divides_the_dataset(per_rank, world, shuffle, seed,
                                                                drop_last):
    n = per_rank * world
    everything = [i for s in shards(n, world, shuffle=shuffle, seed=seed, drop_last=drop_last)
                  for i in s]
    assert sorted(everything) == list(range(n))


@FAST
@given(n=st.integers(100, 200), world=worlds, seed=seeds, epoch=epochs,
       step=st.integers(1, 1000))
def test_a_new_epoch_reshuffles(n, world, seed, epoch, step):
    # Each shard holds at least 12 of 100+ indices: equal shards by chance are negligible.
    for rank in range(world):
        assert list(ours(n, world, rank, seed=seed, epoch=epoch)) != \
            list(ours(n, world, rank, seed=seed, epoch=epoch + step))


# --- resuming mid-epoch ----------------------------------------------------------------------

@FAST
@given(n=lengths, world=worlds, shuffle=st.booleans(), seed=seeds, epoch=epochs,
       drop_last=st.booleans(), saver=st.integers(0, 7), fraction=st.floats(0, 1))
def test_resume_mid_epoch_yields_exactly_the_rest(n, world, shuffle, seed, epoch, drop_last,
                                                  saver, fraction):
    kw = dict(shuffle=shuffle, seed=seed, drop_last=drop_last)
    before = ours(n, world, saver % world, epoch=epoch, **kw)
    k = round(fraction * len(before))
    list(itertools.islice(iter(before), k))
    state = before.state_dict()
    assert state["consumed"] == k and state["epoch"] == epoch
    # Every rank yields equally many, so the saving rank's state resumes any rank.
    for rank in range(world):
        full = list(torchs(n, world, rank, epoch=epoch, **kw))
        after = ours(n, world, rank, **kw)
        after.load_state_dict(state)
        after.set_epoch(epoch)  # the loop's usual call must not undo the resume
        assert len(after) == len(full) - k
        assert list(after) == full[k:]
        after.set_epoch(epoch + 1)
        assert list(after) == list(torchs(n, world, rank, epoch=epoch + 1, **kw))


@FAST
@given(n=lengths, world=worlds, seed=seeds, epoch=epochs, fraction=st.floats(0, 1))
def test_state_dict_survives_torch_save_and_weights_only_load(n, world, seed, epoch, fraction):
    sampler = ours(n, world, 0, seed=seed, epoch=epoch)
    list(itertools.islice(iter(sampler), round(fraction * len(sampler))))
    state = sampler.state_dict()
    assert all(type(v) is int for v in state.values()), state
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded == state
    fresh = ours(n, world, 0, seed=seed)
    fresh.load_state_dict(loaded)
    assert fresh.state_dict() == state


def test_a_loaded_state_applies_to_one_iteration_only():
    sampler = ours(20, 2, 0, epoch=4)
    sampler.load_state_dict({**sampler.state_dict(), "consumed": 6})
    assert list(sampler) == list(torchs(20, 2, 0, epoch=4))[6:]
    assert len(sampler) == 10 and list(sampler) == list(torchs(20, 2, 0, epoch=4))


@FAST
@given(n=st.integers(1, 200), world=worlds, seed=seeds, trained_fraction=st.floats(0, 1),
       ahead=st.integers(0, 40))
def test_trained_rewinds_past_what_was_prefetched(n, world, seed, trained_fraction, ahead):
    sampler = ours(n, world, world - 1, seed=seed)
    trained = round(trained_fraction * len(sampler))
    list(itertools.islice(iter(sampler), trained + ahead))  # the loader ran ahead
    state = sampler.state_dict(trained=trained)
    resumed = ours(n, world, world - 1, seed=seed)
    resumed.load_state_dict(state)
    assert list(resumed) == list(torchs(n, world, world - 1, seed=seed))[trained:]


def test_trained_counts_from_where_a_resumed_iteration_began():
    sampler = ours(40, 2, 1, seed=5)
    sampler.load_state_dict({**sampler.state_dict(), "consumed": 7})
    list(itertools.islice(iter(sampler), 6))
    assert sampler.state_dict(trained=4)["consumed"] == 11


def test_dataloader_with_workers_runs_ahead_and_trained_fixes_it():
    data = torch.arange(64)
    sampler = DistributedSampler(data, num_replicas=2, rank=1, seed=9)
    loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=1,
                        multiprocessing_context="fork")
    seen, batches = 0, iter(loader)
    for _ in range(3):
        seen += len(next(batches))
    assert sampler.state_dict()["consumed"] > seen  # the yielded count is ahead of training
    state = sampler.state_dict(trained=seen)
    del batches
    resumed = DistributedSampler(data, num_replicas=2, rank=1, seed=9)
    resumed.load_state_dict(state)
    assert list(resumed) == list(TorchSampler(data, num_replicas=2, rank=1, seed=9))[seen:]


# --- errors that say what to do --------------------------------------------------------------

@pytest.mark.parametrize("rank", [-1, 3, 7])
def test_rank_outside_the_world_is_a_value_error_naming_the_interval(rank):
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        DistributedSampler(range(10), num_replicas=3, rank=rank)
    with pytest.raises(ValueError):  # torch agrees it is a ValueError
        TorchSampler(range(10), num_replicas=3, rank=rank)


@pytest.mark.parametrize("world", [0, -2])
def test_fewer_than_one_replica_is_a_value_error(world):
    with pytest.raises(ValueError, match="num_replicas must be at least 1"):
        DistributedSampler(range(10), num_replicas=world, rank=0)


@pytest.mark.parametrize("given_args", [{}, {"num_replicas": 2}, {"rank": 0}])
def test_without_a_process_group_the_error_says_what_to_do(given_args):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"no initialized process group.*Pass num_replicas= "
                                           r"and rank=.*init_process_group"):
        DistributedSampler(range(10), **given_args)


@pytest.mark.parametrize("change", [{"seed": 1}, {"num_replicas": 4}, {"dataset_len": 31},
                                    {"shuffle": 0}, {"drop_last": 1}])
def test_loading_a_state_from_a_different_layout_is_refused(change):
    sampler = ours(30, 3, 0)
    key, = change
    with pytest.raises(ValueError, match=f"saved with {key}="):
        sampler.load_state_dict({**sampler.state_dict(), **change})


@pytest.mark.parametrize("consumed", [-1, 11])
def test_loading_a_consumed_count_out_of_range_is_refused(consumed):
    sampler = ours(30, 3, 0)  # 10 samples per rank
    with pytest.raises(ValueError, match=r"consumed=.*\[0, 10\]"):
        sampler.load_state_dict({**sampler.state_dict(), "consumed": consumed})


def test_loading_something_that_is_not_a_sampler_state_is_refused():
    with pytest.raises(ValueError, match="missing keys"):
        ours(30, 3, 0).load_state_dict({"epoch": 1})


@pytest.mark.parametrize("trained", [-1, 6])
def test_trained_beyond_what_was_yielded_is_refused(trained):
    sampler = ours(30, 3, 0)
    list(itertools.islice(iter(sampler), 5))
    with pytest.raises(ValueError, match="this rank's samples only"):
        sampler.state_dict(trained=trained)


# --- in a real process group -----------------------------------------------------------------

# (n, shuffle, seed, epoch, drop_last); n=1 pads past the dataset's end at world size 3.
CASES = [(0, True, 0, 0, False), (7, True, 1, 2, False), (7, False, 0, 0, True),
         (50, True, 11, 3, True), (50, True, 11, 4, False), (2, False, 0, 0, False),
         (1, True, 4, 1, False)]


def shards_from_the_group(cases):
    """Runs on every rank: build samplers from the default group, not from arguments."""
    out = []
    for n, shuffle, seed, epoch, drop_last in cases:
        sampler = DistributedSampler(range(n), shuffle=shuffle, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        out.append((sampler.num_replicas, sampler.rank, len(sampler), list(sampler)))
    return dist.get_rank(), out


@pytest.mark.parametrize("world", [2, 3])
def test_world_and_rank_come_from_the_process_group(ranks, world):
    results = ranks(world).run(shards_from_the_group, CASES)
    for rank, (reported_rank, out) in enumerate(results):
        assert reported_rank == rank
        for (n, shuffle, seed, epoch, drop_last), (got_world, got_rank, length, got) in \
                zip(CASES, out, strict=True):
            theirs = torchs(n, world, rank, shuffle=shuffle, seed=seed, epoch=epoch,
                            drop_last=drop_last)
            assert (got_world, got_rank) == (world, rank)
            assert length == len(theirs) and got == list(theirs)
