"""``no_sync`` restores the flag it found on exit, as torch's DDP does, rather than setting True.

The two cases where the difference shows: a ``no_sync`` nested in another (the outer block must
go on accumulating after the inner one ends), and a ``no_sync`` entered while
``require_backward_grad_sync`` was already False (it must stay False). Each rank trains on its
own data, so "the ranks hold the same gradients" means "that backward synchronized". miniddp and
torch's DDP run the same script side by side; a control applies lesson 07's breakage (True on
exit) and must be told apart.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp.train.data import make_dataset, make_model

BREAKAGE_DIR = Path(__file__).resolve().parents[1] / "support" / "breakage"
DDPS = {"miniddp": miniddp.DistributedDataParallel, "torch": TorchDDP}


def grads_agree(ddp) -> bool:
    """Every rank holds the same gradients (a collective)."""
    flat = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return all(torch.equal(everyone[0], other) for other in everyone)


def nested_and_already_off(name: str) -> dict:
    """What the flag holds and whether each backward synchronized, in the two cases."""
    x, y = make_dataset(n=16, seed=dist.get_rank()).tensors
    ddp = DDPS[name](make_model(seed=0))
    seen = {}
    with ddp.no_sync():
        with ddp.no_sync():
            F.mse_loss(ddp(x), y).backward()
        seen["flag after the inner no_sync"] = ddp.require_backward_grad_sync
        F.mse_loss(ddp(x), y).backward()  # still inside the outer no_sync: local
        seen["synchronized inside the outer no_sync"] = grads_agree(ddp)
    seen["flag after the outer no_sync"] = ddp.require_backward_grad_sync

    ddp = DDPS[name](make_model(seed=0))
    ddp.require_backward_grad_sync = False  # switched off by hand, as torch's no_sync does
    with ddp.no_sync():
        pass
    seen["flag after no_sync entered with it off"] = ddp.require_backward_grad_sync
    F.mse_loss(ddp(x), y).backward()
    seen["synchronized with the flag still off"] = grads_agree(ddp)
    return seen


def with_no_sync_exiting_to_true() -> dict:
    """The control: miniddp with ``no_sync`` broken as ``no_sync_exits_to_true`` breaks it."""
    sys.path.insert(0, str(BREAKAGE_DIR))
    try:
        import breakages
    finally:
        sys.path.remove(str(BREAKAGE_DIR))
    ddp_class = miniddp.DistributedDataParallel
    restore = ddp_class.no_sync
    breakages.no_sync_exits_to_true(sys.modules[ddp_class.__module__])
    try:
        return nested_and_already_off("miniddp")
    finally:
        ddp_class.no_sync = restore


EXPECTED = {"flag after the inner no_sync": False,
            "synchronized inside the outer no_sync": False,
            "flag after the outer no_sync": True,
            "flag after no_sync entered with it off": False,
            "synchronized with the flag still off": False}


def test_torchs_no_sync_restores_the_flag_it_found(ranks):
    assert ranks(2).run(nested_and_already_off, "torch") == [EXPECTED] * 2


def test_no_sync_restores_the_flag_like_torchs_ddp(ranks):
    assert ranks(2).run(nested_and_already_off, "miniddp") == [EXPECTED] * 2


def test_control_no_sync_that_exits_to_true_is_caught(ranks):
    for seen in ranks(2).run(with_no_sync_exiting_to_true):
        assert seen["flag after the inner no_sync"] is True
        assert seen["synchronized inside the outer no_sync"] is True
        assert seen["flag after no_sync entered with it off"] is True
        assert seen["synchronized with the flag still off"] is True
