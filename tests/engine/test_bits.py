"""The suite's comparison with torch is bit for bit: identical NaNs are equal, nothing else is.

On a GPU, torch's own PowerSGD gives NaN for a parameter that only ever received zero gradients
(tests/engine/test_ddp_cuda.py), and miniddp gives the same NaN: ``torch.equal`` called that a
difference. Here the same situation is made on the CPU, in a tensor and in a whole DDP run.
"""

import pytest
import torch
from ddp_cases import compare_with_torch

from miniddp.checks.bits import all_same_bits, bit_difference, same_bits

NAN = float("nan")


def test_the_same_nan_on_both_sides_is_equal_where_torch_equal_says_not():
    a = torch.tensor([1.0, NAN, -2.5])
    assert not torch.equal(a, a.clone()), "torch.equal changed? then this test means less"
    assert same_bits(a, a.clone()) and bit_difference(a, a.clone()) is None


def test_powersgd_like_nan_zero_over_zero_on_both_sides_is_equal():
    """PowerSGD orthogonalizes a zero matrix: 0 / 0 (its norm), the same NaN on both sides."""
    p = torch.zeros(4, 2)
    ours, theirs = p / p.norm(), p / torch.linalg.vector_norm(p)
    assert ours.isnan().all() and same_bits(ours, theirs)


def test_nan_on_one_side_only_is_a_difference():
    a = torch.tensor([1.0, 2.0, 3.0])
    b = a.clone()
    b[1] = NAN
    difference = bit_difference(a, b)
    assert difference is not None and "NaN on one side only in 1" in difference
    assert not same_bits(b, a)


def test_nans_of_other_bits_differ():
    """A NaN with another sign or payload is other bits: whatever made it computed otherwise."""
    a = torch.tensor([NAN])
    assert not same_bits(a, -a)
    assert not same_bits(a, torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                   torch.complex64, torch.int64, torch.int8, torch.bool])
def test_every_dtype_compares_by_its_bits(dtype):
    a = torch.tensor([0.0, 1.0, 3.0]).to(dtype)
    b = a.clone()
    assert same_bits(a, b)
    b[2] = torch.tensor(2.0).to(dtype) if dtype != torch.bool else False
    assert not same_bits(a, b)


def test_signed_zero_dtype_and_shape_are_differences_torch_equal_misses():
    assert torch.equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert "dtype" in bit_difference(torch.ones(2), torch.ones(2).half())
    assert "shape" in bit_difference(torch.ones(2), torch.ones(1, 2))


def test_views_and_lists_of_tensors():
    x = torch.randn(3, 4)
    assert same_bits(x.t(), x.clone().t()) and same_bits(x[:, 1], x.clone()[:, 1])
    assert all_same_bits([x, x[0]], [x.clone(), x[0].clone()])
    assert not all_same_bits([x], [x, x]), "a missing tensor is a difference"


# ----- the same in a whole training run beside torch's DDP (ddp_cases, every step) -----

def test_nan_in_both_ddps_is_bit_identical(ranks):
    """A NaN in a weight both DDPs start from spreads through every gradient and step on both
    sides; both compute it the same way, so nothing is reported."""
    for result in ranks(2).run(compare_with_torch, nan=True, steps=2):
        assert result["problems"] == []


def test_nan_in_miniddp_only_is_reported(ranks):
    """Negative control: the same NaN in miniddp's copy alone is a difference at once."""
    for result in ranks(2).run(compare_with_torch, sabotage="nan_in_ours", steps=2):
        assert result["problems"] and "NaN on one side only" in result["problems"][0]
