"""Lesson 16: torch.compile and DDP: one compiled backward hides the hooks; pieces bring them back.

What this adds since lesson 06: the same overlap, under ``torch.compile``. Lesson 06's overlap
rests on the autograd engine running backward node by node, so that a parameter's hook fires as
soon as its gradient is final. A compiled model has one backward node for the whole graph
(``CompiledFunctionBackward``): it returns every gradient at once, at the end, and only then do
the hooks fire. The buckets launch in a burst with nothing left to overlap, and since the
rebuilt buckets follow the order gradients became ready, the buckets (and at 3 ranks the bits)
change too.

The cure: compile the model in pieces cut where DDP's buckets are cut, so that each piece's
gradients are ready when it returns and a bucket's all_reduce runs while earlier pieces still
compute. Done by hand first (each layer compiled on its own), then by torch's compiler: dynamo's
``DDPOptimizer`` cuts the traced graph from its end whenever the parameters reach DDP's
``bucket_bytes_cap`` (the first piece at 1 MiB), for the DDP module that is running, which it
finds through ``DistributedDataParallel._active_ddp_module``. miniddp sets that same attribute
(``miniddp/compat/compiled.py``) and so gets torch's pieces, ready order, rebuilt buckets and
bits, in both orders: ``DDP(torch.compile(model))`` and ``torch.compile(DDP(model))``.

The proof, on the reducer's timeline (``ddp.trace()``) with hooks on each compiled node marking
when a piece starts and returns: one compiled graph launches no all_reduce before its only piece
returned; pieces (by hand, and miniddp under ``torch.compile`` in both orders) launch during
backward; miniddp has as many pieces and graph breaks as torch's, the same rebuilt buckets, and
parameters equal to torch's compiled DDP bit for bit after every step. A cap torch's compiled
DDP refuses (below the 1 MiB first piece), miniddp refuses too, saying why.

Run it:

    python lessons/16_compile.py              # forks 2 ranks, gloo on CPU, the aot_eager backend
    python lessons/16_compile.py --nproc 3    # the bits now depend on the buckets
    python lessons/16_compile.py --backend inductor   # real kernels: minutes of C++ compiling
    torchrun --standalone --nproc_per_node=2 lessons/16_compile.py

What you should see: one backward with one compiled graph, event by event (every launch after
the only piece returned) and its buckets; the layers compiled one by one (launches between
pieces); miniddp and torch's compiled DDP side by side in both orders (pieces, graph breaks,
all_reduces during backward, buckets, "equal bit for bit"), the loss falling; the refused cap;
``OK: ...``. About 45 s, most of it compiling; gloo on the CPU even with GPUs. Needs torch >= 2.3:
before, it prints ``SKIPPED: ...`` and ``run_course.py`` lists it as skipped.
"""

import argparse
import contextlib
import importlib
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from course.data import IN_FEATURES, OUT_FEATURES, make_dataset
from course.report import check, ok, print0
from miniddp.compat.compiled import GRAPH_BREAKS
from miniddp.launch import launch
from miniddp.torch_versions import TORCH_HAS_IS_COMPILING

WIDTH = 512  # each hidden weight is 1 MiB: with a 1 MiB cap, about one bucket per layer
BUCKET_CAP_MB = 1
STEPS = 3  # the buckets are rebuilt at the second forward; torch reports them at the third
BATCH = 16
LR = 0.1


class Tower(nn.Module):
    """A user's own model (dynamo compiles user code), about 2 MiB of parameters."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.layers = nn.ModuleList([nn.Linear(IN_FEATURES, WIDTH), nn.Linear(WIDTH, WIDTH),
                                         nn.Linear(WIDTH, WIDTH)])
            self.head = nn.Linear(WIDTH, OUT_FEATURES)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def mark_compiled_pieces(loss, reducer) -> None:
    """Record on the reducer's timeline when compiled piece k of backward starts computing
    (``("compute", k)``) and when it returns its gradients (``("returns", k)``): a pre-hook and a
    post-hook on every ``CompiledFunctionBackward`` node of the autograd graph. Pieces are
    numbered in the order they run."""
    number = {}

    def starts(node):
        number[node] = len(number)
        reducer.emit("compute", number[node])

    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in node.name():
            node.register_prehook(lambda _grads, node=node: starts(node))
            node.register_hook(lambda _inputs, _outputs, node=node:
                               reducer.emit("returns", number[node]))
        todo.extend(next_node for next_node, _ in node.next_functions)


def overlapping(events) -> int:
    """All_reduces launched before the last compiled piece of backward returned its gradients,
    that is, while backward still computed."""
    last_return = max(k for k, (event, _) in enumerate(events) if event == "returns")
    return sum(1 for event, _ in events[:last_return] if event == "launch")


def pieces_run(events) -> int:
    """Compiled pieces that ran in one backward."""
    return sum(1 for event, _ in events if event == "returns")


def named(buckets, names) -> str:
    """Buckets of parameter indices, written with the parameters' names."""
    return "[" + ", ".join("[" + ", ".join(names[i] for i in b) + "]" for b in buckets) + "]"


@contextlib.contextmanager
def graph_splitting(on: bool):
    """``torch._dynamo.config.optimize_ddp``: whether dynamo cuts a DDP model at its buckets."""
    import torch._dynamo

    saved = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = on
    try:
        yield
    finally:
        torch._dynamo.config.optimize_ddp = saved


def train(ddp_class, how: str, backend: str, split: bool = True) -> dict:
    """``STEPS`` steps of a Tower wrapped and compiled ``how``; what happened at each step."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # compile afresh: nothing cached from the last run
    counters.clear()
    pieces = []

    def counting(gm, example_inputs):  # dynamo hands the backend one call per compiled piece
        pieces.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    model = Tower()
    names = [name for name, _ in model.named_parameters()]
    with graph_splitting(split):
        if how == "DDP(torch.compile(model))":
            ddp = ddp_class(torch.compile(model, backend=counting), bucket_cap_mb=BUCKET_CAP_MB)
            run = ddp
        elif how == "torch.compile(DDP(model))":
            ddp = ddp_class(model, bucket_cap_mb=BUCKET_CAP_MB)
            run = torch.compile(ddp, backend=counting)
        else:  # by hand: each layer compiled on its own, so backward runs layer by layer
            for k, layer in enumerate(model.layers):
                model.layers[k] = torch.compile(layer, backend=counting)
            model.head = torch.compile(model.head, backend=counting)
            ddp = run = ddp_class(model, bucket_cap_mb=BUCKET_CAP_MB)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
        x, y = make_dataset(n=BATCH, seed=dist.get_rank()).tensors  # one batch, every step
        result = {"losses": [], "events": [], "params": []}
        for _step in range(STEPS):
            loss = F.mse_loss(run(x), y)
            if isinstance(ddp, miniddp.DistributedDataParallel):
                with ddp.trace() as trace:
                    mark_compiled_pieces(loss, ddp.reducer)
                    loss.backward()
                result["events"].append([(event, ident) for event, ident, _ in trace.events])
                result["trace"] = trace
            else:
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            result["losses"].append(loss.item())
            result["params"].append([p.detach().clone() for p in model.parameters()])
    result["pieces"] = len(pieces)
    result["names"] = names
    result["breaks"] = sum(counters["graph_break"].values())
    if isinstance(ddp, miniddp.DistributedDataParallel):
        result["buckets"] = [b.param_indices for b in ddp.buckets]
    else:  # what torch's C++ reducer reports about its rebuilt buckets
        logged = ddp._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]
        result["buckets"] = [[int(i) for i in b.split()] for b in logged.split(",")]
    return result


def show(trace) -> None:
    """One backward, event by event, with the start and the return of each compiled piece."""
    lines, events = trace.lines(), trace.events
    for line, (event, ident, _) in zip(lines, events):
        if event == "compute":
            line = line.replace(f"compute {ident}", f"--- compiled piece {ident} of backward "
                                                    "starts computing")
        elif event == "returns":
            line = line.replace(f"returns {ident}", f"--- compiled piece {ident} returns")
        print0("    " + line)


def one_graph_and_by_hand(backend: str) -> None:
    print0("\n1. one compiled graph: DDP(torch.compile(model)) with dynamo's splitting off")
    whole = train(miniddp.DistributedDataParallel, "DDP(torch.compile(model))", backend,
                  split=False)
    show(whole["trace"])
    late = [overlapping(events) for events in whole["events"]]
    print0(f"  {whole['pieces']} compiled graph; all_reduces launched while backward still "
           f"computed, per step: {late}.\n  The gradients all appear when the one backward node "
           "returns; the hooks fire after it, in a burst.")
    check(late == [0] * STEPS, f"one compiled graph cannot overlap, yet {late} all_reduces were "
                               "launched before it returned")
    check(whole["pieces"] == pieces_run(whole["events"][-1]) == 1,
          f"splitting off, {whole['pieces']} graphs were compiled")
    print0(f"  The buckets rebuilt after step 1 follow that ready order:\n    "
           f"{named(whole['buckets'], whole['names'])}")

    print0("\n2. by hand: every layer compiled on its own, so backward runs in pieces")
    by_hand = train(miniddp.DistributedDataParallel, "by hand", backend, split=False)
    show(by_hand["trace"])
    during = [overlapping(events) for events in by_hand["events"]]
    print0(f"  {pieces_run(by_hand['events'][-1])} compiled pieces of backward "
           f"({by_hand['pieces']} graphs compiled: same-shaped layers may share one);\n"
           f"  all_reduces launched while later pieces still computed, per step: {during}\n"
           "  (the first step has one bucket: lesson 05)\n"
           f"  Rebuilt in this ready order, the buckets are not those of section 1:\n    "
           f"{named(by_hand['buckets'], by_hand['names'])}")
    check(min(during[1:]) >= 1, f"compiled in pieces, no all_reduce was launched before the "
                                f"last piece returned: {during}")
    check(by_hand["buckets"] != whole["buckets"], "one compiled graph and the layers compiled "
          f"one by one rebuilt the same buckets, {named(whole['buckets'], whole['names'])}")


def like_torch(backend: str) -> None:
    print0("\n3. torch's compiler cuts at the buckets of the active DDP module: torch's, "
           "and miniddp's")
    rank = dist.get_rank()
    for how in ("DDP(torch.compile(model))", "torch.compile(DDP(model))"):
        theirs = train(TorchDDP, how, backend)
        ours = train(miniddp.DistributedDataParallel, how, backend)
        during = [overlapping(events) for events in ours["events"]]
        first_difference = next((s for s, (a, b) in enumerate(zip(ours["params"],
                                                                   theirs["params"]))
                                 if not all(map(torch.equal, a, b))), None)
        print0(f"  {how}:\n"
               f"    compiled graphs {ours['pieces']} (torch's {theirs['pieces']}), graph breaks "
               f"{ours['breaks']} (torch's {theirs['breaks']})\n"
               f"    all_reduces launched while backward still computed, per step: {during}\n"
               f"    rebuilt buckets {named(ours['buckets'], ours['names'])}\n"
               f"    torch's         {named(theirs['buckets'], theirs['names'])}\n"
               f"    loss {ours['losses'][0]:.4f} -> {ours['losses'][-1]:.4f}; equal to torch's "
               f"compiled DDP bit for bit after every step: {first_difference is None}")
        check(ours["buckets"] == theirs["buckets"],
              f"{how}: miniddp's rebuilt buckets {ours['buckets']} differ from torch's "
              f"compiled DDP's {theirs['buckets']}")
        check(min(during[1:]) >= 1, f"{how}: no all_reduce was launched before the last "
                                    f"compiled piece returned: {during}")
        check(ours["pieces"] == theirs["pieces"] >= 2,
              f"{how}: {ours['pieces']} compiled graphs, torch's DDP {theirs['pieces']}")
        check(ours["breaks"] <= max(theirs["breaks"], GRAPH_BREAKS),  # (torch 2.3/2.4 break once)
              f"{how}: {ours['breaks']} graph breaks, torch's DDP {theirs['breaks']}")
        check(first_difference is None, f"rank {rank}, {how}: miniddp differs from torch's "
                                        f"compiled DDP after step {first_difference}")
        check(ours["losses"][-1] < ours["losses"][0], f"{how}: the loss did not fall")


def refused_cap(backend: str) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    ddp = miniddp.DistributedDataParallel(Tower(), bucket_cap_mb=0.05)
    try:
        torch.compile(ddp, backend=backend)(torch.randn(2, IN_FEATURES))
        message = None
    except AssertionError as error:
        message = str(error)
    print0(f"\n4. bucket_cap_mb=0.05 under torch.compile, refused as torch refuses it:\n  "
           f"{message}")
    check(message is not None and "First bucket should be smaller" in message,
          "a cap below DDPOptimizer's first piece should be refused, as torch's DDP refuses it")


def on_every_rank(backend: str):
    one_graph_and_by_hand(backend)
    like_torch(backend)
    refused_cap(backend)
    return dist.get_world_size()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to fork (ignored under torchrun, which sets its own)")
    parser.add_argument("--backend", default="aot_eager",
                        help="torch.compile's backend: aot_eager (fast), inductor (C++ kernels)")
    args = parser.parse_args()
    if not TORCH_HAS_IS_COMPILING:
        print(f"SKIPPED: this lesson needs torch >= 2.3 (torch.compiler.is_compiling); this is "
              f"torch {torch.__version__}")
        return
    # Imported once here, before the ranks are forked, rather than in every rank (seconds each).
    for name in ("torch._dynamo", "torch._dynamo.backends.distributed",
                 "torch._functorch.aot_autograd"):
        importlib.import_module(name)
    # torch's DDP forward opens a profiler ``record_function``; dynamo, tracing it under
    # torch.compile(DDP(model)), warns that it leaves it out of the graph. Harmless: hidden.
    logging.getLogger("torch._dynamo.variables.ctx_manager").setLevel(logging.ERROR)

    world = launch(on_every_rank, args.nproc, args=(args.backend,), backend="gloo",
                   timeout=600)[0]
    ok(f"{world} ranks, {args.backend}: one compiled graph launches every all_reduce after "
       "backward; cut at the buckets, by hand or by torch's compiler, they overlap it; miniddp "
       "under torch.compile gets torch's pieces, buckets and bits in both orders")


if __name__ == "__main__":
    main()
