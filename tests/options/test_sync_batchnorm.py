"""SyncBatchNorm: refused on the CPU where torch's DDP refuses it, with torch's phrase.

torch's DDP refuses a CPU module holding ``nn.SyncBatchNorm`` at construction ("SyncBatchNorm
layers only work with GPU modules"); without the check, miniddp accepted it and the first
training forward failed inside SyncBatchNorm. On a GPU it trains as torch's
(``tests/engine/test_ddp_cuda.py``, ``test_sync_batchnorm_on_gpu_bit_identical_to_torch``).
"""

import pytest
from ddp_cases import ConvBN
from torch import nn

import miniddp


def construction_error(cls, convert: bool):
    module = ConvBN()
    if convert:
        module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
    try:
        cls(module)
    except ValueError as error:
        return str(error)
    return None


def refusals():
    """(miniddp's message, torch's message) for the same CPU module with SyncBatchNorm."""
    return (construction_error(miniddp.DistributedDataParallel, convert=True),
            construction_error(nn.parallel.DistributedDataParallel, convert=True))


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_cpu_module_with_sync_batchnorm_is_refused_as_torch_refuses_it(ranks, world_size):
    for ours, theirs in ranks(world_size).run(refusals):
        assert theirs == "SyncBatchNorm layers only work with GPU modules"
        assert ours is not None and ours.startswith(theirs), ours
        assert "Move the module to a GPU" in ours


def test_plain_batchnorm_on_the_cpu_is_accepted(ranks):
    """Control: the refusal is about SyncBatchNorm, not about BatchNorm or the CPU."""
    for error in ranks(2).run(construction_error, miniddp.DistributedDataParallel, False):
        assert error is None
