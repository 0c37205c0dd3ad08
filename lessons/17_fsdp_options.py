"""Lesson 17, part 2: ``miniddp.fully_shard`` on every path torch's ``fully_shard`` takes.

What this adds since part 1 (``17_fsdp.py``): part 1 wrote a unit's life by hand on one path:
ZeRO-3, fp32, one backward per step. The library's ``fully_shard`` takes many more, and each
changes when a unit is gathered or how its gradients are averaged. Here every one runs beside
torch's ``fully_shard`` on the same model (two inner units, and the root, which owns the first
and the last layer) and the same batches, two Adam steps each, and both are watched from
outside in the same way:

* **what is gathered when**: after forward, which units hold full parameters (a shard is a
  DTensor, in torch and in miniddp: it has ``to_local``, a gathered parameter does not). Under
  ZeRO-3 only the root does, since the backward needs it first; under ZeRO-2
  (``reshard_after_forward=False``) every unit does; after backward none. The all-gathers and
  the reductions (a reduce-scatter; on gloo, miniddp's all_reduce of the same buffer) of each
  forward and backward, counted;
* **the paths**: ZeRO-3 and ZeRO-2; bf16 compute with fp32 reduction, and fp16 compute and
  reduction (torch divides by a power of two before the sum, by the rest after); two backwards
  per step with sync (each reduced, added into the shard's ``.grad``) and without
  (``set_requires_gradient_sync(False)``: the full gradient kept, in the reduction's dtype, and
  reduced once); ``clip_grad_norm_`` with both of its kernels (the norm of a sharded gradient is
  taken over every rank, or each rank would clip by its own factor); a frozen bias, and a weight
  frozen after sharding (the gathered parameter must then need no gradient either).

Proven for each path, on every rank: the same units gathered after forward and after backward,
the same counts, and every gradient shard (after each backward) and parameter shard (after
each step) equal to torch's bit for bit. Last, fp16's two divisions at 1 to 8 ranks, beside
torch's own function: the rule shows only from 4 ranks on, more than this lesson runs.

Run it:

    python lessons/17_fsdp_options.py              # 3 ranks
    python lessons/17_fsdp_options.py --nproc 2
    torchrun --standalone --nproc_per_node=2 lessons/17_fsdp_options.py

What you will see: one row per path, what was gathered after forward, the all-gathers and
reductions per step, the elements that differ from torch's (0 in every row), the loss of the
last step; ``OK: ...``. About 25 s. It needs torch's FSDP2 (torch 2.4 or later): before, it
prints ``SKIPPED: ...``.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import miniddp
from course.data import IN_FEATURES, OUT_FEATURES, make_dataset
from course.report import check, mean_over_ranks, ok, print0
from miniddp.launch import launch

try:  # FSDP2: public from torch 2.6, under _composable before
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
except ImportError:
    try:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed._composable.fsdp import fully_shard as torch_fully_shard
    except ImportError:
        torch_fully_shard = TorchPolicy = None

HIDDEN, STEPS, BATCH, ADAM, MAX_NORM = 40, 2, 16, dict(lr=0.01), 0.05
INNER, ROOT = (2, 4), (0, 6)  # the layers that are units of their own; the root's two layers
PATHS = {
    "ZeRO-3": {},
    "ZeRO-2 (reshard_after_forward=False)": {"zero2": True},
    "bf16 compute, fp32 reduction": {"param": torch.bfloat16, "reduce": torch.float32},
    "fp16 compute and reduction": {"param": torch.float16},
    "two backwards per step, both with sync": {"micro": 2},
    "two backwards, the first without sync (bf16/fp32)": {"micro": 2, "no_sync": True,
                                                          "param": torch.bfloat16,
                                                          "reduce": torch.float32},
    "clip_grad_norm_, foreach": {"clip": True},
    "clip_grad_norm_, one tensor at a time": {"clip": False},
    "a frozen bias": {"frozen": True},
    "a weight frozen after fully_shard": {"frozen_after": True},
}
UNITS = [f"layer {i}" for i in INNER] + ["root"]


def make_model(frozen: bool = False) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.Tanh(),
                              nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                              nn.Tanh(), nn.Linear(HIDDEN, OUT_FEATURES))
    if frozen:
        model[INNER[0]].bias.requires_grad_(False)
    return model


def sharded(fully_shard, policy_class, path: dict) -> nn.Module:
    """torch's call shape: each inner unit, then the root (on the CPU: torch's default mesh
    is a GPU wherever there is one)."""
    model = make_model(path.get("frozen", False))
    policy = policy_class(param_dtype=path.get("param"), reduce_dtype=path.get("reduce"))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for i in INNER:
        fully_shard(model[i], mesh=mesh, mp_policy=policy,
                    reshard_after_forward=not path.get("zero2", False))
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if path.get("frozen_after"):  # the shard frozen: the gathered weight must follow it
        model[INNER[0]].weight.requires_grad_(False)
    return model


# ----- watching a sharded model from outside -----

class Counted:
    """While open, counts the all-gathers and the reductions (what FSDP sums gradients with)
    made through ``torch.distributed``."""

    KINDS = {"all-gathers": ("all_gather_single", "all_gather_into_tensor", "all_gather"),
             "reductions": ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")}

    def __init__(self):
        self.counts = dict.fromkeys(self.KINDS, 0)
        self.saved = {}

    def __enter__(self):
        for kind, names in self.KINDS.items():
            for name in names:
                if hasattr(dist, name):
                    self.saved[name] = getattr(dist, name)
                    setattr(dist, name, self.counting(kind, self.saved[name]))
        return self

    def counting(self, kind, collective):
        def call(*args, **kwargs):
            self.counts[kind] += 1
            return collective(*args, **kwargs)
        return call

    def __exit__(self, *error):
        for name, collective in self.saved.items():
            setattr(dist, name, collective)


def gathered(model: nn.Module) -> tuple[str, ...]:
    """The units holding full parameters now: a shard has ``to_local``, a full one does not."""
    layers = [model[i] for i in INNER] + [model[ROOT[0]]]
    return tuple(name for name, layer in zip(UNITS, layers) if not hasattr(layer.weight,
                                                                            "to_local"))


def local(t) -> torch.Tensor | None:
    return None if t is None else t.to_local().detach().clone()


def differing(ours: list, theirs: list) -> int:
    return sum(int((a != b).sum()) if a is not None and b is not None else int(a is not b)
               for a, b in zip(ours, theirs))


def one_step(model, optimizer, batches, path) -> tuple[list, dict]:
    """Forward and backward of each micro-batch, then the step; what was seen on the way."""
    seen = {"after forward": [], "after backward": [], "grads": [], "norm": None}
    with Counted() as counted:
        for k, (x, y) in enumerate(batches):
            model.set_requires_gradient_sync(not path.get("no_sync") or k == len(batches) - 1)
            loss = F.mse_loss(model(x), y)
            seen["after forward"].append(gathered(model))
            loss.backward()
            seen["after backward"].append(gathered(model))
            seen["grads"].append([local(p.grad) for p in model.parameters()])
    seen.update(counted.counts, loss=loss.detach().float())
    if "clip" in path:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=path["clip"])
        seen["norm"] = norm.to_local() if hasattr(norm, "to_local") else norm
        seen["grads"].append([local(p.grad) for p in model.parameters()])
    optimizer.step()
    optimizer.zero_grad()
    return [local(p) for p in model.parameters()], seen


def one_path(name: str, rank: int, world: int) -> dict:
    """Both libraries on one path, STEPS steps; what differs between them."""
    path = PATHS[name]
    models = {"miniddp": sharded(miniddp.fully_shard, miniddp.MixedPrecisionPolicy, path),
              "torch": sharded(torch_fully_shard, TorchPolicy, path)}
    optimizers = {k: torch.optim.Adam(m.parameters(), **ADAM) for k, m in models.items()}
    x_all, y_all = make_dataset(n=BATCH * world * STEPS, seed=1).tensors
    micro = path.get("micro", 1)
    row = {"differ": 0, "unlike": []}
    for step in range(STEPS):
        x, y = (t[BATCH * (world * step + rank):][:BATCH] for t in (x_all, y_all))
        batches = list(zip(x.chunk(micro), y.chunk(micro)))
        (mine, ours), (theirs, torchs) = (one_step(models[k], optimizers[k], batches, path)
                                          for k in models)
        row["differ"] += differing(mine, theirs) + sum(
            differing(a, b) for a, b in zip(ours["grads"], torchs["grads"]))
        row["differ"] += int(ours["norm"] is not None and not torch.equal(ours["norm"],
                                                                          torchs["norm"]))
        row["unlike"] += [what for what in ("after forward", "after backward", "all-gathers",
                                            "reductions") if ours[what] != torchs[what]]
        row.update({k: ours[k] for k in ("after forward", "all-gathers", "reductions", "loss")})
    row["loss"] = mean_over_ranks(row["loss"])
    return row


def divide_factors_beside_torchs(most: int = 8) -> list[tuple]:
    """fp16's (before, after) divisions at 1 to ``most`` ranks, miniddp's and torch's own
    (``_get_gradient_divide_factors``, asked with a stand-in group of each size): the rule
    differs between 2 and 3 ranks from 4 on, where neither division is a plain W."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors as torchs,
    )

    from miniddp.fsdp.collectives import fp16_divide_factors

    rows = []
    for world in range(1, most + 1):
        group = type("Group", (), {"size": lambda self, w=world: w})()
        pre, post = torchs(group, None, torch.float16)[:2]
        rows.append((world, tuple(fp16_divide_factors(world)), (pre or 1, post or 1)))
    return rows


def prove_divide_factors() -> None:
    print0("\n  fp16's divisions, before and after the sum, at 1 to 8 ranks (miniddp / torch):")
    rows = divide_factors_beside_torchs()
    print0("  " + "  ".join(f"{w}: {ours[0]:g}, {ours[1]:g}" for w, ours, _ in rows))
    wrong = [(w, ours, theirs) for w, ours, theirs in rows if ours != theirs]
    check(not wrong, f"fp16's divide factors (ranks, miniddp's, torch's) differ: {wrong}")


# ----- the lesson -----

def prove_path(name: str) -> dict:
    """One path beside torch's, shown and checked on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    row = one_path(name, rank, world)
    held = " and ".join(row["after forward"][-1]) or "none"
    print0(f"  {name:<52} {held:<26} {row['all-gathers']:>7} {row['reductions']:>10} "
           f"{row['differ']:>6} {row['loss']:>7.4f}")
    check(not row["unlike"], f"rank {rank}, {name}: miniddp.fully_shard differs from torch's "
          f"in what it gathers and reduces: {sorted(set(row['unlike']))}, seen last as {held} "
          f"gathered after forward, {row['all-gathers']} all-gathers and {row['reductions']} "
          "reductions per step")
    check(row["differ"] == 0, f"rank {rank}, {name}: miniddp.fully_shard differs from torch's "
          f"fully_shard in {row['differ']} gradient or parameter elements over {STEPS} steps")
    return row


def on_every_rank():
    world = dist.get_world_size()
    print0(f"{world} ranks, gloo on the CPU: miniddp.fully_shard beside torch's, {STEPS} Adam "
           "steps per path,\nunits: layers 2 and 4, and the root (layers 0 and 6)\n")
    print0(f"  {'path':<52} {'gathered after forward':<26} {'gathers':>7} {'reductions':>10}"
           f" {'differ':>6} {'loss':>7}")
    for name in PATHS:
        prove_path(name)
    prove_divide_factors()
    print0("\n  After forward the root keeps its parameters (its layers are the first the "
           "backward needs);\n  ZeRO-2 keeps every unit's, one all-gather per unit and step "
           "fewer. Without sync, a backward\n  makes no reduction: the full gradient waits for "
           "the next one.")
    return world


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=3, help="ranks to fork (not under torchrun)")
    args = parser.parse_args()
    if torch_fully_shard is None:
        return print(f"SKIPPED: lesson 17 needs torch's FSDP2 (fully_shard), {torch.__version__} "
                     "has none")
    world = launch(on_every_rank, args.nproc, backend="gloo")[0]
    ok(f"on {world} ranks miniddp.fully_shard equals torch's fully_shard bit for bit on "
       f"{len(PATHS)} paths (ZeRO-3 and ZeRO-2, bf16 and fp16, accumulation with and without "
       "sync, clipping, a bias frozen before sharding and a weight after), gathering and "
       "reducing as torch's does")


if __name__ == "__main__":
    main()
