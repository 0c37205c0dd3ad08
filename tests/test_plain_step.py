"""The plain synchronized step stays small: what a reader must follow from ``ddp(x)`` to averaged
``.grad`` with default arguments.

Two gloo ranks, ``miniddp.DistributedDataParallel(model)`` on a 4-layer MLP; on rank 0,
``sys.settrace`` around one step's forward and backward collects the distinct lines of miniddp's
own code that run. Two steps after the bucket rebuild are measured: step 3, which torch's
logging samples (it times the first ten steps, then one in a hundred), and step 12, which it
does not. The budget is the engine's promise that its plain path is the small version and every
option attaches elsewhere: at most :data:`MAX_LINES` lines in at most :data:`MAX_FILES` files
(the target), and never more than :data:`MEASURED_NOW` (what it runs today).
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F
from ddp_cases import MLP

import miniddp
from miniddp.launch import RankGroup

PACKAGE = str(pathlib.Path(miniddp.__file__).resolve().parent)
MAX_LINES = 110
MAX_FILES = 3
MEASURED_STEPS = (3, 12)  # sampled by torch's logging, and not
#: What the plain step runs now, per step: it may shrink, never grow.
MEASURED_NOW = {3: 107, 12: 94}


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


def measure_plain_steps(make_ddp=miniddp.DistributedDataParallel):
    """On every rank, train the default DDP; on rank 0, the lines each measured step runs."""
    import torch.distributed as dist

    torch.manual_seed(0)
    ddp = make_ddp(MLP(32, 4))
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    measured = {}
    for number in range(1, max(MEASURED_STEPS) + 1):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)

        def step(x=x, y=y):
            F.mse_loss(ddp(x), y).backward()

        if number in MEASURED_STEPS and rank == 0:
            measured[number] = {name: sorted(lines) for name, lines in lines_run(step).items()}
        else:
            step()
        ddp.zero_grad(set_to_none=True)
    return measured


def over_budget(measured: dict, max_lines: dict | int = MAX_LINES,
                max_files: int = MAX_FILES) -> list[str]:
    """What is wrong with each measured step, or nothing. ``max_lines``: one budget for every
    step, or one per step."""
    wrong = []
    for number, files in measured.items():
        budget = max_lines[number] if isinstance(max_lines, dict) else max_lines
        total = sum(len(lines) for lines in files.values())
        counts = ", ".join(f"{name} {len(lines)}" for name, lines in sorted(files.items()))
        if total > budget or len(files) > max_files:
            wrong.append(f"step {number}: {total} lines in {len(files)} files ({counts}); the "
                         f"plain step may run at most {budget} lines in {max_files} files: "
                         "attach what grew to a seam instead of the plain path")
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
    return own_ranks.run(measure_plain_steps)[0]


def test_the_plain_step_stays_in_the_engine(measured):
    """The wrapper, the reducer and the logger's count of iterations: nothing else runs."""
    assert set(measured) == set(MEASURED_STEPS)
    for files in measured.values():
        assert set(files) <= {"core.py", "reducer.py", "options/logging_data.py"}, files
    assert over_budget(measured, MEASURED_NOW) == []


def test_the_plain_step_reads_in_one_sitting(measured):
    assert over_budget(measured) == []


def test_the_measure_sees_the_engine(measured):
    """The measure sees the engine itself (a tracer that saw nothing would pass any budget)."""
    for files in measured.values():
        assert {"core.py", "reducer.py"} <= set(files), files
        assert sum(len(lines) for lines in files.values()) > 40, files


def test_the_budget_fails_on_a_step_that_grew(own_ranks):
    """Negative control: the same measure over a DDP whose forward runs 120 more lines in two
    more files is over budget."""
    measured = own_ranks.run(measure_padded_steps)[0]
    wrong = over_budget(measured)
    assert len(wrong) == len(MEASURED_STEPS), wrong
    assert f"may run at most {MAX_LINES} lines in {MAX_FILES} files" in wrong[0]
    assert len(over_budget(measured, MEASURED_NOW)) == len(MEASURED_STEPS)


def measure_padded_steps():
    import miniddp.ddp as ddp_module

    def padded(ddp):
        original = ddp.forward
        padding_a = _padding_function("a", 60)
        padding_b = _padding_function("b", 60)

        def forward(*args, **kwargs):
            padding_a()
            padding_b()
            return original(*args, **kwargs)
        ddp.forward = forward
        return ddp
    return measure_plain_steps(lambda model: padded(ddp_module.DistributedDataParallel(model)))


def _padding_function(name: str, lines: int):
    """A function of ``lines`` statements compiled as if it were a miniddp file of its own."""
    body = "\n".join(f"    x{i} = {i}" for i in range(lines))
    code = compile(f"def pad():\n{body}\n", f"{PACKAGE}/padding_{name}.py", "exec")
    namespace: dict = {}
    exec(code, namespace)
    return namespace["pad"]
