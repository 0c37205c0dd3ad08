"""A Lightning job for ``tests/operations/test_frameworks.py``: a tiny model, 3 steps at 2 ranks on
CPU.

    python lightning_job.py ddp|ddp_spawn|ddp_fork OUT [--install | --install-in-main]
    python -m miniddp.run lightning_job.py ddp|ddp_spawn OUT

Every rank writes ``OUT/rank{r}.pt``: the class of the DDP wrapper Lightning built, the
parameters before and after training. ``--install`` calls ``miniddp.install()`` on the first
line; ``--install-in-main`` calls it under ``if __name__ == "__main__":``, which the spawned
workers do not run.
"""

import sys

if "--install" in sys.argv:
    import miniddp

    miniddp.install()

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


class Tiny(L.LightningModule):
    def __init__(self, out: str):
        super().__init__()
        self.out = out
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 2))
        self.initial = [p.detach().clone() for p in self.net.parameters()]

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def on_train_end(self):
        wrapper = self.trainer.strategy.model
        torch.save({"class": f"{type(wrapper).__module__}.{type(wrapper).__name__}",
                    "initial": self.initial,
                    "params": [p.detach().clone() for p in self.net.parameters()]},
                   f"{self.out}/rank{self.global_rank}.pt")


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(48, 8, generator=g),
                                    torch.randn(48, 2, generator=g)), batch_size=4)


if __name__ == "__main__":
    strategy, out = sys.argv[1:3]
    if "--install-in-main" in sys.argv:
        import miniddp

        miniddp.install()
    torch.set_num_threads(1)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Tiny(out), data())
