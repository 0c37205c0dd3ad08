"""The sampler: torch's DistributedSampler is the oracle, index for index; resuming mid-epoch
yields exactly the rest, with as many ranks or another number; wrong use gets a message that
says what to do."""

import io
import itertools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from miniddp.sampler import DistributedSampler, EqualBatchCount

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


# --- resuming with another number of ranks --------------------------------------------------

def epoch_list(n, world, **kw):
    """Every rank's share of one epoch laid out by torch's sampler: what the epoch trains on."""
    return sorted(i for r in range(world) for i in torchs(n, world, r, **kw))


def resumed_shares(state, n, world, **kw):
    """Every rank of a ``world``-rank job resumed from ``state``: its sampler after loading."""
    samplers = []
    for rank in range(world):
        sampler = ours(n, world, rank, **kw)
        sampler.load_state_dict(state, reshard=True)
        sampler.set_epoch(state["epoch"])
        samplers.append(sampler)
    return samplers


@FAST
@given(n=lengths, old=worlds, new=worlds, shuffle=st.booleans(), seed=seeds, epoch=epochs,
       drop_last=st.booleans(), fraction=st.floats(0, 1), batch=st.integers(1, 9))
def test_resuming_with_another_world_size_uses_every_sample_of_the_epoch_exactly_once(
        n, old, new, shuffle, seed, epoch, drop_last, fraction, batch):
    kw = dict(shuffle=shuffle, seed=seed, drop_last=drop_last)
    before = [ours(n, old, r, epoch=epoch, **kw) for r in range(old)]
    k = round(fraction * len(before[0]))  # every rank has used k indices when rank 0 saves
    seen = [i for s in before for i in itertools.islice(iter(s), k)]
    after = resumed_shares(before[0].state_dict(), n, new, epoch=epoch, **kw)
    batches = [list(EqualBatchCount(s, batch)) for s in after]
    seen += [i for rank in batches for b in rank for i in b]
    left = len(epoch_list(n, old, epoch=epoch, **kw)) - k * old
    if left >= new or left == 0:
        assert sorted(seen) == epoch_list(n, old, epoch=epoch, **kw)
    else:  # fewer samples left than ranks: one each, so some twice
        assert set(seen) == set(epoch_list(n, old, epoch=epoch, **kw))
    assert len({len(b) for b in batches}) == 1, "every rank must take part in every step"
    assert all(1 <= len(b) <= batch + 1 for rank in batches for b in rank)


@FAST
@given(n=st.integers(20, 200), sizes=st.lists(worlds, min_size=3, max_size=4), seed=seeds,
       fractions=st.lists(st.floats(0, 1), min_size=3, max_size=3))
def test_resizing_again_in_the_same_epoch_still_uses_every_sample_once(n, sizes, seed,
                                                                        fractions):
    """E.g. 2 -> 3 -> 1 ranks inside one epoch: a state saved after a resize resizes again."""
    samplers = [ours(n, sizes[0], r, seed=seed) for r in range(sizes[0])]
    seen, repeats = [], False
    for world, fraction in zip(sizes[1:], fractions):
        k = round(fraction * min(len(s) for s in samplers))  # mid-epoch: every rank used k
        seen += [i for s in samplers for i in itertools.islice(iter(s), k)]
        samplers = resumed_shares(samplers[0].state_dict(), n, world, seed=seed)
        state = samplers[0].state_dict()
        repeats |= 0 < state["end"] - state["begin"] < world  # fewer left than ranks
    seen += [i for s in samplers for i in s]
    expected = epoch_list(n, sizes[0], seed=seed)
    if repeats:
        assert set(seen) == set(expected)
    else:
        assert sorted(seen) == expected


def test_a_resharded_position_is_saved_and_resumed_by_the_same_world_size():
    state = {**ours(100, 2, 0).state_dict(), "consumed": 10}  # 20 of the 100 done
    three = resumed_shares(state, 100, 3)
    assert [len(s) for s in three] == [27, 27, 26]
    rest = [list(s) for s in three]
    again = resumed_shares(three[0].state_dict(trained=5), 100, 3)  # 5 each, then saved
    assert [list(s) for s in again] == [r[5:] for r in rest]


def test_equal_shares_are_batched_exactly_as_dataloader_batches_them():
    batches = list(EqualBatchCount(ours(100, 3, 1), 8))
    assert batches == [b.tolist() for b in DataLoader(range(100), batch_size=8,
                                                      sampler=ours(100, 3, 1))]


def test_a_share_one_longer_puts_its_extra_sample_into_the_last_batch():
    samplers = resumed_shares({**ours(41, 1, 0).state_dict(), "consumed": 1}, 41, 3)
    assert [len(s) for s in samplers] == [14, 13, 13]  # the 40 left, dealt over 3
    sizes = [[len(b) for b in EqualBatchCount(s, 13)] for s in samplers]
    assert sizes == [[14], [13], [13]], "not a second step, of one sample, on rank 0 alone"


def test_another_world_size_is_refused_without_reshard():
    with pytest.raises(ValueError, match="saved with num_replicas=2.*or pass reshard=True"):
        ours(30, 3, 0).load_state_dict(ours(30, 2, 0).state_dict())


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
    """A ValueError, as torch raises now, and a RuntimeError, as it raised before."""
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"no initialized process group.*Pass num_replicas= "
                                         r"and rank=.*init_process_group") as raised:
        DistributedSampler(range(10), **given_args)
    assert isinstance(raised.value, RuntimeError)
    with pytest.raises((ValueError, RuntimeError)):  # torch's (RuntimeError in older ones)
        TorchSampler(range(10), **given_args)


def unpadded(base):
    """The common recipe for evaluation: a subclass that deals without padding, setting
    ``num_samples`` and ``total_size`` itself and yielding fewer indices on some ranks."""

    class Unpadded(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.total_size = len(self.dataset)
            self.num_samples = len(range(self.rank, self.total_size, self.num_replicas))

        def __iter__(self):
            return iter(range(self.rank, self.total_size, self.num_replicas))

    return Unpadded


def unpadded_dealing(base):
    """The same subclass keeping the base class's __iter__: the dealing must read the
    subclass's total_size (and give a rank nothing where there is nothing left for it)."""

    class Unpadded(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.total_size = len(self.dataset)
            self.num_samples = len(range(self.rank, self.total_size, self.num_replicas))

    return Unpadded


@pytest.mark.parametrize("n, world", [(10, 3), (7, 4), (2, 3), (1, 2), (12, 4)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_subclass_s_total_size_deals_as_torchs(n, world, shuffle):
    for rank in range(world):
        mine = unpadded_dealing(DistributedSampler)(range(n), world, rank, shuffle=shuffle)
        theirs = unpadded_dealing(TorchSampler)(range(n), world, rank, shuffle=shuffle)
        assert list(mine) == list(theirs) and len(mine) == len(theirs), (n, world, rank)


@pytest.mark.parametrize("n, world", [(10, 3), (7, 4), (2, 3), (12, 4)])
def test_len_is_num_samples_as_torchs_is(n, world):
    for rank in range(world):
        mine = unpadded(DistributedSampler)(range(n), world, rank)
        theirs = unpadded(TorchSampler)(range(n), world, rank)
        assert len(mine) == len(theirs) == len(list(mine)), (n, world, rank)
        plain = DistributedSampler(range(n), world, rank)
        assert len(plain) == len(list(plain)) == plain.num_samples


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


def test_a_dataset_that_changed_length_since_construction_is_refused():
    """torch's sampler fails an assertion there; miniddp's said nothing and dealt the old
    length."""
    data = list(range(10))
    mine, theirs = DistributedSampler(data, 2, 0), TorchSampler(data, 2, 0)
    data.extend(range(10, 15))
    with pytest.raises(ValueError, match="has 15 samples now and had 10"):
        iter(mine)
    with pytest.raises(AssertionError):
        list(theirs)


def test_code_that_checks_for_torchs_sampler_finds_it_and_runs_none_of_torchs_methods():
    """Training loops and frameworks call ``set_epoch`` on a sampler that is an instance of
    torch's (``isinstance(sampler, DistributedSampler)``): without it, every epoch would repeat
    the first one's order. miniddp's sampler is one, and runs none of torch's code: it defines
    every method and attribute torch's class defines."""
    sampler = DistributedSampler(range(10), num_replicas=2, rank=0)
    assert isinstance(sampler, TorchSampler)
    inherited = [name for name in vars(TorchSampler)
                 if name not in vars(DistributedSampler) and name not in (
                     "__dict__", "__weakref__", "__parameters__", "__orig_bases__",
                     "__annotations__")]
    assert inherited == [], f"taken from torch's sampler: {inherited}"
    first = list(sampler)
    if isinstance(sampler, TorchSampler):  # what such a loop does
        sampler.set_epoch(1)
    assert list(sampler) != first
