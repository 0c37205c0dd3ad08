"""An FSDP2 training script as torch's docs write one, for ``tests/operations/test_frameworks.py``:
torch's
``fully_shard`` on each block and the root, 3 steps at 2 ranks on CPU, ranks started by
``torch.multiprocessing.spawn`` (new interpreters).

    python fsdp2_job.py OUT                  # torch's fully_shard
    python -m miniddp.run fsdp2_job.py OUT   # the same script, unmodified: miniddp's

Every rank writes ``OUT/rank{r}.pt``: the module its sharded model's class comes from, whether
it is torch's ``FSDPModule``, and its parameter shards before and after training.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard


def local(p):
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone().as_subclass(
        torch.Tensor)


def worker(rank: int, out: str, port: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 31), nn.Tanh(), nn.Linear(31, 17), nn.Tanh(),
                          nn.Linear(17, 2))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    initial = [local(p) for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.save({"class": type(model).__module__, "fsdp_module": isinstance(model, FSDPModule),
                "initial": initial, "params": [local(p) for p in model.parameters()]},
               f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    mp.spawn(worker, args=(sys.argv[1], port), nprocs=2)
