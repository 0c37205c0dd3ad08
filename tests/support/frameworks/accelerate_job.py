"""An Accelerate job for ``tests/operations/test_frameworks.py``: a tiny model, 4 micro-batches with
gradient accumulation at 2 ranks on CPU, started by Accelerate's own launcher.

    accelerate launch --multi_gpu --num_processes 2 accelerate_job.py OUT [--install]
    python -m miniddp.run -m accelerate.commands.launch --multi_gpu ... accelerate_job.py OUT

Every rank writes ``OUT/rank{r}.pt``: the class ``prepare`` wrapped the model in, the
parameters before and after training. ``--install`` calls ``miniddp.install()`` first.
"""

import sys

if "--install" in sys.argv:
    import miniddp

    miniddp.install()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

if __name__ == "__main__":
    out = sys.argv[1]
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    initial = [p.detach().clone() for p in net.parameters()]
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(32, 8, generator=g),
                                    torch.randn(32, 2, generator=g)), batch_size=4)
    model, optimizer, data = accelerator.prepare(
        net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), data)
    for x, y in data:  # 4 micro-batches a rank: 2 optimizer steps, 2 backwards under no_sync
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    trained = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    torch.save({"class": f"{type(model).__module__}.{type(model).__name__}",
                "initial": initial, "params": trained},
               f"{out}/rank{accelerator.process_index}.pt")
