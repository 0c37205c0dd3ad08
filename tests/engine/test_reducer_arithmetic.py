"""The reducer's scaling gives torch's bits: ``grad * (1 / world_size)`` with a Python float.

miniddp multiplies float32 gradients by a cached 0-dim float32 tensor instead (cheaper from
Python); the kernel reads either as the same float32, so the products must be equal bit for bit,
for every divisor and every value, including subnormals, infinities and NaN. A bucket whose
gradients wait for its last one (on a GPU every bucket, on a CPU one of small gradients) has
them copied in together and is then multiplied by that same reciprocal: the same operand for
every element, so again the same bits.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miniddp.checks.bits import same_bits
from miniddp.reducer import Reducer

FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@st.composite
def float32_tensors(draw, min_size: int, max_size: int) -> torch.Tensor:
    """Between ``min_size`` and ``max_size`` float32 values: random bits (every pattern alike
    likely: NaN payloads, subnormals, values whose products underflow), with hypothesis's
    favourite floats (infinities, signed zeros, the extremes) placed at drawn positions.
    Drawing the floats one by one instead costs tens of times more for the same mix."""
    n = draw(st.integers(min_size, max_size))
    values = torch.frombuffer(bytearray(draw(st.binary(min_size=4 * n, max_size=4 * n))),
                              dtype=torch.float32)
    for index, value in draw(st.lists(st.tuples(st.integers(0, n - 1), FLOAT32), max_size=24)):
        values[index] = value
    return values


class _Divisor:
    """Just what ``Reducer._reciprocal`` and ``Reducer._scale`` read."""

    _reciprocal, _scale = Reducer._reciprocal, Reducer._scale

    def __init__(self, divisor):
        self.divisor, self._reciprocals = divisor, {}


def copy_then_scale(views, grads, buffer, divisor):
    """What the reducer does with a bucket whose gradients waited for its last one."""
    torch._foreach_copy_(views, grads)
    _Divisor(divisor)._scale(buffer, buffer)


@settings(deadline=None, max_examples=200, derandomize=True)
@given(divisor=st.integers(1, 4096), values=float32_tensors(1, 64),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
def test_the_cached_reciprocal_multiplies_as_torchs_python_float(divisor, values, dtype):
    grad = values.to(dtype)
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


# --- a bucket's gradients copied in with its last one, then scaled (copy_buckets_at_end) ---

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@settings(deadline=None, max_examples=100, derandomize=True)
@given(divisor=st.sampled_from([2, 3, 5, 7]), dtype=st.sampled_from(DTYPES),
       sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6),
       values=float32_tensors(240, 240), empty_slot=st.booleans())
def test_copying_a_bucket_then_scaling_it_gives_the_per_parameter_products(
        divisor, dtype, sizes, values, empty_slot):
    """``copy_then_scale`` against ``torch.mul(grad, 1 / world_size)`` per gradient (torch's own
    scaling): equal bits for every value (subnormals, infinities and NaN included; see
    ``same_numbers``), with a slot that no gradient filled (zeroed) staying zero."""
    pool = values.to(dtype)
    grads, offset = [], 0
    for n in sizes:
        grads.append(pool[offset:offset + n].clone())
        offset += n
    buffer = torch.full((offset + 3 * empty_slot,), 7.0, dtype=dtype)
    views = list(buffer[:offset].split(sizes))
    buffer[offset:].zero_()  # the reducer zeroes the slot of a parameter without a gradient
    copy_then_scale(views, grads, buffer, divisor)
    expected = torch.cat([torch.mul(g, 1.0 / divisor) for g in grads] +
                         [torch.zeros(3 * empty_slot, dtype=dtype)])
    assert same_numbers(buffer, expected)


def same_numbers(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit where a value is a number (signed zeros and infinities included); NaN where
    the other is NaN. A NaN's payload is not compared: for one bfloat16 NaN, the CPU's
    vectorized loop and its scalar tail already write different payloads."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    nan = a.isnan()
    return (a.dtype == b.dtype and torch.equal(nan, b.isnan())
            and torch.equal(a.view(ints)[~nan], b.view(ints)[~nan]))


def test_dividing_the_bucket_instead_would_be_caught():
    """Control: ``bucket / 3`` (torch's batched_grad_copy) is another operation: other bits."""
    grad = torch.randn(10000)
    buffer = torch.empty(10000)
    buffer.copy_(grad)
    assert not same_numbers(buffer.div_(3), torch.mul(grad, 1 / 3))


def train_with_complete_buckets_copied_at_once(dtype_name, sabotage=False):
    """miniddp with every bucket waiting for its last gradient (a GPU's path), beside
    torch's DDP: every parameter's bits after three steps, for a model in ``dtype_name`` with
    several parameters per bucket."""
    import copy

    import torch.distributed as dist
    from torch import nn

    import miniddp
    dtype = getattr(torch, dtype_name)
    try:  # torch 2.1's gloo sends no bfloat16, and its CPU has no float16 matmul
        dist.broadcast(torch.zeros(1, dtype=dtype), 0)
        nn.functional.linear(torch.zeros(1, 2, dtype=dtype), torch.zeros(2, 2, dtype=dtype))
    except RuntimeError as error:
        if "Invalid scalar type" in str(error) or "not implemented for" in str(error):
            return None
        raise
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 24), nn.ReLU(),
                          nn.Linear(24, 4)).to(dtype)
    ours = miniddp.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.002)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.002)
    ours.reducer.copy_buckets_at_end(float("inf"))  # every bucket waits for its last gradient
    if sabotage:  # negative control: divide the bucket, as torch's batched_grad_copy does
        ours.reducer._scale = lambda source, out: torch.div(source, dist.get_world_size(),
                                                            out=out)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        x = torch.randn(8, 16, generator=g).to(dtype)
        for m, opt in zip((ours, theirs), optimizers):
            opt.zero_grad()
            m(x).float().pow(2).mean().backward()
            opt.step()
    multi = sum(len(b.param_indices) > 1 for b in ours.reducer.buckets)
    same = all(same_numbers(a.detach(), b.detach())
               for a, b in zip(ours.module.parameters(), theirs.module.parameters()))
    return same, multi


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_complete_buckets_copied_at_once_match_torch_bit_for_bit(ranks, world_size, dtype):
    results = ranks(world_size).run(train_with_complete_buckets_copied_at_once, dtype)
    if None in results:
        pytest.skip(f"this torch cannot send {dtype} over gloo, or multiply it on a CPU")
    assert all(multi > 0 for _, multi in results), "no bucket held several parameters"
    assert all(same for same, _ in results), f"{dtype} at {world_size} ranks differs from torch"


def test_a_bucket_divided_instead_is_caught_at_3_ranks(ranks):
    results = ranks(3).run(train_with_complete_buckets_copied_at_once, "float32", True)
    assert not all(same for same, _ in results)
