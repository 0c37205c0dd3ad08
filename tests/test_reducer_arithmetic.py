"""The reducer's scaling gives torch's bits: ``grad * (1 / world_size)`` with a Python float.

miniddp multiplies float32 gradients by a cached 0-dim float32 tensor instead (cheaper from
Python); the kernel reads either as the same float32, so the products must be equal bit for bit,
for every divisor and every value, including subnormals, infinities and NaN.
"""

import torch
from bits import same_bits
from hypothesis import given, settings
from hypothesis import strategies as st

from miniddp.reducer import Reducer

FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


class _Divisor:
    """Just what ``Reducer._reciprocal`` reads."""

    def __init__(self, divisor):
        self.divisor, self._reciprocals = divisor, {}


@settings(deadline=None, max_examples=200, derandomize=True)
@given(divisor=st.integers(1, 4096), values=st.lists(FLOAT32, min_size=1, max_size=64),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
def test_the_cached_reciprocal_multiplies_as_torchs_python_float(divisor, values, dtype):
    grad = torch.tensor(values, dtype=torch.float32).to(dtype)
    ours, torchs = torch.empty_like(grad), torch.empty_like(grad)
    torch.mul(grad, Reducer._reciprocal(_Divisor(divisor), dtype), out=ours)
    torch.mul(grad, 1.0 / divisor, out=torchs)
    assert same_bits(ours, torchs)  # NaN included: the same NaN, bit for bit


def test_a_reciprocal_rounded_to_the_gradients_dtype_first_would_be_caught():
    """Control: a float16 scalar (1/3 rounded to half first) gives other bits than torch's."""
    grad = torch.randn(10000).half()
    ours, torchs = torch.empty_like(grad), torch.empty_like(grad)
    torch.mul(grad, torch.tensor(1 / 3, dtype=torch.float16), out=ours)
    torch.mul(grad, 1 / 3, out=torchs)
    assert not same_bits(ours, torchs)
