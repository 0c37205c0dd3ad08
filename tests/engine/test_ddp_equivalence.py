"""miniddp's DDP against torch's DDP: bit-identical gradients, parameters and buffers.

Every case trains both side by side on the same ranks and compares every tensor bit for bit
(dtype, shape and bits: ``checks.bits.bit_difference``) after every backward and every optimizer
step (see ``ddp_cases``). World size 2 cannot tell a wrong bucket layout from a right one
(a + b == b + a); 3 and 4 can, because gloo's ring sums an element in an order that depends on
its offset in the bucket.
"""

import math

import pytest
import torch.distributed as dist
from ddp_cases import compare_with_torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miniddp.torch_versions import TORCH_AVERAGES_PARAMETERS_USED_ONLY_IN_NO_SYNC

TWO_BUCKETS_MB = 4000 / 2**20  # for the default 16-32-32-4 MLP: 4 tensors, then 2

CASES = {
    "mlp": {},
    "conv_batchnorm": {"model_name": "conv_bn"},
    "conv_batchnorm_no_sync": {"model_name": "conv_bn", "micro_batches": 3},
    "tied_and_frozen": {"model_name": "tied_frozen"},
    "unused_some_ranks_and_all_ranks": {"model_name": "branchy", "find_unused_parameters": True,
                                        "steps": 6},
    "outputs_not_used_in_loss": {"model_name": "two_heads", "find_unused_parameters": True},
    "no_sync_3_micro_batches": {"micro_batches": 3},
    "one_bucket": {"bucket_cap_mb": 100},
    "two_buckets": {"bucket_cap_mb": TWO_BUCKETS_MB},
    "many_buckets": {"bucket_cap_mb": 0.0001},
    "default_cap_above_1mib": {"model_name": "big", "steps": 3},
    # torch >= 2.4: 2 MiB buckets from the first; before: 1 MiB first, then 2 MiB
    "explicit_cap_above_1mib": {"model_name": "big", "steps": 3, "bucket_cap_mb": 2},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.001},
    "gradient_as_bucket_view_zero_in_place": {"gradient_as_bucket_view": True,
                                              "set_to_none": False},
    "adam": {"optimizer": "adam", "bucket_cap_mb": 0.001},
    "gradient_penalty_with_unused_search": {"penalty": True, "find_unused_parameters": True},
    "gradient_penalty": {"penalty": True, "bucket_cap_mb": 0.001},
    "user_post_accumulate_hooks": {"user_hook": True, "bucket_cap_mb": 0.001},
    "dataclass_output_with_unused_search": {"model_name": "dataclass_out",
                                            "find_unused_parameters": True},
    "gradient_as_bucket_view_no_sync_unused": {"model_name": "branchy", "micro_batches": 3,
                                               "find_unused_parameters": True,
                                               "gradient_as_bucket_view": True},
    "gradient_as_bucket_view_tied_frozen": {"model_name": "tied_frozen",
                                            "gradient_as_bucket_view": True},
    "gradient_as_bucket_view_conv_batchnorm_no_sync": {"model_name": "conv_bn",
                                                       "micro_batches": 3,
                                                       "gradient_as_bucket_view": True},
    "no_sync_with_unused": {"model_name": "branchy", "find_unused_parameters": True,
                            "micro_batches": 3},
    # the two ways a gradient enters its bucket (the CPU default picks by size)
    "each_gradient_copied_as_it_arrives": {"copy_at_end": -1, "bucket_cap_mb": 0.002,
                                           "micro_batches": 2},
    "buckets_copied_in_with_their_last_gradient": {"copy_at_end": math.inf, "model_name": "big",
                                                   "steps": 3},
    "buckets_copied_in_with_their_last_gradient_unused": {
        "copy_at_end": math.inf, "model_name": "branchy", "find_unused_parameters": True,
        "steps": 6},
    # every gradient alone in its bucket
    "lone_gradients_no_sync": {"bucket_cap_mb": 0.0001, "micro_batches": 2},
    "lone_gradients_not_contiguous": {"model_name": "strided", "bucket_cap_mb": 0.0001,
                                      "micro_batches": 2, "set_to_none": False},
    "lone_gradients_laid_out_unlike_their_parameters": {
        "model_name": "strided", "bucket_cap_mb": 0.0001, "contiguous_grads": True,
        "set_to_none": False},
    "lone_gradients_sharing_memory": {"model_name": "shared_grads", "bucket_cap_mb": 0.00001},
    "lone_gradients_sharing_memory_clipped": {"model_name": "shared_grads",
                                              "bucket_cap_mb": 0.00001, "clip": 0.01},
    "lone_gradients_sharing_memory_zeroed_in_place": {"model_name": "shared_grads",
                                                      "bucket_cap_mb": 0.00001,
                                                      "set_to_none": False},
    # the cases above whose buckets hold several gradients, with one gradient per bucket
    "lone_gradients_user_post_accumulate_hooks": {"user_hook": True, "bucket_cap_mb": 0.00001},
    "lone_gradients_gradient_penalty": {"penalty": True, "bucket_cap_mb": 0.00001},
    "lone_gradients_adam": {"optimizer": "adam", "bucket_cap_mb": 0.00001},
    "lone_gradients_tied_frozen": {"model_name": "tied_frozen", "bucket_cap_mb": 0.00001},
    "lone_gradients_conv_batchnorm_no_sync": {"model_name": "conv_bn", "micro_batches": 3,
                                              "bucket_cap_mb": 0.00001},
    "lone_gradients_as_bucket_views": {"gradient_as_bucket_view": True, "set_to_none": False,
                                       "bucket_cap_mb": 0.00001},
}

EXPECTED_BUCKETS = {"one_bucket": 1, "two_buckets": 2}


def check(results, case=""):
    for rank, result in enumerate(results):
        assert result["problems"] == [], f"{case}: rank {rank} differs from torch's DDP"
    first = results[0]
    assert first["layouts"][-1] == first["torch_layout"], "bucket layout differs from torch's"
    assert all(r["layouts"] == first["layouts"] for r in results), "ranks disagree on buckets"


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_bit_identical_to_torch_ddp(ranks, world_size, case):
    if case == "no_sync_with_unused" and not TORCH_AVERAGES_PARAMETERS_USED_ONLY_IN_NO_SYNC:
        pytest.skip("torch < 2.4 leaves a parameter used only inside no_sync unsynchronized "
                    "(replicas drift apart); miniddp averages it as torch >= 2.4 does "
                    "(test_ddp_behaviour checks that without torch)")
    results = ranks(world_size).run(compare_with_torch, **CASES[case])
    check(results, case)
    if case in EXPECTED_BUCKETS:
        assert len(results[0]["layouts"][-1]) == EXPECTED_BUCKETS[case]
    if case == "many_buckets":
        assert len(results[0]["layouts"][-1]) >= 4


def test_default_cap_uses_small_first_bucket_then_rebuilds(ranks):
    layouts = ranks(2).run(compare_with_torch, model_name="big", steps=3)[0]["layouts"]
    assert len(layouts[0]) == 1, "iteration 0 must use a single bucket"
    assert len(layouts[-1]) > 1, "buckets must be rebuilt in gradient-ready order"
    # ready order is last layer first, bias before weight; the first bucket closes at 6.weight,
    # the first tensor that takes it to 1 MiB (512 x 512 floats); the rest fit in 25 MiB
    assert layouts[-1] == [[9, 8, 7, 6], [5, 4, 3, 2, 1, 0]]


@pytest.mark.parametrize("copy_at_end", [None, -1, math.inf], ids=["default", "one_by_one",
                                                                 "with_the_last"])
@pytest.mark.parametrize("sabotage", ["divide", "layout"])
def test_comparison_catches_a_wrong_reducer(ranks, sabotage, copy_at_end):
    """Negative control: a subtly wrong miniddp must be caught at world size 3, whichever way
    its gradients enter their buckets."""
    results = ranks(3).run(compare_with_torch, model_name="big", steps=2, sabotage=sabotage,
                           copy_at_end=copy_at_end)
    assert any(r["problems"] for r in results), f"sabotage {sabotage!r} went unnoticed"


def test_comparison_catches_a_wrong_reducer_with_a_bucket_per_parameter(ranks):
    """Negative control: every parameter alone in its bucket."""
    results = ranks(3).run(compare_with_torch, model_name="big", steps=2, sabotage="divide",
                           bucket_cap_mb=0.0001)
    assert any(r["problems"] for r in results), "dividing went unnoticed"


@settings(max_examples=12, deadline=None, derandomize=True)
@given(world_size=st.sampled_from([2, 3, 4]), width=st.integers(1, 48),
       depth=st.integers(1, 4),
       cap_bytes=st.one_of(st.none(), st.just(1), st.integers(64, 20_000)),
       optimizer=st.sampled_from(["sgd", "adam"]),
       as_view=st.booleans(), copy_at_end=st.sampled_from([None, -1, math.inf]))
def test_property_random_models_match_torch(ranks, world_size, width, depth, cap_bytes,
                                            optimizer, as_view, copy_at_end):
    cap = None if cap_bytes is None else cap_bytes / 2**20
    results = ranks(world_size).run(compare_with_torch, width=width, depth=depth, steps=3,
                                    optimizer=optimizer, bucket_cap_mb=cap,
                                    gradient_as_bucket_view=as_view, copy_at_end=copy_at_end)
    check(results)


def compare_in_subgroups():
    """Rank 0 alone, ranks {1, 2, 3} together: that group's rank 0 is global rank 1, and at
    size 3 its ring's summation order depends on the bucket layout."""
    groups = [dist.new_group([0]), dist.new_group([1, 2, 3])]
    result = compare_with_torch(process_group=groups[min(dist.get_rank(), 1)],
                                bucket_cap_mb=0.001, model_name="conv_bn")
    for group in groups:
        dist.destroy_process_group(group)
    return result


def test_bit_identical_on_a_subgroup(ranks):
    check(ranks(4).run(compare_in_subgroups), "subgroups")
