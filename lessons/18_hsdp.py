"""Lesson 18: HSDP, sharded inside a node and replicated across nodes, bit for bit torch's.

What this adds since lesson 17: the model leaves one machine. Lesson 17 cut every tensor over
all W ranks, so each step's all-gathers and reduce-scatters run over every rank, across the
slow links between machines too. HSDP (hybrid sharding) cuts it over the S ranks of one node
only and repeats that cut on each of the R nodes: ranks at the same place on each node hold the
same rows. Lesson 17's unit changes in two places (``NodeUnit``):

1. its collectives run inside the node: gathers, and the reduce-scatter of the gradients (the
   sum of the node's S rows, then / S);
2. one new collective, across nodes: each rank all-reduces its own 1/S of the gradients with its
   peers on the other nodes (the sum of R, then / R). Only that crosses the slow links.

torch FSDP2 does it with the same ``fully_shard`` on a 2-D mesh (``init_device_mesh("cpu",
(nodes, per_node), mesh_dim_names=("replicate", "shard"))``), ``miniddp.fully_shard`` too, or
on ``miniddp.fsdp.HybridMesh(nodes, per_node)``. Here 4 CPU ranks play 2 nodes of 2.

Proven on every rank: the gradient and parameter shards by hand, miniddp's and torch's equal bit
for bit after every backward and step, and the library's on fp16, accumulation over 3
micro-batches with ``set_requires_all_reduce(False)`` (reduce-scatter every micro-batch, the rows
added up, all-reduce across nodes at the last only), clipping, and on torch's 2-D mesh. Then the
details that decide the bits, each broken: the other group order (across nodes first), no
all-reduce across nodes, and one division by W after both sums (equal at 2 per node, where
/ 2 / 2 is / 4 exactly; different at 3). Last, measured: each
rank's bytes per step inside its node and across nodes, and its memory, for DDP, FSDP over all
ranks and HSDP, and why a cluster chooses HSDP.

Run it:

    python lessons/18_hsdp.py                    # 2 nodes of 2
    python lessons/18_hsdp.py --per-node 3       # 2 nodes of 3: one division by W differs too
    torchrun --standalone --nproc_per_node=4 lessons/18_hsdp.py
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        lessons/18_hsdp.py                       # two machines, on each

What you will see: 0 elements differing from torch's on every path, the loss falling; each
mistake's differing elements; a table of bytes and memory per rank; ``OK: ...``. About 35 s on
two CPU cores. It needs torch's FSDP2 (torch 2.4 or later): before, it prints ``SKIPPED``.
"""

import argparse
from collections import Counter
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import miniddp
from course.report import check, mean_over_ranks, ok, print0
from course.tools import load_lesson
from miniddp.launch import launch

fsdp = load_lesson("17_fsdp")  # Unit, make_model, batches, differing, torch_fully_shard
try:  # FSDP2: public from torch 2.6, under _composable before
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
except ImportError:
    try:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy as TorchPolicy
    except ImportError:
        TorchPolicy = None
STEPS, ADAM = 4, dict(lr=0.01)


# ----- HSDP by hand: lesson 17's unit, inside a node, and one all-reduce across nodes -----

class NodeUnit(fsdp.Unit):
    """A module's parameters cut over the ranks of one node, the same cut on every node."""

    def __init__(self, module: nn.Module, mesh):
        self.group, self.across = mesh.shard_group, mesh.replicate_group
        self.nodes = dist.get_world_size(self.across)
        super().__init__(module)  # gathers and cuts over self.group: this node's ranks

    def reduce_scatter(self, grads) -> list[torch.Tensor]:
        buffer = self.layout(grads)  # lesson 17's rows, one per rank of the node
        out = buffer.new_empty(buffer.numel() // self.world)
        fsdp.reduce_scatter_into(out, buffer, group=self.group)  # 1. inside the node
        out.div_(self.world)  # / S, after the sum (torch's AVG)
        dist.all_reduce(out, group=self.across)  # 2. across nodes: this rank's 1/S only
        return self.mine(out.div_(self.nodes))  # / R, after that sum


def by_hand(model: nn.Module, mesh, unit=NodeUnit):
    units = [unit(m, mesh) for m in model if isinstance(m, nn.Linear)]
    return model, [s for u in units for s in u.shards]


def meshes(nodes: int, per_node: int):
    """miniddp's HybridMesh (used by hand too) and torch's 2-D DeviceMesh: the same layout."""
    return (miniddp.fsdp.HybridMesh(nodes, per_node),
            init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("replicate", "shard")))


def sharded(fully_shard, mesh, **options) -> nn.Module:
    model = fsdp.make_model()
    for m in [m for m in model if isinstance(m, nn.Linear)] + [model]:
        fully_shard(m, mesh=mesh, **options)
    return model


# ----- 1. by hand beside miniddp's and torch's; the library on more paths -----

def side_by_side(ours, theirs) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {"by hand": by_hand(fsdp.make_model(), ours),
            "miniddp.fully_shard": (m := sharded(miniddp.fully_shard, ours), list(m.parameters())),
            "torch's fully_shard": (t := sharded(fsdp.torch_fully_shard, theirs),
                                    list(t.parameters()))}
    optimizers = {k: torch.optim.Adam(params, **ADAM) for k, (_, params) in runs.items()}
    torchs, losses, differ = runs["torch's fully_shard"][1], [], Counter()
    for x, y in fsdp.batches(rank, world, STEPS):
        for name, (model, _) in runs.items():
            optimizers[name].zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            losses += [loss.detach()] * (name == "by hand")
        for name, (_, params) in runs.items():
            differ[name] += fsdp.differing([p.grad for p in params], [p.grad for p in torchs])
        for optimizer in optimizers.values():
            optimizer.step()
        for name, (_, params) in runs.items():
            differ[name] += fsdp.differing(params, torchs)
    for name in list(runs)[:-1]:
        print0(f"  {name:<21} differs from torch's fully_shard in {differ[name]} elements")
        check(differ[name] == 0, f"rank {rank}: {name} differs from torch's fully_shard in "
                                 f"{differ[name]} gradient or parameter elements")
    return [mean_over_ranks(loss) for loss in losses]


def differing_grads(ours, theirs) -> int:
    """Gradient elements that differ; a gradient one has and the other not counts whole (under
    HSDP a backward without all-reduce leaves ``.grad`` as it was)."""
    pairs = [(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters())]
    missing = [b if a is None else a for a, b in pairs if (a is None) != (b is None)]
    both = [(a, b) for a, b in pairs if a is not None and b is not None]
    return (sum(t.numel() for t in missing)
            + fsdp.differing([a for a, _ in both], [b for _, b in both]))


PATHS = {"fp16 compute and reduction": {"dtype": torch.float16},
         "3 micro-batches, the first two without all-reduce across nodes": {"micro": 3},
         "clip_grad_norm_ (the norm over the node's shards)": {"clip": 0.05},
         "miniddp's on torch's 2-D DeviceMesh too": {"device_mesh": True}}


def prove_path(path: str, ours, theirs) -> int:
    """miniddp's and torch's HSDP, 2 Adam steps on ``path``, every shard compared after each
    backward and step; returns miniddp's all-reduces across nodes per step."""
    rank, world, how = dist.get_rank(), dist.get_world_size(), PATHS[path]
    policy = dict(param_dtype=how.get("dtype"))
    mine = theirs if how.get("device_mesh") else ours  # (replicate, shard): read in that order
    models = [sharded(miniddp.fully_shard, mine, mp_policy=miniddp.MixedPrecisionPolicy(**policy)),
              sharded(fsdp.torch_fully_shard, theirs, mp_policy=TorchPolicy(**policy))]
    optimizers = [torch.optim.Adam(m.parameters(), **ADAM) for m in models]
    micro, differ, across = how.get("micro", 1), 0, 0
    for step, (x, y) in enumerate(fsdp.batches(rank, world, 2 * micro)):
        for model in models:
            model.set_requires_all_reduce(step % micro == micro - 1)
            with Traffic(ours.shards) as traffic:
                F.mse_loss(model(x).float(), y).backward()
            across += traffic.calls["across"] * (model is models[0])
        differ += differing_grads(*models)
        if step % micro == micro - 1:
            for model, optimizer in zip(models, optimizers):
                if "clip" in how:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), how["clip"])
                optimizer.step()
                optimizer.zero_grad()
            differ += fsdp.differing(*[list(m.parameters()) for m in models])
    check(differ == 0, f"rank {rank}, {path}: miniddp.fully_shard differs from torch's "
                       f"fully_shard in {differ} elements")
    return across // 2  # a step


# ----- 2. each detail that decides the bits, broken on purpose -----

class Broken(NodeUnit):
    MISTAKES = ("one division by W, after both sums", "across nodes first, then inside the node",
                "no all-reduce across nodes")

    def reduce_scatter(self, grads) -> list[torch.Tensor]:
        one, first, _ = (self.mistake == m for m in self.MISTAKES)
        buffer = self.layout(grads)
        if first:  # every element averaged across nodes, then the node's reduce-scatter
            dist.all_reduce(buffer, group=self.across)
            buffer.div_(self.nodes)
        out = buffer.new_empty(buffer.numel() // self.world)
        fsdp.reduce_scatter_into(out, buffer, group=self.group)
        if one:
            dist.all_reduce(out, group=self.across)
            return self.mine(out.div_(self.world * self.nodes))
        return self.mine(out.div_(self.world))  # across nodes already, or never


def broken_details(ours, theirs) -> dict[str, int]:
    x, y = fsdp.batches(dist.get_rank(), dist.get_world_size(), 1)[0]
    torchs, counted = sharded(fsdp.torch_fully_shard, theirs), {}
    F.mse_loss(torchs(x), y).backward()
    for mistake in Broken.MISTAKES:
        model, shards = by_hand(fsdp.make_model(), ours, type("B", (Broken,), {"mistake": mistake}))
        F.mse_loss(model(x), y).backward()
        count = torch.tensor(fsdp.differing([s.grad for s in shards],
                                            [p.grad for p in torchs.parameters()]))
        dist.all_reduce(count)
        counted[mistake] = int(count)
    return counted


# ----- 3. bytes per rank per step, inside the node and across nodes; memory -----

@contextmanager
def Traffic(per_node: int):
    """Every collective made meanwhile, and the bytes this rank sends for it with a ring (NCCL's
    algorithm): an all-gather forwards the other ranks' pieces, (p - 1) x its own; a
    reduce-scatter (p - 1)/p of its input; an all-reduce twice that. By where its group runs:
    inside this rank's node, or across nodes, where the slow links set the pace."""
    spied = {"gather_into": fsdp, "reduce_scatter_into": fsdp, "all_reduce": dist}
    originals = {name: getattr(owner, name) for name, owner in spied.items()}
    found = SimpleNamespace(sent=Counter(), calls=Counter())

    def spy(name):
        def call(*args, group=None, **kwargs):
            p, n = dist.get_world_size(group), args[1 if name != "all_reduce" else 0]
            ranks = dist.get_process_group_ranks(group) if group else range(p)
            where = "inside" if len({r // per_node for r in ranks}) == 1 else "across"
            factor = {"gather_into": p - 1, "reduce_scatter_into": (p - 1) / p}.get(
                name, 2 * (p - 1) / p)
            found.sent[where] += factor * n.numel() * n.element_size()
            found.calls[where] += 1
            return originals[name](*args, group=group, **kwargs)
        return call

    for name, owner in spied.items():
        setattr(owner, name, spy(name))
    try:
        yield found
    finally:
        for name, owner in spied.items():
            setattr(owner, name, originals[name])


def one_step(how: str, ours) -> tuple[Counter, int]:
    """One Adam step of ``how`` ("DDP", "FSDP" over every rank, "HSDP"): the bytes this rank
    sent, by where; the bytes it holds after it (parameters, gradients, Adam's moments)."""
    model, x_y = fsdp.make_model(), fsdp.batches(dist.get_rank(), dist.get_world_size(), 1)[0]
    params = list(model.parameters()) if how == "DDP" else by_hand(
        model, ours, NodeUnit if how == "HSDP" else lambda m, _: fsdp.Unit(m))[1]
    optimizer = torch.optim.Adam(params, **ADAM)
    with Traffic(ours.shards) as traffic:
        F.mse_loss(model(x_y[0]), x_y[1]).backward()
        if how == "DDP":  # lesson 03's, one all_reduce of every gradient (one bucket)
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
    optimizer.step()
    held = params + [p.grad for p in params] + [t for s in optimizer.state.values()
                                                 for k, t in s.items() if k != "step"]
    return traffic.sent, sum(t.numel() * t.element_size() for t in held)


def show_traffic(ours, nodes: int) -> dict:
    rows = {how: one_step(how, ours) for how in ("DDP", "FSDP", "HSDP")}
    print0(f"\n3. One Adam step, rank {dist.get_rank()}: bytes sent (ring) and bytes held")
    print0(f"  {'':<6}{'inside its node':>16}{'across nodes':>14}{'held':>8}")
    for how, (sent, held) in rows.items():
        print0(f"  {how:<6}{sent['inside']:>16.0f}{sent['across']:>14.0f}{held:>8}")
    (ddp, ddp_held), (fsdp_, fsdp_held), (hsdp, hsdp_held) = rows.values()
    per_node = ours.shards  # this rank's padded rows of every tensor, summed over the units:
    shard = sum(-(-p.shape[0] // per_node) * p[0].numel() for p in fsdp.make_model().parameters())
    across = 2 * (nodes - 1) / nodes * 4 * shard
    check(abs(hsdp["across"] - across) < 1 and ddp["inside"] == fsdp_["inside"] == 0, f"HSDP sent "
          f"{hsdp['across']} bytes across nodes, expected {across} (only its 1/S of every "
          f"gradient, all-reduced), DDP and FSDP {ddp['inside']} and {fsdp_['inside']} inside")
    check(hsdp["across"] < min(ddp["across"], fsdp_["across"]) and fsdp_held < hsdp_held <
          ddp_held, f"bytes across nodes {ddp['across']}, {fsdp_['across']}, {hsdp['across']} "
          f"and held {ddp_held}, {fsdp_held}, {hsdp_held} (DDP, FSDP, HSDP)")
    return {how: (sent["across"], held) for how, (sent, held) in rows.items()}


WHY = """
4. Why a cluster chooses HSDP. Inside a node GPUs talk over links (NVLink) about ten times
   faster than the network between nodes (one 400 Gb/s NIC per GPU, 50 GB/s). FSDP over every
   GPU sends each step's gathers and reduce-scatters across the network; HSDP keeps them in the
   node and sends only each rank's 1/S of the gradient across ({:.0%} of FSDP's bytes here, and
   the all-reduce can wait for the last micro-batch). It pays in memory: 1/S of the model's
   state per GPU instead of 1/W, which is what a node must hold. Shard over the fewest GPUs
   whose memory holds the model; replicate across the rest."""


# ----- the lesson -----

def on_every_rank(per_node: int) -> dict:
    nodes = dist.get_world_size() // per_node
    ours, theirs = meshes(nodes, per_node)
    print0(f"{nodes} nodes of {per_node} ranks (gloo on the CPU): ranks "
           f"{[list(range(k * per_node, (k + 1) * per_node)) for k in range(nodes)]} shard "
           "together; the same place on each node holds the same rows\n\n1. HSDP by hand "
           f"beside torch's, Adam, {STEPS} steps:")
    losses = side_by_side(ours, theirs)
    print0("  loss (mean over the ranks): " + " ".join(f"{loss:.4f}" for loss in losses))
    check(losses[-1] < losses[0], f"the loss went from {losses[0]} to {losses[-1]}")
    print0("  miniddp.fully_shard beside torch's, 2 steps each:")
    units = sum(isinstance(m, nn.Linear) for m in fsdp.make_model())
    for path in PATHS:
        calls = prove_path(path, ours, theirs)
        print0(f"    {path:<58} 0 differ; {calls} all-reduces across nodes a step")
        check(calls == units, f"{path}: {calls} all-reduces across nodes a step, not one per "
                              f"unit ({units}): a micro-batch without all-reduce made one?")
    print0("\n2. One detail broken at a time: gradient elements that differ from torch's")
    power_of_two = per_node & (per_node - 1) == 0
    for mistake, count in broken_details(ours, theirs).items():
        print0(f"  {mistake:<44} {count:>5}")
        expected = not (mistake == Broken.MISTAKES[0] and power_of_two)
        check((count > 0) == expected, f"'{mistake}' differs from torch's in {count} elements at "
              f"{per_node} ranks per node: expected {'some' if expected else 'none'}")
    traffic = show_traffic(ours, nodes)
    print0(WHY.format(traffic["HSDP"][0] / traffic["FSDP"][0]))
    return {"nodes": nodes, "losses": (losses[0], losses[-1]), "traffic": traffic}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2, help="nodes to play (not under torchrun)")
    parser.add_argument("--per-node", type=int, default=2, help="ranks per node")
    args = parser.parse_args()
    if TorchPolicy is None:
        return print(f"SKIPPED: lesson 18 needs torch's FSDP2, {torch.__version__} has none")
    result = launch(on_every_rank, args.nodes * args.per_node, args=(args.per_node,),
                    backend="gloo")[0]
    (first, last), hsdp, fsdp_ = result["losses"], *(result["traffic"][k] for k in ("HSDP", "FSDP"))
    ok(f"HSDP on {result['nodes']} nodes of {args.per_node} equals torch's bit for bit (loss "
       f"{first:.3f} -> {last:.4f}); each broken detail differs where it must; it sends "
       f"{hsdp[0]:.0f} bytes a rank across nodes where FSDP sends {fsdp_[0]:.0f}, holding "
       f"{hsdp[1]} bytes to FSDP's {fsdp_[1]}")


if __name__ == "__main__":
    main()
