"""Give each rank its own share of the dataset, the same share torch would give it.

Data parallelism only works if the ranks train on different samples: N ranks that all read the
whole dataset do the same work N times. :class:`DistributedSampler` lays one epoch out as a list
of dataset indices and deals it out like cards: rank ``r`` of ``R`` takes positions ``r``,
``r + R``, ``r + 2R``, ... Every rank builds the same list from the same seed, so no
communication is needed to agree on who reads what.

It yields the same indices as ``torch.utils.data.distributed.DistributedSampler``, index for
index, so a run can switch between the two without changing what it trains on. It adds one thing
torch's lacks: a position inside the epoch, saved by :meth:`~DistributedSampler.state_dict`, so a
job killed mid-epoch resumes where it stopped instead of at the start of the epoch, with as many
ranks as before or with another number of them. It is a subclass of torch's only so that code
that checks for one (to call ``set_epoch``, say) finds it; every method here is its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

from miniddp.errors import NoProcessGroupError

# Saved so that load_state_dict can refuse a state that would resume a different epoch layout.
_LAYOUT_KEYS = ("seed", "num_replicas", "dataset_len", "shuffle", "drop_last")


class DistributedSampler(TorchDistributedSampler):  # (for isinstance: see the top)
    """Yield this rank's indices of the dataset for the current epoch.

    One epoch's layout, for ``n = len(dataset)`` and ``R = num_replicas``:

    1. the order: ``torch.randperm(n)`` from a generator seeded with ``seed + epoch`` (every rank
       gets the same permutation, a new one each epoch), or ``0, 1, ..., n-1`` without shuffle;
    2. equal shares: with ``drop_last`` the tail is cut so that ``R`` divides the list (each rank
       gets ``n // R``); without it the list is padded by starting over from its beginning, as
       many times as needed (each rank gets ``ceil(n / R)``, some samples twice). Unequal shares
       would leave one rank waiting in a collective that the others never join;
    3. rank ``r`` takes every ``R``-th index starting at ``r``.

    Call :meth:`set_epoch` before each epoch, or every epoch repeats the first one's order.

    **Resuming mid-epoch.** The sampler counts the indices it has yielded in the current epoch.
    :meth:`state_dict` saves that count with the epoch and the layout; :meth:`load_state_dict` on
    a fresh sampler makes the next iteration yield only the indices this rank had not yet reached,
    in the same order. Every rank yields equally many, so one rank's state fits all ranks.

    **Resuming with another number of ranks** (``load_state_dict(state, reshard=True)``). The
    dealing means that when every rank has used ``c`` indices, the ranks together have used the
    first ``c * R`` positions of the epoch's list, whichever rank saved. The rest of the list is
    dealt over the new ranks the same way, so every position of the epoch is used exactly once
    (the new shares may differ by one; :class:`EqualBatchCount` batches them so that every rank
    still takes part in every step). Should fewer positions remain than there are ranks, they
    are repeated until each rank has one. The per-rank batches, and so the sums, change: the run
    goes on correctly but not bit for bit as the old number of ranks would have.

    **With** ``DataLoader(num_workers>0)`` the loader pulls indices ahead of training to prefetch
    batches, so the yielded count runs ahead of what the model has actually seen. Resuming from it
    would skip the prefetched samples. The training loop knows how many samples it has trained on
    since it started iterating the loader, so it says so: ``state_dict(trained=seen)``. The count
    is relative to that iteration (not the epoch) because that is the counter a loop already has,
    ``seen += len(batch)``, also right after a resume; the sampler adds where the iteration began.

    Example::

        sampler = DistributedSampler(dataset, seed=0)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=2)
        if resuming:
            sampler.load_state_dict(checkpoint["sampler"])
        for epoch in range(sampler.epoch, epochs):
            sampler.set_epoch(epoch)  # same epoch: the loaded position is kept
            seen = 0
            for x, y in loader:
                train_step(x, y)
                seen += len(x)
                checkpoint["sampler"] = sampler.state_dict(trained=seen)
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if num_replicas is None or rank is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise NoProcessGroupError(
                    "DistributedSampler needs the world size and this process's rank, and there "
                    "is no initialized process group to take them from. Pass num_replicas= and "
                    "rank= explicitly, or call torch.distributed.init_process_group() first.")
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is invalid: with num_replicas={num_replicas} it must "
                             f"be in the interval [0, {num_replicas - 1}]")
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.dataset_len = len(dataset)  # assumed constant, as torch's sampler assumes
        # n // R equals torch's ceil((n - R) / R) whenever drop_last actually cuts (R does not
        # divide n); when R divides n both branches give n / R.
        if drop_last:
            self.num_samples = self.dataset_len // num_replicas
        else:
            self.num_samples = -(-self.dataset_len // num_replicas)
        self.total_size = self.num_samples * num_replicas
        # The positions of the epoch's list that are dealt: all of them (_end None: up to
        # total_size, read when used, as torch reads it), or what a resharded resume left.
        self._begin, self._end = 0, None
        self._position = 0  # indices of this epoch yielded so far (or loaded from a state)
        self._start = 0  # where the latest iteration began
        self._resume_pending = False  # the next iteration starts at _position, not at 0

    @property
    def _stop(self) -> int:
        return self.total_size if self._end is None else self._end

    @property
    def _resharded(self) -> bool:
        """Dealing part of an epoch loaded from a state (a resume, perhaps with another number
        of ranks), not a whole epoch of ``total_size``: only then can fewer positions be left
        than there are ranks."""
        return self._begin > 0 or self._end is not None

    def _epoch_indices(self) -> list[int]:
        """This rank's whole share of the current epoch."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=generator).tolist()
        else:
            order = list(range(self.dataset_len))
        if self._stop > self.dataset_len:  # pad by cycling: the first total_size of order * k
            order = order * -(-self._stop // self.dataset_len)
        dealt = order[self._begin:self._stop]
        if self._resharded and 0 < len(dealt) < self.num_replicas:  # too few for one each:
            dealt = (dealt * self.num_replicas)[:self.num_replicas]  # repeat them
        return dealt[self.rank::self.num_replicas]

    def _share(self, rank: int) -> int:
        """How many indices ``rank`` gets in the current epoch (all the same, unless resharded)."""
        left = self._stop - self._begin
        if self._resharded and 0 < left < self.num_replicas:
            return 1
        return len(range(rank, left, self.num_replicas))

    def shortest_len(self) -> int:
        """``len()`` of the rank with the fewest indices left: the last rank's."""
        return self._share(self.num_replicas - 1) - (self._position if self._resume_pending else 0)

    def __iter__(self) -> Iterator[int]:
        if len(self.dataset) != self.dataset_len:  # (torch pads a shrunk one, asserts on growth)
            raise ValueError(
                f"the dataset has {len(self.dataset)} samples now and had {self.dataset_len} when "
                "this DistributedSampler was built: its layout (how many samples each rank "
                "gets, and a saved position) depends on that length. Build a new sampler for "
                "the new dataset, on every rank.")
        # Claimed now rather than on the first next(), so iter() alone decides where it starts.
        start = self._position if self._resume_pending else 0
        self._resume_pending = False
        self._start = self._position = start
        return self._counted(self._epoch_indices()[start:])

    def _counted(self, indices: list[int]) -> Iterator[int]:
        for index in indices:
            self._position += 1  # counted before handing it out: the consumer has it from here
            yield index

    def __len__(self) -> int:
        """How many indices the next iteration yields: fewer right after a mid-epoch resume.
        A whole epoch yields ``num_samples``, read from the attribute as torch does (a subclass
        that yields fewer sets it)."""
        if not self._resume_pending and self._begin == 0 and self._end is None:
            return self.num_samples
        return self._share(self.rank) - (self._position if self._resume_pending else 0)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order from the next iteration on.

        A new epoch starts from its beginning. Setting the epoch a loaded state is already in
        keeps the loaded position, so the usual ``set_epoch`` at the top of the epoch loop does
        not undo a resume.
        """
        if epoch != self.epoch:
            self.epoch = epoch
            self._position = self._start = 0
            self._begin, self._end = 0, None
            self._resume_pending = False

    def state_dict(self, trained: int | None = None) -> dict[str, int]:
        """Where this rank stands in the current epoch, as plain ints (safe for ``weights_only``).

        ``consumed`` is the number of this rank's indices of epoch ``epoch`` already used: by
        default every index yielded so far; with ``trained``, the samples the loop says it has
        trained on since it began iterating (see the class docstring for why that matters with
        ``num_workers>0``). The layout (seed, world size, dataset length, shuffle, drop_last) is
        saved too, so that a state cannot silently resume a different order.
        """
        consumed = self._position if trained is None else self._start + trained
        if not self._start <= consumed <= self._position:
            raise ValueError(
                f"trained={trained} is not possible: this iteration began at index {self._start} "
                f"of the epoch and has yielded {self._position - self._start} indices so far. "
                "Count this rank's samples only (not all ranks'), since iter(loader).")
        return {"epoch": self.epoch, "consumed": consumed, "seed": self.seed,
                "num_replicas": self.num_replicas, "dataset_len": self.dataset_len,
                "shuffle": int(self.shuffle), "drop_last": int(self.drop_last),
                "begin": self._begin, "end": self._stop}

    def load_state_dict(self, state: dict[str, int], reshard: bool = False) -> None:
        """Resume from :meth:`state_dict`: the next iteration yields the rest of that epoch.

        ``reshard`` accepts a state saved with another ``num_replicas``: the positions of the
        epoch that no rank had reached are dealt over this sampler's ranks (see the class
        docstring); every rank must load the same state.
        """
        missing = sorted({"epoch", "consumed", *_LAYOUT_KEYS} - set(state))
        if missing:
            raise ValueError(f"not a DistributedSampler state: missing keys {missing}")
        ours = self.state_dict()
        for key in _LAYOUT_KEYS:
            if int(state[key]) != ours[key] and not (reshard and key == "num_replicas"):
                raise ValueError(
                    f"the state was saved with {key}={state[key]} but this sampler has "
                    f"{key}={ours[key]}: resuming would not continue the same order. Build the "
                    "sampler with the settings of the run that saved it"
                    + (", or pass reshard=True." if key == "num_replicas" else "."))
        saved = DistributedSampler(range(self.dataset_len), int(state["num_replicas"]), 0,
                                   drop_last=self.drop_last)
        saved._begin = int(state.get("begin", 0))  # states saved before resizing existed
        saved._end = int(state.get("end", saved.total_size))
        consumed, most = int(state["consumed"]), saved._share(0)
        if not 0 <= consumed <= most:
            raise ValueError(f"consumed={consumed} is out of range: each rank has at most "
                             f"{most} samples in that epoch, so it must be in [0, {most}]")
        self.epoch = int(state["epoch"])
        if saved.num_replicas == self.num_replicas:
            self._begin, self._end = saved._begin, saved._end
            self._position = self._start = consumed
        else:  # every rank had used `consumed`: the first consumed * R positions are done
            done = min(saved._begin + consumed * saved.num_replicas, saved._end)
            self._begin, self._end = done, saved._end
            self._position = self._start = 0
        self._resume_pending = True


class EqualBatchCount(Sampler[list[int]]):
    """Batches of ``batch_size`` of ``sampler``'s indices, as many batches on every rank.

    The same batches as ``DataLoader(batch_size=...)`` makes when every rank has an equal share.
    After a resume with another number of ranks the shares can differ by one; where that would
    give some ranks one more batch than the others (a batch of one sample, and a step the others
    never take, so a collective they never join), that sample joins the rank's last full batch.
    Use it as ``DataLoader(dataset, batch_sampler=EqualBatchCount(sampler, batch_size))``.
    """

    def __init__(self, sampler: DistributedSampler, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.sampler, self.batch_size = sampler, batch_size

    def _sizes(self) -> list[int]:
        mine, fewest = len(self.sampler), self.sampler.shortest_len()
        sizes = [self.batch_size] * (mine // self.batch_size)
        sizes += [mine % self.batch_size] if mine % self.batch_size else []
        if len(sizes) > -(-fewest // self.batch_size) and len(sizes) > 1:
            extra = sizes.pop()  # one sample more than the rank with the fewest
            sizes[-1] += extra
        return sizes

    def __iter__(self) -> Iterator[list[int]]:
        sizes = self._sizes()  # before iter(): that consumes a resumed position
        indices = iter(self.sampler)
        for size in sizes:
            yield list(itertools.islice(indices, size))

    def __len__(self) -> int:
        return len(self._sizes())
