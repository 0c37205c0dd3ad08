"""Bucket assignment follows torch's rules exactly; bucket views match their parameters."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from miniddp.buckets import (
    DEFAULT_FIRST_BUCKET_BYTES,
    MIB,
    UNLIMITED_BYTES,
    Bucket,
    assign_buckets,
    bucket_limits,
)
from miniddp.torch_versions import TORCH_RELEASE, _release

sizes = st.lists(st.integers(1, 4000), min_size=1, max_size=14)
limits = st.one_of(st.just([UNLIMITED_BYTES]), st.lists(st.integers(4, 20_000), min_size=1,
                                                   max_size=3))


def torch_assignment(tensors, limit_list, indices=None):
    """torch's own C++ implementation, the oracle (a private but long-stable function)."""
    if indices is None:
        result = dist._compute_bucket_assignment_by_size(tensors, limit_list)
    else:
        result = dist._compute_bucket_assignment_by_size(tensors, limit_list,
                                                         [False] * len(tensors), indices)
    return [list(b) for b in result[0]]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(sizes=sizes, limit_list=limits, data=st.data())
def test_same_buckets_as_torch_in_model_order_and_in_ready_order(sizes, limit_list, data):
    tensors = [torch.empty(n) for n in sizes]
    assert assign_buckets(tensors, limit_list) == torch_assignment(tensors, limit_list)
    order = data.draw(st.permutations(range(len(sizes))))
    ready = [tensors[i] for i in order]
    assert assign_buckets(ready, limit_list, order) == torch_assignment(ready, limit_list, order)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(sizes=sizes, dtypes=st.lists(st.sampled_from([torch.float32, torch.float64]),
                                    min_size=14, max_size=14), limit_list=limits)
def test_mixed_dtypes_group_the_same_tensors_as_torch(sizes, dtypes, limit_list):
    tensors = [torch.empty(n, dtype=dt) for n, dt in zip(sizes, dtypes)]
    ours = assign_buckets(tensors, limit_list)
    assert sorted(map(tuple, ours)) == sorted(map(tuple, torch_assignment(tensors, limit_list)))


def test_the_tensor_that_crosses_the_limit_stays_and_the_last_limit_repeats():
    tensors = [torch.empty(n) for n in (10, 10, 30, 5, 5, 5)]  # bytes: 40 40 120 20 20 20
    assert assign_buckets(tensors, [50, 40]) == [[0, 1], [2], [3, 4], [5]]


def test_limits_from_bucket_cap_mb():
    for covers_first in (True, False):
        assert bucket_limits(None, covers_first) == (DEFAULT_FIRST_BUCKET_BYTES, 25 * MIB)
    assert bucket_limits(5, explicit_cap_covers_first=True) == (5 * MIB, 5 * MIB)
    assert bucket_limits(0.5, explicit_cap_covers_first=True) == (MIB // 2, MIB // 2)
    # torch < 2.4: the first bucket stays 1 MiB whatever the cap
    assert bucket_limits(5, explicit_cap_covers_first=False) == (MIB, 5 * MIB)
    assert bucket_limits(0.5, explicit_cap_covers_first=False) == (MIB, MIB // 2)
    # 0 is torch's too: every parameter closes its own bucket
    assert bucket_limits(0, explicit_cap_covers_first=True) == (0, 0)
    assert bucket_limits(0, explicit_cap_covers_first=False) == (MIB, 0)
    for bad in (-3, float("nan")):
        with pytest.raises(ValueError, match="bucket_cap_mb must be a number of MiB >= 0"):
            bucket_limits(bad)


def test_a_zero_limit_gives_every_tensor_its_own_bucket_as_torch():
    tensors = [torch.empty(n) for n in (3, 1, 7, 2)]
    assert assign_buckets(tensors, [0]) == torch_assignment(tensors, [0]) == [[0], [1], [2], [3]]
    assert assign_buckets(tensors, [0, 20]) == torch_assignment(tensors, [0, 20])


def test_the_first_bucket_rule_follows_the_installed_torch():
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert TORCH_RELEASE == (major, minor)
    assert bucket_limits(5)[0] == (5 * MIB if (major, minor) >= (2, 4) else MIB)


def test_torch_releases_are_read_with_any_suffix():
    assert _release("2.13.0+cpu") == (2, 13)
    assert _release("2.4.0a0+git1234") == (2, 4)
    assert _release("2.10.0rc1") == (2, 10)


def test_views_alias_the_flat_buffer_with_each_parameters_layout():
    params = [torch.empty(2, 3), torch.empty(4, 3, 2, 2).to(memory_format=torch.channels_last),
              torch.empty(5)]
    bucket = Bucket(0, [2, 0, 1], params)
    assert bucket.numel == 6 + 48 + 5 and bucket.pending == 3
    for view, p in zip(bucket.views, [params[2], params[0], params[1]]):
        assert view.shape == p.shape and view.stride() == p.stride()
        assert view.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()
    bucket.views[1].fill_(7.0)  # params[0] sits right after params[2] (5 elements)
    assert torch.equal(bucket.buffer[5:11], torch.full((6,), 7.0))
    info = bucket.info(["a", "b", "c"])
    assert info.names == ["c", "a", "b"] and info.nbytes == 4 * bucket.numel
