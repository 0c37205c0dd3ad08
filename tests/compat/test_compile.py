"""torch.compile with miniddp's DDP: torch's compiler treats it as it treats torch's own.

dynamo's DDPOptimizer cuts a compiled model into pieces at DDP's bucket boundaries, so that
backward runs piece by piece and each bucket's all_reduce starts while the rest of backward
still computes; the gradients' ready order (hence the rebuilt buckets, hence at 3 ranks the
bits) follows those pieces. These tests train the same model with torch's compiled DDP and
miniddp's, in both orders (``DDP(torch.compile(m))`` and ``torch.compile(DDP(m))``), and check
the bits, the number of graphs and graph breaks, and that all_reduces start before backward's
computation ends (miniddp.compat.compiled). The negative control switches the recognition off
on miniddp's side only (``optimize_ddp=False``) and shows the comparison then fails.
"""

from __future__ import annotations

import os

import pytest
import torch

# What the first compile imports, imported before the ranks are forked (conftest.py does the
# same for torch._dynamo): seconds of CPU saved in every rank.
import torch._dynamo.backends.distributed  # noqa: F401
import torch._functorch.aot_autograd  # noqa: F401
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import miniddp
from miniddp.compat.compiled import GRAPH_BREAKS
from miniddp.torch_versions import TORCH_HAS_IS_COMPILING

needs_is_compiling = pytest.mark.skipif(
    not TORCH_HAS_IS_COMPILING,
    reason="torch.compiler.is_compiling (torch 2.3+) tells miniddp's forward it is traced")


class Tower(nn.Module):
    """A user's own model (dynamo compiles user code; it leaves torch.nn.Sequential's frames
    alone under torch.compile(DDP(m))), with ~2 MiB of parameters: a 1 MiB cap gives several
    buckets, hence several compiled pieces."""

    def __init__(self, width: int = 512, depth: int = 2):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for layer in self.hidden:
            h = torch.relu(layer(h))
        return self.out(h)


class SequentialTower(nn.Sequential):
    """The same layers in torch's Sequential: under torch.compile(DDP(m)) every frame is
    torch's, and dynamo compiles none of them, with torch's DDP as with miniddp's."""

    def __init__(self, width: int = 512, depth: int = 2):
        layers = [nn.Linear(16, width), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        super().__init__(*layers, nn.Linear(width, 4))


MODELS = {"tower": Tower, "sequential": SequentialTower}


def _data(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)


def train_compiled(ddp_class, order: str, steps: int, backend: str = "aot_eager",
                   optimize_ddp=True, model_name: str = "tower", **ddp_kwargs) -> dict:
    """Train a compiled Tower with ``ddp_class`` on this rank; return its final parameters,
    the graphs dynamo compiled, its graph breaks and (miniddp) each backward's events."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled_graphs = []

    def counting(gm, example_inputs):  # what DDPOptimizer hands the backend: one per piece
        compiled_graphs.append(len(gm.graph.nodes))
        if backend == "eager_graphs":
            return gm.forward
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    rank = dist.get_rank()
    torch.manual_seed(7 + rank)  # different per rank: construction broadcasts rank 0's
    model = MODELS[model_name]()
    saved = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = optimize_ddp
    try:
        if order == "compile_outside":
            ddp = ddp_class(model, **ddp_kwargs)
            run = torch.compile(ddp, backend=counting)
        else:
            ddp = ddp_class(torch.compile(model, backend=counting), **ddp_kwargs)
            run = ddp
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        events = []
        for step in range(steps):
            x, y = _data(step, rank)
            loss = F.mse_loss(run(x), y)
            if isinstance(ddp, miniddp.DistributedDataParallel):
                with ddp.trace() as trace:
                    mark_compiled_pieces(loss, ddp.reducer)
                    loss.backward()
                events.append([(event, ident) for event, ident, _ in trace.events])
            else:
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        torch._dynamo.config.optimize_ddp = saved
    breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    return {"params": [p.detach().clone() for p in model.parameters()],
            "graphs": len(compiled_graphs), "breaks": breaks, "events": events}


def compare(order: str, steps: int = 2, backend: str = "aot_eager",
            ours_optimize_ddp=True, model_name: str = "tower", **ddp_kwargs) -> dict:
    """Train with torch's compiled DDP, then miniddp's; say what differs."""
    theirs = train_compiled(nn.parallel.DistributedDataParallel, order, steps, backend,
                            model_name=model_name, **ddp_kwargs)
    ours = train_compiled(miniddp.DistributedDataParallel, order, steps, backend,
                          optimize_ddp=ours_optimize_ddp, model_name=model_name, **ddp_kwargs)
    differing = [k for k, (a, b) in enumerate(zip(ours["params"], theirs["params"]))
                 if not torch.equal(a, b)]
    return {"differing": differing, "graphs": (ours["graphs"], theirs["graphs"]),
            "breaks": (ours["breaks"], theirs["breaks"]), "events": ours["events"]}


def mark_compiled_pieces(loss, reducer) -> None:
    """Record ("returns", k) in the reducer's timeline as compiled piece k of backward returns
    its gradients (a post-hook on each CompiledFunctionBackward node of the autograd graph)."""
    seen, todo, pieces = set(), [loss.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in node.name():
            pieces.append(node)
        todo.extend(next_node for next_node, _ in node.next_functions)
    for k, node in enumerate(pieces):
        node.register_hook(lambda _inputs, _outputs, k=k: reducer.emit("returns", k))


def launched_during_backward(events) -> int:
    """All_reduces launched before the last compiled piece of backward returned: communication
    that overlaps computation. (With one compiled graph, every gradient is ready only when the
    whole backward has been computed and the piece returns: none, as measured, not by
    construction.)"""
    returns = [k for k, (event, _) in enumerate(events) if event == "returns"]
    assert returns, "no compiled piece of backward was seen"
    return sum(1 for event, _ in events[:returns[-1]] if event == "launch")


@needs_is_compiling
@pytest.mark.parametrize("order", ["compile_inside", "compile_outside"])
def test_compiled_training_is_bit_identical_to_torchs(ranks, order):
    # 3 ranks: at 2, a sum of two gradients has the same bits in either order, so the bits
    # could not tell whether the buckets follow the compiled pieces
    for rank, result in enumerate(ranks(3).run(compare, order, bucket_cap_mb=1, timeout=120)):
        assert result["differing"] == [], f"rank {rank}: parameters {result['differing']} differ"
        ours, theirs = result["graphs"]
        assert ours == theirs and ours >= 2, f"rank {rank}: graphs (ours, torch's) {ours, theirs}"
        ours, theirs = result["breaks"]
        assert ours <= max(theirs, GRAPH_BREAKS), f"rank {rank}: graph breaks (ours, torch's) " \
                                                  f"{ours, theirs}"
        # the buckets are rebuilt after the first backward; from then on all but the last
        # bucket launch while later pieces of backward still compute
        for step, events in enumerate(result["events"][1:], start=1):
            assert launched_during_backward(events) >= 1, (
                f"rank {rank} step {step}: no all_reduce launched before backward ended")


@needs_is_compiling
@pytest.mark.slow
@pytest.mark.parametrize("option", ["find_unused_parameters", "static_graph",
                                    "gradient_as_bucket_view"])
def test_options_under_compile_stay_bit_identical(ranks, option):
    """The options change how gradients reach the buckets, not what dynamo compiles."""
    results = ranks(3).run(compare, "compile_outside", steps=3, bucket_cap_mb=1,
                           timeout=180, **{option: True})
    for rank, result in enumerate(results):
        assert result["differing"] == [], f"rank {rank}: parameters {result['differing']} differ"
        assert result["graphs"][0] == result["graphs"][1]
        assert launched_during_backward(result["events"][-1]) >= 1


@needs_is_compiling
def test_compiling_ddp_compiles_the_frames_torch_compiles(ranks):
    """torch.compile(DDP(nn.Sequential(...))): dynamo skips torch's own frames, so torch's
    compiled DDP trains the Sequential eagerly; miniddp's must not compile it either (its
    pieces would give other ready orders, other buckets and, at 3 ranks, other bits)."""
    for rank, result in enumerate(ranks(3).run(compare, "compile_outside",
                                               model_name="sequential", bucket_cap_mb=1,
                                               timeout=120)):
        assert result["differing"] == [], f"rank {rank}: parameters {result['differing']} differ"
        assert result["graphs"] == (0, 0), f"rank {rank}: graphs (ours, torch's) {result['graphs']}"
        ours, theirs = result["breaks"]
        assert ours <= max(theirs, GRAPH_BREAKS), f"rank {rank}: graph breaks (ours, torch's) " \
                                                  f"{ours, theirs}"


@needs_is_compiling
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MINIDDP_TEST_INDUCTOR") != "1",
                    reason="inductor compiles C++ kernels: about 2 minutes a rank on a cold "
                           "cache on 2 CPU cores; set MINIDDP_TEST_INDUCTOR=1 to run it")
@pytest.mark.parametrize("order", ["compile_inside", "compile_outside"])
def test_inductor_training_is_bit_identical_to_torchs(ranks, order):
    for rank, result in enumerate(ranks(3).run(compare, order, backend="inductor",
                                               bucket_cap_mb=1, timeout=600)):
        assert result["differing"] == [], f"rank {rank}: parameters {result['differing']} differ"
        assert result["graphs"][0] == result["graphs"][1] >= 2


@needs_is_compiling
def test_without_recognition_bits_and_overlap_are_lost(ranks):
    """The negative control: miniddp's side compiled with optimize_ddp=False (one graph, as
    miniddp was before), torch's as usual. The comparison must fail, or it proves nothing."""
    results = ranks(3).run(compare, "compile_inside", ours_optimize_ddp=False, bucket_cap_mb=1,
                           timeout=120)
    assert any(result["differing"] for result in results), "the comparison cannot fail"
    for result in results:
        ours, theirs = result["graphs"]
        assert ours == 1 < theirs
        assert all(launched_during_backward(events) == 0 for events in result["events"])


def refused(order: str, ddp_class) -> str:
    """The error when the compiled model meets a bucket cap below DDPOptimizer's first bucket."""
    import torch._dynamo

    torch._dynamo.reset()
    model = Tower(width=8, depth=1)
    try:
        if order == "compile_outside":
            run = torch.compile(ddp_class(model, bucket_cap_mb=0.05), backend="aot_eager")
        else:
            run = ddp_class(torch.compile(model, backend="aot_eager"), bucket_cap_mb=0.05)
        run(torch.randn(2, 16))
    except AssertionError as error:
        return str(error)
    finally:
        torch._dynamo.reset()
    return "no error"


@needs_is_compiling
@pytest.mark.parametrize("order", ["compile_inside", "compile_outside"])
def test_a_cap_below_the_first_bucket_is_refused_as_torch_refuses_it(ranks, order):
    for theirs, ours in zip(ranks(2).run(refused, order, nn.parallel.DistributedDataParallel),
                            ranks(2).run(refused, order, miniddp.DistributedDataParallel)):
        assert "First bucket should be smaller/equal to other buckets" in theirs
        assert "First bucket should be smaller/equal to other buckets" in ours
        assert "bucket_cap_mb" in ours and "optimize_ddp" in ours  # and says what to do


def eager_forward_leaves_dynamo_unloaded() -> bool:
    """A fresh interpreter training miniddp eagerly never imports torch._dynamo."""
    import subprocess
    import sys

    code = (
        "import os, sys, torch, torch.distributed as dist, miniddp\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='0')\n"
        "store = dist.HashStore()\n"
        "dist.init_process_group('gloo', store=store, rank=0, world_size=1)\n"
        "ddp = miniddp.DistributedDataParallel(torch.nn.Linear(4, 4))\n"
        "ddp(torch.randn(2, 4)).sum().backward()\n"
        "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.strip() == "False"


def test_eager_training_does_not_import_the_compiler():
    assert eager_forward_leaves_dynamo_unloaded()
