"""A training script written for torch's DistributedDataParallel, snapshots and resume included.

It is what a torch tutorial script looks like once its usual bugs are fixed: the sampler's
``set_epoch`` is called every epoch, the snapshot holds the optimizer as well as the weights, it
is written by rank 0 through a temporary file and ``os.replace`` (a crash mid-write leaves the old
one), read with ``weights_only=True``, and it records the epochs *completed*, so a resume does not
repeat the last one. It knows nothing of miniddp.

Swap its two imports marked below for

    from miniddp import DistributedDataParallel as DDP
    from miniddp import DistributedSampler

and it runs unchanged, to the same final weights bit for bit (``tests/operations/test_faults.py``
does
exactly that, resume included). Run it:

    torchrun --standalone --nproc_per_node=2 examples/torch_ddp_train.py --snapshot /tmp/s.pt

Run it again with more ``--epochs`` and it resumes from the snapshot.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP  # swap me
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler  # swap me


def make_data(n: int = 512) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 2, generator=g)
    return TensorDataset(x, torch.sin(x @ w))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--snapshot", default="snapshot.pt")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    dataset = make_data()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    epochs_run = 0
    if os.path.exists(args.snapshot):
        snapshot = torch.load(args.snapshot, map_location=device, weights_only=True)
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        epochs_run = snapshot["epochs_run"]
        if rank == 0:
            print(f"resuming after epoch {epochs_run}")
    model = DDP(model, device_ids=[local_rank] if use_cuda else None)

    for epoch in range(epochs_run, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        if rank == 0:
            print(f"epoch {epoch} loss {loss.item():.5f}")
            snapshot = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epochs_run": epoch + 1}
            torch.save(snapshot, args.snapshot + ".tmp")
            os.replace(args.snapshot + ".tmp", args.snapshot)
        dist.barrier()

    if rank == 0 and args.out:
        torch.save(model.module.state_dict(), args.out)
    # Free DDP before the group. Otherwise torch's DDP (its C++ Reducer) drops the last reference
    # to the gloo group while holding the GIL, and gloo's destructor waits for a worker thread
    # that needs the GIL: an occasional hang at exit (pytorch issue 56297).
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
