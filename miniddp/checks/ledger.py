"""A ledger in the process group's store: what each rank says it is doing, readable by all.

The consistency checks (``miniddp.checks.consistency``, ``miniddp.checks.fingerprints``) compare
what ranks are doing. They cannot do it with collectives: a collective pairs with whatever
collective the other ranks happen to issue next, so if the ranks are out of step - the very
thing to detect - a check by all_gather would meet another rank's gradient all_reduce, and gloo
may abort the process ("Received data size doesn't match") instead of reporting anything. A
key-value store pairs nothing with anything: each rank writes its record under its own key,
reads the others' by
name, and if a record never comes it still knows exactly which ranks wrote theirs and what
each rank wrote last.

Keys live under one prefix per DDP instance (instances are numbered in construction order,
which is the same on every rank), so ledgers of different wrappers or of an earlier test in the
same process group never meet.
"""

from __future__ import annotations

import itertools
import json
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from miniddp.torch_versions import STORE_HAS_CHECK

_instances = itertools.count()


def process_group_timeout(group=None, device: torch.device | None = None) -> float:
    """The group's collective timeout in seconds (torch's default when it cannot be read)."""
    pg = distributed_c10d._get_default_group() if group is None else group
    try:
        backend = pg._get_backend(device or torch.device("cpu"))
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return distributed_c10d.default_pg_timeout.total_seconds()


class RecordsMissing(RuntimeError):
    """Some ranks did not write a record in time. ``arrived`` and ``last`` say who did what."""

    def __init__(self, key: str, arrived: dict[int, dict], missing: list[int],
                 last: dict[int, dict | None], waited: float):
        self.key, self.arrived, self.missing, self.last = key, arrived, missing, last
        self.waited = waited
        super().__init__(f"ranks {missing} wrote no {key!r} record within {waited:.1f} s")


class Ledger:
    """Records written by each rank of ``group`` under keys, read by the others by key."""

    def __init__(self, group=None, device: torch.device | None = None):
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        name = getattr(group, "group_name", None) or "world"
        self.prefix = f"miniddp/ledger/{name}/{next(_instances)}/"
        self.timeout = process_group_timeout(group, device)
        self._store = None
        self._scopes = itertools.count()

    def new_scope(self) -> str:
        """A fresh key prefix, so that checks switched on again never read older records."""
        return f"scope{next(self._scopes)}/"

    @property
    def store(self) -> dist.Store:
        """The default group's store, opened at first use: a ledger nobody writes costs nothing."""
        if self._store is None:
            self._store = dist.PrefixStore(self.prefix, distributed_c10d._get_default_store())
        return self._store

    def write(self, key: str, record: dict) -> None:
        """Write this rank's record for ``key``; it also becomes this rank's ``last`` record."""
        value = json.dumps(record)
        self._put(f"{key}/{self.rank}", value)
        self._put(f"last/{self.rank}", value)

    def _put(self, name: str, value: str) -> None:
        self.store.set(name, value)
        if not STORE_HAS_CHECK:  # torch 2.1: a counter beside the key says it is there
            self.store.add(f"{name}/written", 1)

    def _written(self, names: list[str]) -> bool:
        if STORE_HAS_CHECK:
            return self.store.check(names)
        return all(self.store.add(f"{name}/written", 0) > 0 for name in names)

    def read(self, key: str, rank: int) -> dict | None:
        """``rank``'s record for ``key``, or None if it has not written one."""
        name = f"{key}/{rank}"
        if not self._written([name]):
            return None
        return json.loads(self.store.get(name))

    def last(self, rank: int) -> dict | None:
        return self.read("last", rank)

    def gather(self, key: str, timeout: float | None = None) -> list[dict]:
        """Every rank's record for ``key``, in rank order; waits up to ``timeout`` seconds.

        Polls with ``check`` rather than the store's blocking ``wait``: a FileStore's wait
        sleeps 10 ms a round, too slow to run before every collective.
        """
        timeout = self.timeout if timeout is None else timeout
        names = [f"{key}/{r}" for r in range(self.world_size)]
        start = time.monotonic()
        pause = 1e-4
        while not self._written(names):
            waited = time.monotonic() - start
            if waited >= timeout:
                arrived = {r: self.read(key, r) for r in range(self.world_size)}
                missing = [r for r, record in arrived.items() if record is None]
                raise RecordsMissing(key, {r: v for r, v in arrived.items() if v is not None},
                                     missing, {r: self.last(r) for r in missing}, waited)
            time.sleep(pause)
            pause = min(2 * pause, 0.005)
        return [json.loads(self.store.get(name)) for name in names]

    def collect(self, key: str, wait: float) -> dict[int, dict]:
        """Whatever records for ``key`` the ranks write within ``wait`` seconds (no error)."""
        try:
            return dict(enumerate(self.gather(key, wait)))
        except RecordsMissing as partial:
            return partial.arrived

    def forget(self, key: str) -> None:
        """Delete this rank's record for ``key`` (once no rank will read it again)."""
        try:
            self.store.delete_key(f"{key}/{self.rank}")
        except RuntimeError:  # a store without deletion: keys pile up, nothing breaks
            pass

