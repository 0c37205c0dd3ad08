"""What a lesson shows the learner: progress lines, the checks that prove it, a saved picture.

Conventions every lesson follows:

* Only rank 0 prints (:func:`print0`); N ranks printing the same line teach nothing.
* A printed loss is the mean over all ranks (:func:`mean_over_ranks`): rank 0's own loss is the
  loss of a quarter of the batch on four ranks, and looks better or worse than training really is.
* A lesson proves its claim with :func:`check`, which raises :class:`CheckFailed` with a message
  saying what went wrong, so the script exits non-zero; its very last line is :func:`ok`'s
  ``OK: ...``. ``lessons/run_course.py`` and the tests rely on exactly that.
* Pictures go to ``runs/`` at the repository root (gitignored), or to ``$MINIDDP_RUNS``.

``print0``, ``is_main`` and ``mean_over_ranks`` are the reference job's (``miniddp.train.report``),
named here too so that a lesson imports what it shows from one place.

Functions that average over ranks are collectives: when a process group exists every rank must
call them, in the same order, or the ranks that did wait for the ones that did not.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager, redirect_stderr
from pathlib import Path

import torch
import torch.distributed as dist

from miniddp.launch import rank_device
from miniddp.train.report import is_main, mean_over_ranks, print0

__all__ = ["CheckFailed", "Progress", "check", "cpp_stderr", "is_main", "mean_over_ranks", "ok",
           "plot_losses", "print0", "runs_dir", "save_figure"]


class CheckFailed(AssertionError):
    """A lesson's claim turned out false; the message says which and by how much."""


def check(condition: bool, message: str) -> None:
    """Raise :class:`CheckFailed` with ``message`` unless ``condition`` holds.

    Unlike ``assert``, it still runs under ``python -O``, and a lesson reads as a list of claims.
    """
    if not condition:
        raise CheckFailed(message)


def ok(message: str) -> None:
    """Print the lesson's final ``OK: message`` line (rank 0 only)."""
    print0(f"OK: {message}")


class Progress:
    """One line every ``every`` steps on rank 0: step, loss averaged over ranks, ms per step.

    Call it once per step with that step's loss. It keeps every loss on this rank without
    synchronising (no ``.item()`` per step, which would stall a GPU), and averages over ranks
    only on the steps it prints. A collective: every rank calls it on every step, with the same
    ``every`` and ``quiet``. ``quiet=True`` prints nothing (a rerun that only has to be compared).
    """

    def __init__(self, total_steps: int, every: int | None = None, quiet: bool = False):
        self.total_steps, self.quiet = total_steps, quiet
        self.every = every or max(1, total_steps // 10)
        self._local: list[torch.Tensor] = []
        self._since, self._since_step = time.perf_counter(), 0

    def __call__(self, loss: torch.Tensor) -> None:
        step = len(self._local)
        self._local.append(loss.detach().float().reshape(()))
        if not self.quiet and (step % self.every == 0 or step == self.total_steps - 1):
            mean = mean_over_ranks(loss)
            now = time.perf_counter()
            ms = 1000 * (now - self._since) / (step + 1 - self._since_step)
            self._since, self._since_step = now, step + 1
            width = len(str(self.total_steps))
            print0(f"step {step:>{width}}/{self.total_steps} | loss {mean:.5f} | {ms:7.2f} ms/step")

    def losses(self) -> list[float]:
        """Every step's loss, averaged over ranks: one all_reduce for the whole run."""
        if not self._local:
            return []
        t = torch.stack(self._local).to(torch.float64)
        if dist.is_available() and dist.is_initialized():
            t = t.to(rank_device())
            dist.all_reduce(t)
            t /= dist.get_world_size()
        return t.tolist()


def runs_dir() -> Path:
    """``$MINIDDP_RUNS``, else ``runs/`` in the repository that holds this package, else ./runs."""
    if os.environ.get("MINIDDP_RUNS"):
        return Path(os.environ["MINIDDP_RUNS"])
    repo = Path(__file__).resolve().parents[1]
    return repo / "runs" if (repo / "pyproject.toml").exists() else Path("runs")


def save_figure(name: str, draw: Callable, out_dir: str | Path | None = None) -> Path | None:
    """Call ``draw(ax)`` on a fresh figure and save it as ``<out_dir>/<name>.png`` (rank 0 only).

    Matplotlib is optional (``pip install matplotlib``): without it the picture is skipped with a
    line saying so, and the lesson goes on. Returns the path written, or None.
    """
    if not is_main():
        return None
    path = Path(out_dir or runs_dir()) / f"{name}.png"
    try:
        from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
    except ImportError:
        print0(f"matplotlib is not installed: skipped {path} (pip install matplotlib)")
        return None
    fig = Figure(figsize=(6, 4), layout="constrained")
    draw(fig.subplots())
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print0(f"saved {path}")
    return path


def plot_losses(name: str, curves: dict[str, Sequence[float]], title: str = "") -> Path | None:
    """Save loss-per-step curves, one per label, on a log scale (where a falling loss shows)."""

    def draw(ax):
        for label, losses in curves.items():
            ax.plot(range(len(losses)), losses, label=label)
        ax.set(xlabel="step", ylabel="loss", yscale="log", title=title)
        ax.legend()

    return save_figure(name, draw)


@contextmanager
def cpp_stderr(into: list):
    """Keep what this process writes to its stderr meanwhile, C++ included: appends one string.

    For a lesson that explains a warning a DDP prints instead of raising as a Python warning
    (torch's from C++, ``TORCH_WARN`` in reducer.cpp; miniddp's the same way, through
    ``sys.stderr``): ``warnings.catch_warnings`` cannot catch those. File descriptor 2 is
    pointed elsewhere for a moment, for C++; ``sys.stderr`` too, for Python, since it need not
    write to descriptor 2 (under pytest, or in a rank forked from it, it does not)."""
    sys.stderr.flush()
    saved = os.dup(2)
    python_side = io.StringIO()
    with tempfile.TemporaryFile() as file:
        os.dup2(file.fileno(), 2)
        try:
            with redirect_stderr(python_side):
                yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            file.seek(0)
            into.append(file.read().decode(errors="replace") + python_side.getvalue())
