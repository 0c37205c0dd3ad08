"""What every benchmark shares: where it runs, the model, alternated timing, the results files.

A benchmark script defines ``measure(setup)``, which runs on every rank and returns rank 0's
figures as a dict, and ``plot(result, ax)``; :func:`main` does the rest:

* picks the setups (:func:`plan`): gloo on 2 CPU processes without a GPU; with one GPU, NCCL
  at world size 1 (the machinery's own overhead) and then 2 ranks sharing the GPU over gloo;
  with several GPUs, NCCL with one rank per GPU (forked, or under torchrun whatever torchrun
  started). Which device a rank computes on is decided in one place, :func:`rank_device`;
  everything else is the same code on CPU and GPU, gloo and NCCL, forked or under torchrun;
* runs ``measure`` on forked ranks with a timeout (``miniddp.launch``: a rank that raises or
  hangs is named), and writes ``results/<benchmark>-<device>-<backend>-ws<N>.json`` and a PNG.
  A benchmark that must not see its own earlier measurements in memory (``memory.py`` on CUDA,
  where NCCL and the caching allocator keep tensors of a finished run) gives ``parts``: each
  part then runs in a rank group of its own, and ``combine`` joins their figures.

Models (``--model``): the benchmark's own (:data:`MODELS`), or one from outside
(``benchmarks/models.py``): ``package.module:factory``, ``gpt2``, ``resnet50``.

Timing rules (the machine is shared; absolute times drift): contestants run in turn, one step
each per round, in a new order every round (never one step twice in a row), after untimed
warm-up steps; each step's time is the slowest rank's (``course.tools.alternate``, the timer
lesson 11 uses too);
a comparison is the median of the per-pair ratios. Every contestant is checked for correctness
(``miniddp.checks.bits``) before its numbers are reported.
"""

from __future__ import annotations

import os

# Count GPUs through NVML, so the parent never initializes CUDA before forking its ranks.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import models as outside  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from course.report import print0, save_figure  # noqa: E402
from course.tools import alternate, round_orders, slowest_rank  # noqa: E402,F401  (the lessons' too)
from miniddp.checks.bits import all_same_bits  # noqa: E402
from miniddp.ddp import move_to  # noqa: E402  (what DDP does to inputs)
from miniddp.launch import launch, launched_by_torchrun  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20
PER_PARAMETER_MB = 1 / MIB  # a 1-byte cap: every parameter closes its own bucket

CPU_WIDTHS = [512, 1024, 1024, 2048, 1024, 1024, 2048, 1024, 512, 512, 1024, 512]
WIDTHS = {"quick": [32, 64, 64, 32], "cpu": CPU_WIDTHS, "cuda": [2 * w for w in CPU_WIDTHS]}
BATCH = {"quick": 8, "cpu": 64, "cuda": 256}  # samples per rank per micro-batch
OUT_FEATURES = 16
#: The models a benchmark can run on (``--model``): ``wide`` is a few large weights (the default),
#: ``small_tensors`` what transformers look like to a reducer (every bias and norm a tensor of its
#: own): 60 Linear(128, 128) layers and a head, 122 tensors of 0.5 to 64 KiB; ``tiny`` is 100
#: Linear(16, 16) layers, 202 tensors that take almost no arithmetic (machinery only).
MODELS = ("wide", "small_tensors", "tiny")
DEEP = {"small_tensors": {"quick": (8, 32), "cpu": (60, 128), "cuda": (60, 256)},
        "tiny": {"quick": (20, 16), "cpu": (100, 16), "cuda": (100, 16)}}


@dataclass
class Setup:
    """Where one run happens and how long it is."""

    benchmark: str
    device: str  # "cpu" or "cuda"
    backend: str
    world_size: int
    launcher: str  # "fork" or "torchrun"
    quick: bool
    warmup: int
    pairs: int
    model: str = "wide"  # one of MODELS, or from outside (benchmarks/models.py)
    control: bool = False  # --control: time a second torch DDP too, an A/A control

    @property
    def size(self) -> str:
        return "quick" if self.quick else self.device

    @property
    def tag(self) -> str:
        name = self.model.replace(":", "-").replace(".", "-").replace("/", "-")
        model = "" if self.model == "wide" else f"-{name}"
        control = "-control" if self.control else ""  # not to overwrite the runs without it
        return (f"{self.benchmark}{model}{control}-{self.device}-{self.backend}"
                f"-ws{self.world_size}")


def parse_args(description: str, argv=None, pairs: int = 12,
               models: tuple[str, ...] = ("wide",), control: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (a smoke run)")
    p.add_argument("--model", action="append", dest="models", metavar="MODEL",
                   help=f"model(s) to run on, repeatable: {', '.join(models)} (default: all; "
                        f"with --quick, {models[0]}), the other built-in ones "
                        f"({', '.join(MODELS)}), gpt2 or resnet50 (where transformers or "
                        "torchvision is installed; random init), or your own as "
                        "package.module:factory (see benchmarks/models.py)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--backend", choices=["gloo", "nccl"], help="default: chosen per setup")
    p.add_argument("--world-size", type=int, help="ranks to fork (default: see harness.py)")
    p.add_argument("--pairs", type=int, default=None, help=f"timed rounds (default {pairs})")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results, "
                   "benchmarks/results/quick with --quick)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per setup")
    if control:
        p.add_argument("--control", action="store_true",
                       help="also time a second torch DDP beside each torch DDP, in the same "
                            "rounds: an A/A control whose ratio to the first (1 but for noise) "
                            "tells how far a miniddp/torch ratio is to be trusted")
    args = p.parse_args(argv)
    args.pairs = args.pairs or (3 if args.quick else pairs)
    args.models = args.models or list(models[:1] if args.quick else models)
    for name in args.models:
        if name not in MODELS and not outside.is_outside(name):
            p.error(f"--model {name}: not one of {', '.join(MODELS)}, gpt2, resnet50, nor "
                    "package.module:factory")
    for name in args.models:
        if ":" in name:
            outside.load_factory(name)  # a wrong name fails here, before any rank starts
    args.skipped = {name: outside.unavailable(name) for name in args.models
                    if outside.unavailable(name)}
    args.models = [name for name in args.models if name not in args.skipped]
    args.out = args.out or (RESULTS / "quick" if args.quick else RESULTS)
    return args


def setups(name: str, args) -> list[Setup]:
    """The runs to make, per model: chosen from the GPUs present, unless flags say otherwise."""
    gpus = 0 if args.device == "cpu" else torch.cuda.device_count()
    if args.device == "cuda" and gpus == 0:
        raise SystemExit("--device cuda: no GPU is visible to this process")
    torchrun = None
    if launched_by_torchrun():
        ws = int(os.environ["WORLD_SIZE"])
        torchrun = (ws, int(os.environ.get("LOCAL_WORLD_SIZE", ws)))
    common = dict(benchmark=name, device="cuda" if gpus else "cpu", quick=args.quick,
                  warmup=2 if args.quick else 3, pairs=args.pairs,
                  control=getattr(args, "control", False))
    return [Setup(**common, **placement, model=model) for model in args.models
            for placement in plan(gpus, args.backend, args.world_size, torchrun)]


def plan(gpus: int, backend: str | None = None, world_size: int | None = None,
         torchrun: tuple[int, int] | None = None) -> list[dict]:
    """Backend, world size and launcher of each setup, from the GPUs this machine has (0 for
    the CPU), the flags, and torchrun's (world size, ranks on this machine) if it started us.

    One rank per GPU takes NCCL; where ranks would share a GPU (NCCL refuses that) or there is
    none, gloo. With one GPU and no flags, two setups: NCCL at world size 1 (the machinery's own
    overhead), then 2 ranks sharing the GPU over gloo.
    """
    def nccl_if_one_gpu_each(local: int) -> str:
        return backend or ("nccl" if 0 < local <= gpus else "gloo")

    if torchrun:
        ws, local = torchrun
        return [dict(backend=nccl_if_one_gpu_each(local), world_size=ws, launcher="torchrun")]
    if backend or world_size or gpus != 1:
        ws = world_size or (gpus if gpus > 1 else 2)
        return [dict(backend=nccl_if_one_gpu_each(ws), world_size=ws, launcher="fork")]
    return [dict(backend="nccl", world_size=1, launcher="fork"),
            dict(backend="gloo", world_size=2, launcher="fork")]


# ----- on every rank -----

def rank_device(setup: Setup) -> torch.device:
    """The one place that decides where a rank computes: the CPU, or on a GPU machine the GPU
    of its local rank (torchrun's ``LOCAL_RANK``, else its rank in the forked group), shared
    round robin when there are more ranks than GPUs (gloo only; NCCL gets one GPU each)."""
    if setup.device == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    torch.cuda.set_device(local % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def collective_device(device: torch.device) -> torch.device:
    """Where the harness's own collectives' tensors live: NCCL reduces GPU tensors only."""
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def make_model(setup: Setup, device: torch.device, seed: int = 0) -> nn.Module:
    """``setup.model`` (see :data:`MODELS`). ``wide``: Linear + LayerNorm + ReLU blocks of mixed
    widths, 11 weights of 1 to 8 MiB (CPU; 4 to 32 MiB on GPU) between many small biases and
    LayerNorm vectors, 46 tensors in all. The others: a deep, narrow MLP of equal layers. A
    model from outside is built by its factory (benchmarks/models.py) from the same seed."""
    torch.manual_seed(seed)
    if outside.is_outside(setup.model):
        return copy.deepcopy(outside.built(setup.model, setup.quick, seed).model).to(device)
    layers = []
    if setup.model == "wide":
        widths = WIDTHS[setup.size]
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), nn.LayerNorm(b), nn.ReLU()]
    else:
        depth, width = DEEP[setup.model][setup.size]
        widths = [width] * (depth + 1)
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], OUT_FEATURES)).to(device)


def input_features(setup: Setup) -> int:
    return WIDTHS[setup.size][0] if setup.model == "wide" else DEEP[setup.model][setup.size][1]


def model_info(model: nn.Module, setup: Setup | None = None) -> dict:
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    info = {"tensors": len(params), "parameters": numel,
            "gradient_mb": round(sum(p.numel() * p.element_size() for p in params) / MIB, 2)}
    if (setup is not None and outside.is_outside(setup.model)) \
            or not isinstance(model, nn.Sequential):
        return {"name": setup.model if setup else type(model).__name__,
                "class": type(model).__name__, **info}
    return {"widths": [m.in_features for m in model if isinstance(m, nn.Linear)]
            + [OUT_FEATURES], **info}


class Batches(list):
    """A rank's fixed batches, ``(inputs, target)`` each, and the loss that goes with them."""

    def __init__(self, batches, loss=F.mse_loss):
        super().__init__(batches)
        self.loss = loss


def make_batches(setup: Setup, device: torch.device, rank: int, count: int = 4,
                 size: int | None = None) -> Batches:
    """``count`` fixed (x, y) batches for ``rank``: a pure function of the rank. ``size``
    samples each (default :data:`BATCH`); a model from outside makes its own batches."""
    g = torch.Generator().manual_seed(1000 + rank)
    if outside.is_outside(setup.model):
        made = outside.built(setup.model, setup.quick)
        return Batches([move_to(made.make_batch(g), device) for _ in range(count)], made.loss)
    n, d = size or BATCH[setup.size], input_features(setup)
    return Batches([(torch.randn(n, d, generator=g).to(device),
                     torch.randn(n, OUT_FEATURES, generator=g).to(device))
                    for _ in range(count)])


def batch_size(batches: Batches) -> int:
    inputs = batches[0][0]
    return len(inputs if isinstance(inputs, torch.Tensor) else inputs[0])


class Trainer:
    """One contestant: a (wrapped) model, its SGD optimizer, and its own place in the data."""

    def __init__(self, model: nn.Module, batches: list, set_to_none: bool = True):
        self.model, self.batches, self.seen, self.set_to_none = model, batches, 0, set_to_none
        self.loss = getattr(batches, "loss", F.mse_loss)
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(self, micro: int = 1, sync: bool = True) -> None:
        """One optimizer step over ``micro`` micro-batches; only the last one syncs."""
        self.opt.zero_grad(set_to_none=self.set_to_none)
        for m in range(micro):
            x, y = self.batches[self.seen % len(self.batches)]
            self.seen += 1
            quiet = getattr(self.model, "no_sync", contextlib.nullcontext)
            with contextlib.nullcontext() if sync and m == micro - 1 else quiet():
                output = self.model(*x) if isinstance(x, (tuple, list)) else self.model(x)
                loss = self.loss(output, y)
            loss.backward()
        self.opt.step()


def median_ci(values: list[float]) -> tuple[float, list[float]]:
    """The median and an approximate 95% interval for it, from order statistics: the true
    median lies between the k-th smallest and k-th largest value with ~95% confidence."""
    ordered = sorted(values)
    n = len(ordered)
    k = max(0, int(n / 2 - 0.98 * n**0.5))
    return statistics.median(ordered), [ordered[k], ordered[n - 1 - k]]


def median_ratio(a: list[float], b: list[float]) -> tuple[float, list[float]]:
    """Median of the per-round ratios a/b, and its 95% interval."""
    return median_ci([x / y for x, y in zip(a, b)])


def summarize(times: dict, baseline: str | None = None) -> dict:
    """Median and quartiles of each call's step time; ratios to ``baseline``, round by round."""
    out = {}
    for name, t in times.items():
        ts = t["wall"]
        q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
        entry = {"median_ms": statistics.median(ts), "p25_ms": q[0], "p75_ms": q[2],
                 "cpu_median_ms": statistics.median(t["cpu"]),
                 "times_ms": [round(x, 3) for x in ts]}
        if baseline is not None and name != baseline:
            entry["ratio"], entry["ratio_ci95"] = median_ratio(ts, times[baseline]["wall"])
            entry["cpu_ratio"], entry["cpu_ratio_ci95"] = median_ratio(t["cpu"],
                                                                       times[baseline]["cpu"])
        out[name] = entry
    return out


def identical_models(a: nn.Module, b: nn.Module, device: torch.device) -> bool:
    """True on every rank when every parameter of ``a`` has ``b``'s bits, on all ranks."""
    equal = all_same_bits(a.parameters(), b.parameters())
    return slowest_rank([0.0 if equal else 1.0], device)[0] == 0.0


def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x.double() - y.double()).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters()))


def torch_layout(ddp) -> list[list[int]]:
    """torch DDP's current buckets (parameter indices), from its logging data."""
    text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices", "")
    return [[int(i) for i in bucket.split()] for bucket in text.split(",") if bucket.strip()]


def ours_layout(ddp) -> list[list[int]]:
    return [b.param_indices for b in ddp.buckets]


def check(condition: bool, message: str) -> None:
    """Refuse to report numbers from a contestant that computed something else."""
    if not condition:
        raise RuntimeError(f"correctness check failed: {message}")


def ddp_kwargs(device: torch.device) -> dict:
    """``device_ids`` as torch's DDP wants it: the GPU for a GPU module, nothing on CPU."""
    return {"device_ids": [device]} if device.type == "cuda" else {}


def rank_facts(device: torch.device) -> dict:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"gpu": gpu, "gpus_visible": torch.cuda.device_count() if gpu else 0}


# ----- in the parent -----

def environment() -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "platform": platform.platform(), "cpu": cpu,
            "cpu_cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "load_average_before": list(os.getloadavg())}


def table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table, for the terminal and for benchmarks/README.md."""
    cells = [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells])


def main(name: str, doc: str, measure, plot, report, argv=None, pairs: int = 12,
         models: tuple[str, ...] = ("wide",), parts=None, combine=None,
         control: bool = False) -> list[dict]:
    """Run ``measure`` in every setup; save, plot and print each result; return them.

    With ``parts(setup)`` (a list of picklable values), ``measure(setup, part)`` runs once per
    part, each in a rank group of its own (fresh processes), and ``combine(setup, figures)``
    joins rank 0's figures of every part. Under torchrun the ranks are torchrun's, so the parts
    run one after another in them (the result says ``"parts_shared_processes": true``).
    ``control``: the script takes ``--control`` (``setup.control``).
    """
    args = parse_args(doc.splitlines()[0], argv, pairs, models, control)
    for model, why in args.skipped.items():
        print0(f"skipped --model {model}: {why}")
    results = []
    for setup in setups(name, args):
        env = environment()
        print0(f"== {name} ({setup.model} model): {setup.device}, {setup.backend}, "
               f"{setup.world_size} ranks "
               f"({setup.launcher}){', quick' if setup.quick else ''}; load average "
               f"{env['load_average_before'][0]:.2f}")
        started = time.perf_counter()
        run = functools.partial(launch, backend=setup.backend, timeout=args.timeout,
                                pg_timeout=120.0)
        if parts is None:
            figures = run(measure, setup.world_size, args=(setup,))[0]
        elif launched_by_torchrun():
            figures = {**combine(setup, run(_each_part, setup.world_size,
                                            args=(measure, setup, parts(setup)))[0]),
                       "parts_shared_processes": True}
        else:
            figures = combine(setup, [run(measure, setup.world_size, args=(setup, part))[0]
                                      for part in parts(setup)])
        env["load_average_after"] = list(os.getloadavg())
        env["seconds"] = round(time.perf_counter() - started, 1)
        result = {"benchmark": name, "setup": asdict(setup), "machine": env, **figures}
        results.append(result)
        if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
            continue
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{setup.tag}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        print0(f"saved {path} ({env['seconds']} s)")
        save_figure(setup.tag, lambda ax, r=result: plot(r, ax), args.out)
        print0(report(result))
    return results


def _each_part(measure, setup: Setup, parts: list) -> list:
    return [measure(setup, part) for part in parts]
