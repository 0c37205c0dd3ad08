"""The mechanisms the lessons write out by hand agree with the library and with torch.

A lesson's version is the minimal one and the library's the complete one; these tests hold them
together, so neither can drift: the ring of lesson 01 against ``dist.all_reduce``, the buckets
of lesson 05 against ``miniddp.buckets`` and torch's assignment, the ``SmallReducer`` of lesson
06 against ``miniddp.DistributedDataParallel`` and torch's DDP, the ``no_sync`` by hand of
lesson 07 against torch's DDP, lesson 14's reading of where a rank waited, lesson 16's count
of all_reduces launched during a compiled backward. Each has a control that shows the
comparison can fail.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lesson_modules import LESSONS_DIR, load_lesson, runnable_here
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from warm_python import LESSON_PRELOAD, warm_python

import miniddp
from course.data import make_dataset, make_model
from miniddp.buckets import assign_buckets
from miniddp.checks.bits import same_bits
from miniddp.torch_versions import EXPLICIT_CAP_COVERS_FIRST_BUCKET

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support" / "breakage"))
try:
    from breakages import BREAKAGES as _BY_NAME
finally:
    sys.path.pop(0)
BREAKAGES = {name: patch for name, (_, patch) in _BY_NAME.items()}

ring = load_lesson("01")
buckets = load_lesson("05")
overlap = load_lesson("06")
timeline = load_lesson("06_overlap_timeline")
accumulation = load_lesson("07")
uneven = load_lesson("14")
compiled = load_lesson("16")


# ----- lesson 01: the ring -----

def ring_against_all_reduce(dtype):
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    results = []
    for n in (1, 5, 1000, 4099):
        t = (torch.randint(-10**6, 10**6, (n,), generator=g) if dtype == "int"
             else torch.randn(n, generator=g))
        theirs = t.clone()
        dist.all_reduce(theirs)
        results.append(same_bits(ring.ring_all_reduce(t.clone()), theirs))
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_by_hand_equals_all_reduce_exactly_on_integers(ranks, world):
    assert all(all(r) for r in ranks(world).run(ring_against_all_reduce, "int"))


def test_ring_by_hand_equals_all_reduce_bit_for_bit_on_floats_at_2_ranks(ranks):
    assert all(all(r) for r in ranks(2).run(ring_against_all_reduce, "float"))


def test_ring_by_hand_sums_each_chunk_in_its_own_order_at_3_ranks(ranks):
    assert ranks(3).run(ring.summation_order) == [3, 3, 3]


# ----- lesson 05: buckets -----

def random_tensors(seed: int):
    g = torch.Generator().manual_seed(seed)
    count = int(torch.randint(1, 15, (), generator=g))
    sizes = torch.randint(1, 4000, (count,), generator=g).tolist()
    dtypes = [torch.float64 if torch.rand((), generator=g) < 0.3 else torch.float32
              for _ in sizes]
    order = torch.randperm(count, generator=g).tolist()
    return [torch.empty(n, dtype=d) for n, d in zip(sizes, dtypes)], order


@pytest.mark.parametrize("seed", range(40))
def test_buckets_by_hand_equal_the_library_in_any_order(seed):
    tensors, order = random_tensors(seed)
    first, cap = 3000, 7000
    ours = assign_buckets([tensors[i] for i in order], [first, cap], order)
    assert buckets.assign_by_hand(tensors, order, first, cap) == ours


@pytest.mark.parametrize("seed", range(40))
def test_buckets_by_hand_at_construction_equal_torchs_reversed(seed):
    tensors, _ = random_tensors(seed)
    theirs, _ = dist._compute_bucket_assignment_by_size(tensors, [3000, 7000])
    assert buckets.at_construction(tensors, 3000, 7000) == list(reversed(theirs))


def test_buckets_by_hand_close_a_bucket_that_holds_exactly_the_limit():
    tensors = [torch.empty(500) for _ in range(4)]  # 2000 bytes each
    ours = assign_buckets(tensors, [4000, 2000])
    assert buckets.assign_by_hand(tensors, range(4), 4000, 2000) == ours == [[0, 1], [2], [3]]


def test_buckets_by_hand_control_forgetting_the_reversal_is_caught():
    tensors = [torch.empty(1000) for _ in range(6)]
    theirs, _ = dist._compute_bucket_assignment_by_size(tensors, [4000, 8000])
    forgotten = sorted(buckets.assign_by_hand(tensors, range(6), 4000, 8000), key=min)
    assert forgotten != list(reversed(theirs))


def grads_in_buckets_vs_miniddp(cap_mb, layout_from="ddp"):
    """One backward through miniddp's DDP and through lesson 05's buckets by hand."""
    ddp = miniddp.DistributedDataParallel(buckets.deep_student(torch.device("cpu")),
                                          bucket_cap_mb=cap_mb)
    x, y = make_dataset(n=16, seed=dist.get_rank()).tensors
    for _ in range(2):  # the second backward runs on the rebuilt buckets
        ddp.zero_grad()
        F.mse_loss(ddp(x), y).backward()
    layout = [b.param_indices for b in ddp.buckets]
    if layout_from == "one bucket":
        layout = [sorted(i for b in layout for i in b)]
    plain = buckets.deep_student(torch.device("cpu"))
    F.mse_loss(plain(x), y).backward()
    buckets.all_reduce_in_buckets(list(plain.parameters()), layout)
    return all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), ddp.parameters()))


@pytest.mark.parametrize("world", [2, 3])
def test_buckets_by_hand_average_like_miniddp_bit_for_bit(ranks, world):
    assert all(ranks(world).run(grads_in_buckets_vs_miniddp, 0.2))


def test_buckets_by_hand_control_another_layout_differs_at_3_ranks(ranks):
    assert not all(ranks(3).run(grads_in_buckets_vs_miniddp, 0.2, "one bucket"))


# ----- lesson 06: the small reducer -----

@pytest.mark.parametrize("world", [2, 3])
def test_small_reducer_equals_torchs_ddp_at_every_step(ranks, world):
    buckets = 5 if EXPLICIT_CAP_COVERS_FIRST_BUCKET else 4  # before 2.4: a 1 MiB first bucket
    assert ranks(world).run(overlap.small_reducer_matches_torch, 3) == [buckets] * world


def small_reducer_vs_miniddp(cap_mb, break_it=False):
    device = torch.device("cpu")
    ddp = miniddp.DistributedDataParallel(overlap.wide_student(device), bucket_cap_mb=cap_mb)
    model = overlap.wide_student(device)
    reducer = overlap.SmallReducer(model, [list(range(len(list(model.parameters()))))])
    x, y = make_dataset(n=16, seed=dist.get_rank()).tensors
    same = []
    for s in range(3):
        for m in (ddp, model):
            m.zero_grad()
            F.mse_loss(m(x), y).backward()
        if s == 0 and not break_it:  # both rebuild now: the reducer from its own ready order
            order = [i for event, i, _ in reducer.timeline if event == "ready"]
            reducer.set_buckets(overlap.rebuilt_buckets(reducer.params, order,
                                                        *miniddp.buckets.bucket_limits(cap_mb)))
        same.append(all(torch.equal(p.grad, q.grad)
                        for p, q in zip(model.parameters(), ddp.parameters())))
    return same, reducer.buckets == [b.param_indices for b in ddp.buckets]


@pytest.mark.parametrize("world", [2, 3])
def test_small_reducer_equals_miniddp_with_the_same_buckets(ranks, world):
    for same, same_buckets in ranks(world).run(small_reducer_vs_miniddp, 0.3):
        assert same == [True, True, True] and same_buckets


def test_small_reducer_control_without_the_rebuild_differs_at_3_ranks(ranks):
    results = ranks(3).run(small_reducer_vs_miniddp, 0.3, True)
    assert any(not all(same) for same, _ in results)


# ----- lesson 07: no_sync by hand -----

def no_sync_by_hand_vs_torch(wrapper: str, k: int = 3, steps: int = 2):
    """Accumulation steps, then the trap (forward inside no_sync, backward outside), on the
    lesson's wrapper and on torch's DDP: (all_reduces per step, parameters the same bits after
    each step, trap gradients the same bits, largest parameter difference)."""
    rank = dist.get_rank()
    mine = getattr(accumulation, wrapper)(make_model(seed=0))
    theirs = TorchDDP(make_model(seed=0))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in (mine, theirs)]
    x, y = make_dataset(n=16 * k * steps, seed=rank).tensors
    calls, same, worst = [], [], 0.0
    for s in range(steps):
        micro = list(zip(x[16 * k * s:16 * k * (s + 1)].chunk(k),
                         y[16 * k * s:16 * k * (s + 1)].chunk(k)))
        before = mine.all_reduces
        for ddp, optimizer in zip((mine, theirs), optimizers):
            accumulation.accumulation_step(ddp, optimizer, micro)
        calls.append(mine.all_reduces - before)
        same.append(all(same_bits(p, q) for p, q in zip(mine.parameters(), theirs.parameters())))
        worst = max(worst, max((p - q).abs().max().item()
                               for p, q in zip(mine.parameters(), theirs.parameters())))
    mine = getattr(accumulation, wrapper)(make_model(seed=0))  # the same start for both
    theirs = TorchDDP(make_model(seed=0))
    for ddp in (mine, theirs):
        with ddp.no_sync():
            out = ddp(x[:16])
        F.mse_loss(out, y[:16]).backward()
    trap = all(same_bits(p.grad, q.grad) for p, q in zip(mine.parameters(), theirs.parameters()))
    return calls, same, trap, worst


@pytest.mark.parametrize("world", [2, 3])
def test_no_sync_by_hand_synchronizes_like_torchs_ddp(ranks, world):
    params = len(list(make_model(seed=0).parameters()))
    for calls, same, trap, worst in ranks(world).run(no_sync_by_hand_vs_torch,
                                                     "FlagReadAtForward"):
        assert calls == [params, params]  # one per parameter, in the last micro-batch only
        assert trap  # not synchronized, as torch's: each rank's own gradients, bit for bit
        if world == 2:  # a sum of two is the same in any order: per parameter or per bucket
            assert same == [True, True]
        assert worst < 1e-6


def test_no_sync_by_hand_control_read_at_backward_differs_in_the_trap(ranks):
    for _, same, trap, _ in ranks(2).run(no_sync_by_hand_vs_torch, "FlagReadAtBackward"):
        assert same == [True, True] and not trap  # the steps agree; only the trap tells


# The lesson itself, its wrapper by hand edited to read the flag in the hooks: the lesson's own
# check must fail, naming the wrapper (its class lives in the lesson, out of a breakage's reach)
RUN_EDITED = """
import os, sys
import __main__
path, old, new = sys.argv[1:4]
source = open(path).read()
assert source.count(old) == 1, f"the lesson no longer holds {old!r}"
sys.argv = [path]
sys.path[0] = os.path.dirname(path)  # as python does for a script
__main__.__file__ = path
exec(compile(source.replace(old, new), path, "exec"), __main__.__dict__)
"""


def run_script(code: str, args: list[str], tmp_path) -> subprocess.CompletedProcess:
    """``python -c code args`` as a learner's shell would run it, from a warm interpreter
    (``tests/support/warm_python.py``: without the seconds of ``import torch``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["MINIDDP_RUNS"] = str(tmp_path)
    script = tmp_path / "run.py"
    script.write_text(code)
    return warm_python(LESSON_PRELOAD).run(
        [sys.executable, str(script), *args], env=env, cwd=LESSONS_DIR.parent, timeout=180)


def run_edited(lesson: str, old: str, new: str, tmp_path) -> subprocess.CompletedProcess:
    """Run the lesson ``lesson`` (a glob) with ``old`` replaced by ``new`` in its source."""
    return run_script(RUN_EDITED, [str(next(LESSONS_DIR.glob(lesson))), old, new], tmp_path)


@pytest.mark.lesson
def test_lesson_07_fails_when_its_wrapper_by_hand_reads_the_flag_at_backward_time(tmp_path):
    done = run_edited("07_no_sync_accumulation.py",
                      "        if self.sync_this_backward:  # what forward noted",
                      "        if self.require_backward_grad_sync:  # what forward noted",
                      tmp_path)
    assert done.returncode != 0, done.stdout
    assert "by hand: after a forward inside no_sync and its backward outside, every rank held " \
           "the same gradients" in done.stderr, done.stderr[-2000:]
    assert "OK:" not in done.stdout


def synchronous_timeline():
    """A training step of miniddp's DDP whose every all_reduce is waited for at its launch."""
    ddp = miniddp.DistributedDataParallel(overlap.wide_student(torch.device("cpu")),
                                          bucket_cap_mb=overlap.BUCKET_CAP_MB)
    x, y = make_dataset(n=32, seed=dist.get_rank()).tensors
    launch = ddp.reducer._launch

    def launch_and_wait(bucket):
        launch(bucket)
        bucket.work.wait()

    counts = []
    for synchronous in (False, True, False, True, False, False):
        ddp.reducer._launch = launch_and_wait if synchronous else launch
        ddp.reducer.timeline = []
        F.mse_loss(ddp(x), y).backward()
        counts.append(timeline.ready_while_in_flight(ddp.reducer.timeline))
    return counts


def test_ready_while_in_flight_sees_overlap_and_not_synchronous_all_reduces(ranks):
    counts = ranks(2).run(synchronous_timeline)
    assert all(c[1] == 0 and c[3] == 0 for c in counts), counts
    assert any(c[k] > 0 for c in counts for k in (2, 4, 5)), counts  # c[0]: one bucket


def test_ready_while_in_flight_counts_gradients_between_launch_and_done():
    events = [("ready", 0, 1.0), ("launch", 0, 2.0), ("ready", 1, 3.0), ("done", 0, 4.0),
              ("ready", 2, 5.0), ("launch", 1, 6.0), ("done", 1, 7.0)]
    assert timeline.ready_while_in_flight(events) == 1


# Ways to lose the overlap, each applied from outside before the lesson runs. (Waiting for
# the first bucket only is not one: the later buckets still overlap, and the lesson says so.)
NO_OVERLAP = {
    "every all_reduce waited for at its launch": """
launch = reducer.Reducer._launch
def launch_and_wait(self, bucket):
    launch(self, bucket)
    bucket.work.wait()
reducer.Reducer._launch = launch_and_wait
""",
    "every bucket launched after backward": """
init = reducer.Reducer.__init__
def after_backward(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.overlap = False
reducer.Reducer.__init__ = after_backward
""",
}
RUN_LESSON = """
import os, runpy, sys
import miniddp.reducer as reducer
{patch}
sys.argv = [sys.argv[1]]
sys.path[0] = os.path.dirname(sys.argv[0])  # as python does for a script
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.lesson
@pytest.mark.parametrize("how", sorted(NO_OVERLAP))
def test_lesson_06_fails_when_communication_does_not_overlap_backward(tmp_path, how):
    done = run_script(RUN_LESSON.format(patch=NO_OVERLAP[how]),
                      [str(LESSONS_DIR / "06_overlap_timeline.py")], tmp_path)
    assert done.returncode != 0, done.stdout
    assert "while an all_reduce is in flight" in done.stderr, done.stderr[-2000:]
    assert "OK:" not in done.stdout


# ----- lesson 06: what the trace prints -----

TRACE_LINE = re.compile(r"\s*[\d.]+ ms  (\w+)\s+(?:bucket (\d+)|(\S+) -> bucket (\d+) "
                        r"\((\d+)/(\d+)\))?")


def trace_problems(lines: list[str], names: list[str], buckets: int) -> list[str]:
    """What is wrong with one rank's trace, read from the lines it prints (what lesson 06's
    ``--trace`` shows a learner): every parameter ready
    once; each bucket launched once, in order, once all its gradients are in; then the end of
    backward; every launched bucket waited for, in order, after it; the write-back last."""
    events, complete = [], set()  # (kind, bucket or parameter, buckets complete so far)
    for line in lines:
        found = TRACE_LINE.match(line)
        if not found:
            continue
        kind, bucket, name, into, filled, size = found.groups()
        if kind == "ready" and name is not None:
            if filled == size:
                complete.add(int(into))
            events.append((kind, name, set(complete)))
        else:
            events.append((kind, None if bucket is None else int(bucket), set(complete)))
    kinds = [kind for kind, _, _ in events]
    problems = []
    ready = [name for kind, name, _ in events if kind == "ready"]
    if sorted(ready) != sorted(names):
        problems.append(f"{len(ready)} 'ready' lines for {len(names)} parameters")
    launched = [b for kind, b, _ in events if kind == "launch"]
    waited = [b for kind, b, _ in events if kind == "waited"]
    if launched != list(range(buckets)):
        problems.append(f"buckets launched {launched}, expected {list(range(buckets))}")
    if waited != launched:
        problems.append(f"buckets waited for {waited}, but launched {launched}: every launched "
                        "all_reduce must be waited for, in launch order")
    early = [b for kind, b, complete in events if kind == "launch" and b not in complete]
    if early:
        problems.append(f"buckets {early} launched before their last gradient was ready")
    if kinds.count("backward") != 1 or kinds.count("finalized") != 1:
        problems.append(f"{kinds.count('backward')} 'backward' and {kinds.count('finalized')} "
                        "'finalized' lines, expected one each")
        return problems
    end, written = kinds.index("backward"), kinds.index("finalized")
    if "ready" in kinds[end:]:
        problems.append("a gradient ready after the end of backward")
    if any(kind == "waited" and not end < at < written for at, kind in enumerate(kinds)):
        problems.append("a wait outside the end of backward and the write-back")
    if any(kind != "done" for kind in kinds[written + 1:]):
        problems.append(f"events after the write-back: {kinds[written + 1:]}")
    return problems



NAMES = ["2.bias", "2.weight", "0.bias", "0.weight"]
BUCKETS = [[0, 1], [2, 3]]
GOOD = [("ready", 0), ("ready", 1), ("launch", 0), ("ready", 2), ("ready", 3), ("launch", 1),
        ("backward_end", -1), ("done", 0), ("waited", 0), ("done", 1), ("waited", 1),
        ("finalized", -1)]


def trace_lines(events) -> list[str]:
    from miniddp.buckets import BucketInfo
    from miniddp.checks.trace import BackwardTrace

    buckets = [BucketInfo(index=b, names=[NAMES[i] for i in members], param_indices=members,
                          numel=2, nbytes=8, dtype=torch.float32, device=torch.device("cpu"))
               for b, members in enumerate(BUCKETS)]
    trace = BackwardTrace(names=NAMES, buckets=buckets,
                          events=[(e, i, 0.001 * k) for k, (e, i) in enumerate(events)])
    return trace.lines()


def without(kind, events=GOOD):
    return [e for e in events if e[0] != kind]


def moved(event, to, events=GOOD):
    rest = [e for e in events if e != event]
    return rest[:to] + [event] + rest[to:]


TRACES = {  # name: (events, words one of the problems must hold)
    "no waits": (without("waited"), "waited for []"),
    "no launches": (without("launch"), "launched []"),
    "a wait missing": ([e for e in GOOD if e != ("waited", 0)], "waited for [1]"),
    "waits in reverse": (moved(("waited", 1), 8), "waited for [1, 0]"),
    "launches in reverse": (moved(("launch", 1), 2), "launched [1, 0]"),
    "a bucket launched before its last gradient": (moved(("launch", 0), 1),
                                                    "launched before their last gradient"),
    "a wait before the end of backward": (moved(("waited", 0), 5),
                                          "a wait outside the end of backward"),
    "a wait after the write-back": (moved(("waited", 1), 11), "a wait outside"),
    "no write-back": (without("finalized"), "'finalized' lines"),
    "no end of backward": (without("backward_end"), "'backward' and"),
    "a gradient after the end of backward": (moved(("ready", 3), 6), "after the end of backward"),
    "a gradient missing": ([e for e in GOOD if e != ("ready", 0)],
                           "3 'ready' lines for 4 parameters"),
}


def test_trace_check_passes_a_right_trace():
    assert trace_problems(trace_lines(GOOD), NAMES, len(BUCKETS)) == []


@pytest.mark.parametrize("case", sorted(TRACES))
def test_trace_check_names_what_a_wrong_trace_shows(case):
    events, words = TRACES[case]
    problems = trace_problems(trace_lines(events), NAMES, len(BUCKETS))
    assert any(words in p for p in problems), problems


def printed_trace_problems(breakage: str | None = None) -> list[list[str]]:
    """One backward of lesson 06's model, traced on every rank; the problems found in what
    each rank's trace prints. ``breakage`` (of tests/support/breakage) is applied to the trace's
    printing for this call only."""
    from miniddp.checks import trace as trace_module

    saved = trace_module.BackwardTrace.lines
    if breakage:
        BREAKAGES[breakage](trace_module)
    try:
        ddp = miniddp.DistributedDataParallel(overlap.wide_student(torch.device("cpu")),
                                              bucket_cap_mb=overlap.BUCKET_CAP_MB)
        x, y = make_dataset(n=16, seed=dist.get_rank()).tensors
        F.mse_loss(ddp(x), y).backward()  # the buckets are rebuilt at the next forward
        loss = F.mse_loss(ddp(x), y)
        with ddp.trace(all_ranks=True) as trace:
            loss.backward()
        names = [name for name, _ in ddp.module.named_parameters()]
        return [trace_problems(each.lines(), names, len(ddp.buckets)) for each in trace.others]
    finally:
        trace_module.BackwardTrace.lines = saved


def test_the_printed_trace_of_a_real_backward_shows_the_reducers_work(ranks):
    for problems_by_rank in ranks(2).run(printed_trace_problems):
        assert problems_by_rank == [[], []]


@pytest.mark.parametrize("breakage, words", [
    ("trace_drops_waits", "buckets waited for []"),
    ("trace_drops_launches", "buckets launched []"),
    ("trace_waits_reversed", "buckets waited for [4, 3, 2, 1, 0]" if
     EXPLICIT_CAP_COVERS_FIRST_BUCKET else "buckets waited for [3, 2, 1, 0]")])
def test_control_a_trace_that_prints_wrong_is_caught(ranks, breakage, words):
    for problems_by_rank in ranks(2).run(printed_trace_problems, breakage):
        assert all(any(words in p for p in problems) for problems in problems_by_rank), \
            problems_by_rank


# ----- lesson 14: which collective a rank waited in -----

def test_collective_of_tells_the_rebuild_broadcast_from_the_gradient_all_reduce():
    def rebuilt_assignment():  # where miniddp broadcasts the rebuilt bucket order
        raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")

    with pytest.raises(RuntimeError) as in_forward:
        rebuilt_assignment()
    assert "rebuild's broadcast" in uneven.collective_of(in_forward.value)

    class FailsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")

    with pytest.raises(RuntimeError) as in_backward:
        FailsInBackward.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert "gradient all_reduce" in uneven.collective_of(in_backward.value)


# ----- lesson 16: all_reduces launched while a compiled backward still computes -----

def test_overlapping_counts_launches_before_the_last_compiled_piece_returns():
    one_piece = [("compute", 0), ("returns", 0), ("ready", 0), ("launch", 0), ("done", 0)]
    assert compiled.overlapping(one_piece) == 0
    # one piece too, but the launch before it returned: counted (before, it could not be)
    inside = [("compute", 0), ("ready", 0), ("launch", 0), ("returns", 0), ("done", 0)]
    assert compiled.overlapping(inside) == 1
    pieces = [("compute", 0), ("returns", 0), ("ready", 0), ("launch", 0), ("compute", 1),
              ("returns", 1), ("ready", 1), ("launch", 1), ("done", 0), ("done", 1)]
    assert compiled.overlapping(pieces) == 1


@pytest.mark.lesson
@runnable_here("16_compile")
def test_lesson_16_fails_when_its_one_graph_is_cut_into_pieces(tmp_path):
    """Section 1 with dynamo's splitting on: the graph it calls one is in pieces, all_reduces are
    launched between them, and the lesson's overlap check (not only its count of graphs) says
    so."""
    done = run_edited("16_*.py", "backend,\n                  split=False)",
                      "backend,\n                  split=True)", tmp_path)
    assert done.returncode != 0, done.stdout
    assert "one compiled graph cannot overlap, yet [0, " in done.stderr, done.stderr[-2000:]
    assert "OK:" not in done.stdout
