"""On a GPU machine: miniddp's DDP on CUDA tensors with NCCL, against torch's (skipped on CPU).

NCCL refuses two ranks on one GPU, so with one GPU this runs NCCL at world size 1 (every hook,
bucket and collective still runs) and two ranks sharing the GPU over gloo, which stages CUDA
tensors through host memory.
"""

import pytest
import torch
import torch.distributed as dist
from ddp_cases import compare_with_torch

from miniddp.launch import spawn

# device_count() asks NVML without initializing CUDA, which forked ranks could not survive.
needs_gpu = pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA GPU")


def compare_on_gpu(kwargs):
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return compare_with_torch(device=device, device_ids=[device.index], **kwargs)


@needs_gpu
@pytest.mark.parametrize("case", [{}, {"bucket_cap_mb": 0.0001}, {"model_name": "conv_bn"},
                                  {"model_name": "branchy", "find_unused_parameters": True},
                                  {"gradient_as_bucket_view": True, "micro_batches": 3}])
def test_nccl_bit_identical_to_torch(case):
    results = spawn(compare_on_gpu, 1, args=(case,), backend="nccl", timeout=180)
    assert results[0]["problems"] == []
    assert results[0]["layouts"][-1] == results[0]["torch_layout"]


@needs_gpu
def test_two_ranks_share_one_gpu_over_gloo():
    results = spawn(compare_on_gpu, 2, args=({"bucket_cap_mb": 0.001},), backend="gloo",
                    timeout=180)
    assert all(r["problems"] == [] for r in results)


# ----- communication hooks on CUDA (miniddp.options.comm_hooks), under torch's own hook names -----

def compare_hook_on_gpu(hook, kwargs):
    from test_comm_hooks import compare_hook  # the CPU suite's side-by-side loop

    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return compare_hook(hook, device=device, device_ids=[device.index], **kwargs)


@needs_gpu
@pytest.mark.parametrize("hook", ["bf16_compress_hook", "bf16_compress_wrapper",
                                  "miniddp_bf16_compress", "powerSGD_hook",
                                  "fp16_compress_wrapper_powerSGD"])
@pytest.mark.parametrize("kwargs", [{"bucket_cap_mb": 0.0001},
                                    {"model_name": "branchy", "find_unused_parameters": True,
                                     "steps": 5, "bucket_cap_mb": 0.0001}])
def test_nccl_hooks_bit_identical_to_torch(hook, kwargs):
    """bf16 hooks under their own names (torch's DDP accepts them with CUDA and NCCL), and
    PowerSGD with several buckets in flight (on gloo only one works, even in torch's DDP).

    With the branchy model, torch's own PowerSGD gives NaN: the branch is used at steps 0 and
    3 only, so the low-rank state of ``sometimes.weight`` is built from zero gradients, and its
    gradient at step 3 and the parameter from then on are NaN in torch's DDP and in miniddp
    alike (the first GPU run, 2026-11-24). The comparison is bit for bit (``bits``), so the
    same NaN on both sides is equal, and a NaN on one side only is still a difference."""
    results = spawn(compare_hook_on_gpu, 1, args=(hook, kwargs), backend="nccl", timeout=180)
    assert results[0]["problems"] == [] and results[0]["dtypes"] == []


# ----- SyncBatchNorm (refused on the CPU as torch refuses it:
# tests/options/test_sync_batchnorm.py) -----

@needs_gpu
def test_sync_batchnorm_on_gpu_bit_identical_to_torch():
    """A GPU module with SyncBatchNorm is accepted and trains as under torch's DDP: over NCCL
    with a rank per GPU (up to 2; one rank alone normalizes with its own batch), and with two
    ranks sharing one GPU over gloo, which gathers each rank's batch statistics."""
    case = {"model_name": "conv_sync_bn", "micro_batches": 2, "bucket_cap_mb": 0.0001}
    nccl_ranks = min(torch.cuda.device_count(), 2)
    for world_size, backend in ((nccl_ranks, "nccl"), (2, "gloo")):
        results = spawn(compare_on_gpu, world_size, args=(case,), backend=backend, timeout=180)
        assert all(r["problems"] == [] for r in results), backend
        assert all(r["layouts"][-1] == r["torch_layout"] for r in results), backend
