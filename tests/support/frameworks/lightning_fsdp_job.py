"""A Lightning job with ``ModelParallelStrategy`` and an unmodified FSDP2 ``configure_model``,
for ``tests/operations/test_frameworks.py``: 3 steps at 2 ranks on CPU (Lightning runs the script
again
for rank 1).

    python lightning_fsdp_job.py OUT                  # torch's fully_shard
    python -m miniddp.run lightning_fsdp_job.py OUT   # the same script: miniddp's

Every rank writes ``OUT/rank{r}.pt``: the module its sharded model's class comes from, whether
it is torch's ``FSDPModule``, and its parameter shards before and after training.
"""

import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, TensorDataset


def local(p):
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone().as_subclass(
        torch.Tensor)


class Tiny(L.LightningModule):
    def __init__(self, out: str):
        super().__init__()
        self.out = out
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 31), torch.nn.Tanh(),
                                       torch.nn.Linear(31, 2))

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)
        self.initial = [local(p) for p in self.net.parameters()]

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def on_train_end(self):
        torch.save({"class": type(self.net).__module__,
                    "fsdp_module": isinstance(self.net, FSDPModule), "initial": self.initial,
                    "params": [local(p) for p in self.net.parameters()]},
                   f"{self.out}/rank{self.global_rank}.pt")


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(48, 8, generator=g),
                                    torch.randn(48, 2, generator=g)), batch_size=4)


if __name__ == "__main__":
    torch.set_num_threads(1)
    trainer = L.Trainer(accelerator="cpu", devices=2,
                        strategy=ModelParallelStrategy(data_parallel_size=2,
                                                       tensor_parallel_size=1),
                        max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(Tiny(sys.argv[1]), data())
