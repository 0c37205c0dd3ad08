"""What a reader must follow to know what one step of DDP runs: the engine stays one small copy.

Two gloo ranks, ``miniddp.DistributedDataParallel`` on a 4-layer MLP; on rank 0,
``sys.settrace`` around one step's forward and backward collects the distinct lines of miniddp's
own code that run. Eight configurations a reader meets first are measured (:data:`CONFIGS`): a
plain step after the bucket rebuild, the step that rebuilds the buckets, the timeline on,
``find_unused_parameters``, ``gradient_as_bucket_view``, torch's ``allreduce_hook``,
``static_graph`` and a ``no_sync`` step. A plain step is measured twice: at an iteration torch's
logging does not sample (12), and at one it samples (3, where the logger listens too).

The budgets (the engine redesign's promise): a plain step runs at most :data:`PLAIN_LINES`
lines in at most :data:`PLAIN_FILES` files (at a sampled iteration, torch's logger adds at most
:data:`LOGGER_LINES` of its own), and the eight together at most :data:`ALL_LINES` distinct
lines: each option adds only the lines where it changes a step, and no step exists twice.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_cases import MLP
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import miniddp
from miniddp.launch import RankGroup

PACKAGE = str(pathlib.Path(miniddp.__file__).resolve().parent)
PLAIN_LINES = 130
PLAIN_FILES = 3
ALL_LINES = 300
LOGGER = "compat/logging_data.py"
LOGGER_LINES = 12
MEASURED_STEP = 12  # after the rebuild (step 2), and not one torch's logging samples
SAMPLED_STEP = 3  # one it samples

#: name -> (DDP's keyword arguments, what to do to it before the measured step, the step)
CONFIGS = {
    "plain": ({}, None, MEASURED_STEP),
    "the rebuild": ({}, None, 2),
    "timeline": ({}, "timeline", MEASURED_STEP),
    "find_unused_parameters": ({"find_unused_parameters": True}, None, MEASURED_STEP),
    "gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, None, MEASURED_STEP),
    "allreduce_hook": ({}, "allreduce_hook", MEASURED_STEP),
    "static_graph": ({"static_graph": True}, None, MEASURED_STEP),
    "no_sync": ({}, "no_sync", MEASURED_STEP),
}


def lines_run(step) -> dict[str, set[int]]:
    """The lines of miniddp's files that run in ``step()`` on this thread, by file."""
    seen: dict[str, set[int]] = {}

    def tracer(frame, event, _arg):
        filename = frame.f_code.co_filename
        if not filename.startswith(PACKAGE):
            return None
        if event == "line":
            seen.setdefault(filename[len(PACKAGE) + 1:], set()).add(frame.f_lineno)
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        step()
    finally:
        sys.settrace(previous)
    return seen


def measure(ddp_kwargs: dict, setting: str | None, measured: int, make_ddp=None):
    """On every rank, train a DDP; on rank 0, the lines step ``measured`` runs, by file."""
    make_ddp = make_ddp or miniddp.DistributedDataParallel
    torch.manual_seed(0)
    ddp = make_ddp(MLP(32, 4), **ddp_kwargs)
    if setting == "timeline":
        ddp.reducer.timeline = []
    elif setting == "allreduce_hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    g = torch.Generator().manual_seed(dist.get_rank())
    result = None
    for number in range(1, measured + 1):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)

        def step(x=x, y=y):
            F.mse_loss(ddp(x), y).backward()

        if number == measured and setting == "no_sync":
            step = _inside_no_sync(ddp, step)
        if number == measured and dist.get_rank() == 0:
            result = {name: sorted(lines) for name, lines in lines_run(step).items()}
        else:
            step()
        ddp.zero_grad(set_to_none=True)
    return result


def _inside_no_sync(ddp, step):
    def accumulating():
        with ddp.no_sync():
            step()
    return accumulating


def measure_all():
    measured = {name: measure(*config) for name, config in CONFIGS.items()}
    measured["plain, sampled"] = measure({}, None, SAMPLED_STEP)
    return measured


def total(files: dict) -> int:
    return sum(len(lines) for lines in files.values())


def union(measured: dict) -> int:
    return len({(name, line) for files in measured.values() for name, lines in files.items()
                for line in lines})


def over_budget(measured: dict) -> list[str]:
    """What breaks the budgets, or nothing."""
    wrong = []
    for name in ("plain", "plain, sampled"):
        files = dict(measured[name])
        logger = len(files.pop(LOGGER, [])) if name == "plain, sampled" else 0
        counts = ", ".join(f"{f} {len(lines)}" for f, lines in sorted(files.items()))
        if total(files) > PLAIN_LINES or len(files) > PLAIN_FILES:
            wrong.append(f"{name}: {total(files)} lines in {len(files)} files ({counts}); a "
                         f"plain step may run at most {PLAIN_LINES} lines in {PLAIN_FILES} files")
        if logger > LOGGER_LINES:
            wrong.append(f"{name}: torch's logger ran {logger} lines, at most {LOGGER_LINES}")
    eight = {name: files for name, files in measured.items() if name in CONFIGS}
    if union(eight) > ALL_LINES:
        wrong.append(f"the eight configurations run {union(eight)} distinct lines together, "
                     f"at most {ALL_LINES} allowed: is a step written twice?")
    return wrong


@pytest.fixture(scope="module")
def own_ranks():
    """Two ranks of this module's own: the shared pool's processes keep what earlier tests on
    this worker left in them (the environment they were forked with, patches, listeners), and
    a count of the lines a step runs would count those too."""
    group = RankGroup(2, pg_timeout=20.0)
    yield group
    group.close()


@pytest.fixture(scope="module")
def measured(own_ranks):
    return own_ranks.run(measure_all, timeout=120)[0]


def test_the_plain_step_runs_the_engine_only(measured):
    """The wrapper, the reducer and its buckets; a sampled step, torch's logging too."""
    assert set(measured["plain"]) == {"core.py", "reducer.py", "buckets.py"}, measured["plain"]
    assert set(measured["plain, sampled"]) <= {"core.py", "reducer.py", "buckets.py", LOGGER}


def test_one_copy_of_the_steps_within_budget(measured):
    report = {name: total(files) for name, files in measured.items()}
    assert over_budget(measured) == [], report


def test_the_measure_sees_each_option(measured):
    """The measure sees the engine and the options it names (a tracer that saw nothing would
    pass any budget)."""
    for files in measured.values():
        assert {"core.py", "reducer.py"} <= set(files), files
    assert total(measured["plain"]) > 40
    for name, module in [("find_unused_parameters", "options/unused.py"),
                         ("gradient_as_bucket_view", "options/gradient_views.py"),
                         ("allreduce_hook", "options/comm_hooks.py"),
                         ("static_graph", "options/static_graph.py")]:
        assert module in measured[name], (name, sorted(measured[name]))


def test_the_budget_fails_on_a_step_that_grew(own_ranks):
    """Negative control: the same measure over a DDP whose forward runs 200 more lines in two
    more files is over every budget."""
    measured = own_ranks.run(measure_padded, timeout=60)[0]
    wrong = over_budget(measured)
    assert len(wrong) == 3, wrong  # the plain step, the sampled one and the eight together
    assert f"may run at most {PLAIN_LINES} lines in {PLAIN_FILES} files" in wrong[0]


def measure_padded():
    import miniddp.ddp as ddp_module

    def padded(model, **kwargs):
        ddp = ddp_module.DistributedDataParallel(model, **kwargs)
        original = ddp.forward
        padding_a = _padding_function("a", 100)
        padding_b = _padding_function("b", 100)

        def forward(*args, **kwargs):
            padding_a()
            padding_b()
            return original(*args, **kwargs)
        ddp.forward = forward
        return ddp
    return {"plain": measure({}, None, MEASURED_STEP, padded),
            "plain, sampled": measure({}, None, SAMPLED_STEP, padded),
            "the rebuild": measure({}, None, 2, padded)}


def _padding_function(name: str, lines: int):
    """A function of ``lines`` statements compiled as if it were a miniddp file of its own."""
    body = "\n".join(f"    x{i} = {i}" for i in range(lines))
    code = compile(f"def pad():\n{body}\n", f"{PACKAGE}/padding_{name}.py", "exec")
    namespace: dict = {}
    exec(code, namespace)
    return namespace["pad"]
