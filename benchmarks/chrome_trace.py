"""One synchronized step of miniddp's DDP on 2 ranks as a Chrome trace, and its picture.

Writes ``chrome_trace-cpu-gloo-ws2.json`` (``miniddp.checks.chrome_trace``: open it in
https://ui.perfetto.dev or chrome://tracing) and ``chrome_trace-cpu-gloo-ws2.png``, drawn from
that JSON file alone (``draw``): what the picture shows is what the trace says. A correctness
check first: after the step the ranks hold the same gradients.

    python benchmarks/chrome_trace.py                     # into benchmarks/results/
    python benchmarks/chrome_trace.py --out /tmp/trace    # elsewhere
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import miniddp
from course.report import save_figure
from miniddp.checks.chrome_trace import save_chrome_trace
from miniddp.launch import launch

RESULTS = Path(__file__).resolve().parent / "results"
TAG = "chrome_trace-cpu-gloo-ws2"
WIDTH, LAYERS, CAP_MB = 512, 6, 1.0  # a bucket per layer or so, each all_reduce visible


def one_step(path: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())]
    ddp = miniddp.DistributedDataParallel(nn.Sequential(*layers), bucket_cap_mb=CAP_MB)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(64, WIDTH, generator=g), torch.randn(64, WIDTH, generator=g)
    for _ in range(3):  # the rebuild, then warm
        F.mse_loss(ddp(x), y).backward()
    ddp.zero_grad()
    loss = F.mse_loss(ddp(x), y)
    ddp.reducer.timeline = []
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
    everyone = [torch.empty_like(grads) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, grads)
    if not all(torch.equal(everyone[0], other) for other in everyone):
        raise SystemExit("the ranks' gradients differ after the step")
    save_chrome_trace(path, ddp.reducer.timeline, ddp.buckets)


def rows_of(trace: dict) -> dict:
    """(pid, tid) -> its label, from the trace's metadata events, ranks in order."""
    names = {(e["pid"], e["tid"] if e["name"] == "thread_name" else None): e["args"]["name"]
             for e in trace["traceEvents"] if e["ph"] == "M" and "name" in e["args"]}
    tracks = sorted(k for k in names if k[1] is not None)
    return {k: f"{names[k[0], None]}: {names[k]}" for k in tracks}


def draw(trace: dict, ax) -> None:
    """Each track a row, as a trace viewer shows it: spans as bars, marks as ticks."""
    rows = rows_of(trace)
    row = {track: i for i, track in enumerate(rows)}
    colours = {"gradients arriving": "lightgray", "end of backward: wait, write back": "wheat"}
    marks = {"backward end": ("v", "black"), "finalized": ("x", "black")}
    for e in trace["traceEvents"]:
        y, ms = row.get((e["pid"], e["tid"])), e.get("ts", 0) / 1e3
        if e["ph"] == "X":
            colour = colours.get(e["name"], f"C{e['args'].get('bucket', 0) % 10}")
            ax.barh(y, e["dur"] / 1e3, left=ms, height=0.6, color=colour, edgecolor="black",
                    linewidth=0.3)
            if "bucket" in e["args"]:
                ax.text(ms + e["dur"] / 2e3, y, str(e["args"]["bucket"]), ha="center",
                        va="center", fontsize=6)
        elif e["ph"] == "i":
            shape, colour = marks.get(e["name"], ("|", "C3" if e["name"].startswith("waited")
                                                  else "black"))
            ax.plot([ms], [y - 0.42], marker=shape, color=colour, markersize=4)
    ax.set_yticks(range(len(rows)), list(rows.values()), fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="ms (the ranks aligned at a barrier)",
           title="one step on 2 ranks (gloo), miniddp's Chrome trace: all_reduce of bucket k "
                 "from launch to done;\n| a gradient ready, v backward end, red | bucket "
                 "waited for, x backward() returns")
    ax.title.set_fontsize(7)


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    path = args.out / f"{TAG}.json"
    launch(one_step, 2, args=(str(path),), backend="gloo")
    trace = json.loads(path.read_text())
    save_figure(TAG, lambda ax: draw(trace, ax), args.out)
    print(f"saved {path}: open it in https://ui.perfetto.dev or chrome://tracing")
    return path


if __name__ == "__main__":
    main()
