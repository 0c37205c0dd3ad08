"""miniddp.fully_shard beside torch's FSDP2 on random models and training loops, bit for bit.

On 2-D meshes too (HSDP): a few drawn runs at 2 x 2 in the fast tier, more at 2 x 2, 2 x 3 and
3 x 2 in the slow one, and a negative control the fixed 2 x 2 runs must find (slow: about 10
examples find it).

hypothesis draws what users build (``test_fsdp_models``' descriptions): widths 1 to 23 (many
cut unevenly, or not at all on some rank, at 3 ranks), 1 to 5 blocks, some or all of them units,
units nested in units, frozen layers, tied embeddings, parameters of the root's own, dropout,
blocks returning tuples, dicts or dataclasses, mixed precision, SGD, momentum, Adam or AdamW,
accumulation with and without gradient sync, activation checkpointing of every kind (reentrant
and selective included), clipping with the 1-, 2- and inf-norms, uneven batches per rank, a block
called twice, two forwards before one backward, eval forwards, meta-device init, and the state
reloaded into a fresh model after the first step (``get_state_dict``, ``set_state_dict``).
Every rank compares its gradient shards after every backward and its parameter shards after
every step; a run torch refuses must be refused too.

The fast tier draws a fixed set of examples (``derandomize``); the slow tier more. A control
compares torch with itself (the comparison is deterministic); negative controls break miniddp
and see the fixed random runs find it. For fresh seeds, locally:
``MINIDDP_FSDP_EXAMPLES=200 python -m pytest -n 0 tests/fsdp/test_fsdp_random.py
-k fresh --hypothesis-seed=$RANDOM`` (the test named ``fresh`` is skipped without that variable).
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st
from test_fsdp import needs_torch_fsdp2
from test_fsdp_models import CHECKPOINTS, BlockSpec, ModelSpec, Run, check_identical, compare

WIDTHS = st.integers(1, 23)
PRECISIONS = [(None, None), ("bf16", None), ("bf16", "fp32"), ("fp16", "fp32"),
              ("fp16", None), (None, "bf16"), (None, "fp16"), ("bf16", "bf16")]


@st.composite
def block_specs(draw, d_in: int) -> BlockSpec:
    same_width = draw(st.booleans())
    checkpoint = draw(st.sampled_from(CHECKPOINTS))
    outputs = [""] if "reentrant" in checkpoint else ["", "", "tuple", "dict", "dataclass"]
    return BlockSpec(
        d_out=d_in if same_width else draw(WIDTHS), hidden=draw(WIDTHS),
        wrapped=draw(st.booleans()), reshard=draw(st.sampled_from([None, True, False])),
        inner_unit=draw(st.booleans()), frozen=draw(st.sampled_from(["", "", "fc1", "fc2",
                                                                      "all"])),
        gamma=draw(st.booleans()), norm=draw(st.booleans()),
        residual=same_width and draw(st.booleans()),
        checkpoint=checkpoint, twice=same_width and draw(st.booleans()),
        dropout=draw(st.booleans()), output=draw(st.sampled_from(outputs)))


@st.composite
def model_specs(draw, mixed_precision: bool) -> ModelSpec:
    """(With mixed precision the root is a unit: a plain layer beside units computing in
    another dtype fails at its matmul, under torch's FSDP2 as under miniddp's.)"""
    vocab = draw(st.sampled_from([0, 0, 5, 17]))
    d_model = draw(WIDTHS)
    blocks, d = [], d_model
    for _ in range(draw(st.integers(1, 5))):
        blocks.append(draw(block_specs(d)))
        d = blocks[-1].d_out
    tied = bool(vocab) and d == d_model and draw(st.booleans())
    return ModelSpec(
        d_in=draw(WIDTHS), vocab=vocab, d_model=d_model, blocks=tuple(blocks),
        n_out=vocab if tied else draw(st.integers(1, 9)), tied=tied,
        root_param=draw(st.sampled_from(["", "pos", "scale"])),
        frozen_stem=draw(st.booleans()), frozen_head=draw(st.booleans()),
        stem_unit=draw(st.booleans()),
        root_wrapped=mixed_precision or draw(st.sampled_from([True, True, False])),
        root_reshard=draw(st.sampled_from([None, True, False])))


@st.composite
def runs(draw) -> Run:
    param_dtype, reduce_dtype = draw(st.sampled_from(PRECISIONS))
    micro_batches = draw(st.integers(1, 3))
    clip = draw(st.one_of(st.none(), st.tuples(
        st.sampled_from([0.05, 1.0]), st.sampled_from([2.0, 2.0, 1.0, math.inf]),
        st.sampled_from([None, False]))))
    evals = ["", "", "after_step", "before_step"] + ["between_micro_batches"] * (
        micro_batches > 1)
    return Run(model=draw(model_specs(param_dtype is not None)), param_dtype=param_dtype,
               reduce_dtype=reduce_dtype,
               optimizer=draw(st.sampled_from(["sgd", "momentum", "adam", "adamw"])),
               steps=draw(st.integers(1, 3)), micro_batches=micro_batches,
               sync_micro_batches=draw(st.booleans()), clip=clip,
               batch_sizes=tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))),
               eval_at=draw(st.sampled_from(evals)), keep_gathered=draw(st.booleans()),
               zero_to_none=draw(st.booleans()), two_forwards=draw(st.booleans()),
               meta_init=draw(st.booleans()), reload=draw(st.booleans()),
               seed=draw(st.integers(0, 2**16)))


def _fixed(examples: int):
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@needs_torch_fsdp2
@pytest.mark.parametrize("world_size", [2, 3])
@_fixed(4)
@given(run=runs())
def test_random_models_train_bit_for_bit_as_torch(ranks, world_size, run):
    check_identical(ranks(world_size).run(compare, run, timeout=120), [run])


@needs_torch_fsdp2
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
@_fixed(10)
@given(run=runs())
def test_more_random_models_train_bit_for_bit_as_torch(ranks, world_size, run):
    check_identical(ranks(world_size).run(compare, run, timeout=120), [run])


@needs_torch_fsdp2
@pytest.mark.skipif("MINIDDP_FSDP_EXAMPLES" not in os.environ,
                    reason="a local search at fresh seeds: set MINIDDP_FSDP_EXAMPLES")
@pytest.mark.parametrize("world_size", [2, 3])
@settings(max_examples=int(os.environ.get("MINIDDP_FSDP_EXAMPLES", "1")), deadline=None,
          database=None, suppress_health_check=list(HealthCheck))
@given(run=runs())
def test_fresh_random_models(ranks, world_size, run):
    check_identical(ranks(world_size).run(compare, run, timeout=120), [run])


@needs_torch_fsdp2
@_fixed(2)
@given(run=runs())
def test_control_torch_beside_itself_is_bit_for_bit(ranks, run):
    """The comparison itself is deterministic: torch's FSDP2 run twice agrees with itself."""
    check_identical(ranks(3).run(compare, run, second="torch", timeout=120), [run])


def on_mesh(shape: tuple[int, int]):
    """The runs of :func:`runs`, on a 2-D mesh (HSDP) of ``shape`` (replicas, shards)."""
    return runs().map(lambda run: replace(run, mesh=shape))


@needs_torch_fsdp2
@_fixed(2)
@given(run=on_mesh((2, 2)))
def test_random_models_train_bit_for_bit_as_torch_on_a_2x2_mesh(ranks, run):
    check_identical(ranks(4).run(compare, run, timeout=120), [run])


@needs_torch_fsdp2
@pytest.mark.slow
@pytest.mark.parametrize("shape", [(2, 2), (2, 3), (3, 2)], ids=["2x2", "2x3", "3x2"])
@settings(max_examples=2, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_more_random_models_on_meshes_train_bit_for_bit_as_torch(ranks, shape, data):
    run = data.draw(on_mesh(shape))
    check_identical(ranks(shape[0] * shape[1]).run(compare, run, timeout=120), [run])


def _found_by_random_runs(ranks, breakage: str, examples: int, shape=None) -> Run:
    """The first run hypothesis draws (fixed seed) that tells miniddp, broken so, from torch's
    FSDP2 at 3 ranks (or on a mesh of ``shape``), not shrunk; NoSuchExample if none of
    ``examples`` does."""
    world = shape[0] * shape[1] if shape else 3
    return find(on_mesh(shape) if shape else runs(),
                lambda run: any(ranks(world).run(compare, run, breakage=breakage,
                                                 timeout=120)),
                settings=settings(max_examples=examples, derandomize=True, database=None,
                                  deadline=None, phases=[Phase.generate],
                                  suppress_health_check=list(HealthCheck)))


@needs_torch_fsdp2
def test_random_runs_find_the_averaging_broken(ranks):
    """Negative control: DDP's arithmetic (1/W, then the sum) in place of torch's AVG."""
    _found_by_random_runs(ranks, "scale_before_sum", examples=10)


@needs_torch_fsdp2
@pytest.mark.slow
@pytest.mark.parametrize("breakage", ["post_backward_at_the_end", "overwrite_sharded_grad"])
def test_random_runs_find_a_broken_mechanism(ranks, breakage):
    """Negative controls: every unit reduced at the end of the backward, a second synchronized
    backward overwriting the shard's grad. (The parameter order, broken, takes the random runs
    about 60 examples to find: ``test_fsdp_models`` checks it on its minimal model.)"""
    _found_by_random_runs(ranks, breakage, examples=60)


@needs_torch_fsdp2
@pytest.mark.slow
def test_random_runs_on_a_2x2_mesh_find_the_groups_in_the_other_order(ranks):
    """Negative control: HSDP all-reducing across the replicas first, then reduce-scattering."""
    _found_by_random_runs(ranks, "hsdp_replicas_first", examples=12, shape=(2, 2))
