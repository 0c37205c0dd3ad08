"""Lesson 00: the training loop, in one process, before anything is distributed.

What this adds: nothing distributed yet. This is the loop that every later lesson splits across
processes: data, model, optimizer, then for each batch forward, loss, backward, step.

Why it matters: it is the oracle. Data-parallel training is correct when it computes what this
loop computes. Checking that needs two things, both proved here:

1. the loop really learns: the inputs are labelled by a hidden "teacher" network
   (``course.data``), so the held-out loss must fall far below where it started;
2. the loop is deterministic: run it twice from the same seeds and the final weights are equal
   bit for bit. A distributed version that differs from this run by one bit is then a finding,
   not noise. (A run with another data-order seed ends elsewhere, so the equality is no accident.)

Run it:

    python lessons/00_one_process.py          # CPU, or the GPU automatically when there is one

One process only: there is no torchrun command for this lesson (torchrun would start N copies
that each train alone).

What you will see: a line every few dozen steps (step, loss, milliseconds per step) with the loss
falling about 40-fold, the held-out loss before and after, a loss curve in
``runs/00_one_process.png`` when matplotlib is installed, and ``OK: ...``. About 10 s on a
2-core machine, a third of it importing torch.
"""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from course.data import make_dataset, make_model
from course.report import Progress, check, ok, plot_losses, print0

EPOCHS = 10
BATCH_SIZE = 64
LR = 0.2


def train(shuffle_seed: int, device: str, verbose: bool = True):
    """Train a fresh student; return it and the loss of every step."""
    data = make_dataset(n=2048, seed=0)
    loader = DataLoader(data, batch_size=BATCH_SIZE, shuffle=True,
                        generator=torch.Generator().manual_seed(shuffle_seed))
    model = make_model(seed=0).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    progress = Progress(EPOCHS * len(loader), every=50, quiet=not verbose)

    for _epoch in range(EPOCHS):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            progress(loss)

    return model, progress.losses()


def held_out_loss(model) -> float:
    """Mean squared error on 1024 samples the model never trained on."""
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in make_dataset(n=1024, seed=1).tensors)
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def same_weights(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def main():
    torch.set_num_threads(1)  # one core per process: the habit every later lesson needs
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print0(f"training on {device}")

    model, losses = train(shuffle_seed=0, device=device)
    before = held_out_loss(make_model(seed=0).to(device))
    after = held_out_loss(model)
    print0(f"held-out loss: {before:.4f} before training, {after:.5f} after")
    check(after < 0.1 * before,
          f"the model did not learn: held-out loss {after:.4f} is not below 10% of {before:.4f}")
    check(losses[-1] < 0.1 * losses[0],
          f"training loss went from {losses[0]:.4f} to {losses[-1]:.4f}, not below 10% of it")

    again, _ = train(shuffle_seed=0, device=device, verbose=False)
    check(same_weights(model, again),
          "two identical runs ended with different weights: something in the loop is random")
    other, _ = train(shuffle_seed=1, device=device, verbose=False)
    check(not same_weights(model, other),
          "a different data order gave the very same weights: the comparison proves nothing")
    print0("a second identical run ended with the same weights, bit for bit; "
           "another data order did not")

    plot_losses("00_one_process", {"training loss": losses}, title="Lesson 00: one process")
    ok(f"held-out loss fell to {100 * after / before:.1f}% of its start; the run is deterministic")


if __name__ == "__main__":
    main()
