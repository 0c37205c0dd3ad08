"""Each lesson's OK means its mechanism works: broken from outside, the lesson fails.

Every case runs a lesson as a learner would (``python lessons/NN_topic.py``, in a process of its
own forked from an interpreter that has imported torch already: ``tests/support/warm_python.py``)
with
one mechanism broken by ``tests/support/breakage`` (see ``breakages.py``: the library or the
collective
is patched in every process the lesson starts, torchrun's workers included), and asserts that the
lesson exits non-zero with the message of the check that proves that mechanism. A lesson that
still printed OK would prove nothing. Lesson 06's synchronous all_reduce is tested in
test_lesson_mechanisms.py, beside the mechanism it breaks.

Where a whole lesson costs far more than the part of it that proves the mechanism, and the lesson
has that part as a function, only that part runs, in the session's pool of ranks, with the same
breakage (``PARTS``, below). The lesson's plain run (test_lessons.py) shows the part passing.
"""

import functools
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lesson_modules import CANNOT_RUN_HERE, load_lesson, runnable_here
from runs_ahead import RunsAhead, selected
from warm_python import LESSON_PRELOAD, warm_python

from course import runner
from miniddp.launch import RankError, rank_device

REPO = Path(__file__).resolve().parents[2]
BREAKAGE_DIR = Path(__file__).resolve().parents[1] / "support" / "breakage"
TIMEOUT = 120

# lesson, what is broken, the message of the check that must fail
# (lesson 11 runs with --rounds 4: its correctness checks come after the timed rounds; lesson 13
# at 3 ranks, where its fp32 hook and the hook-less reducer must round differently)
ARGUMENTS = {"11_benchmarking_buckets": ["--rounds", "4"],
             "13_communication_hooks": ["--nproc", "3"]}
CASES = [
    ("00_one_process", "no_optimizer_step", "the model did not learn"),
    ("01_processes_and_collectives", "all_reduce_does_nothing",
     re.compile(r"all_reduce gave \[.*\], expected \d+ everywhere")),
    ("02_naive_data_parallel", "reversed_gather",
     "DataParallel must compute the plain module's output and gradients"),
    ("03_data_parallel_by_hand", "all_reduce_does_nothing",
     "the ranks ended with different weights"),
    ("04_the_sampler", "set_epoch_ignored",
     "with set_epoch, three epochs must give three different orders"),
    ("07_no_sync_accumulation", "no_sync_ignored", "all_reduce calls"),
    ("07_no_sync_accumulation_traps", "no_sync_outputs_unwatched",
     "the reduction that the validation forward prepared never completed"),
    ("10_mixed_precision", "no_grad_scaler", "gradients still rounded to zero"),
    ("11_benchmarking_buckets", "bucket_cap_ignored", "miniddp's buckets differ from torch's"),
    ("13_communication_hooks", "comm_hook_ignored",
     "mean on miniddp differs from torch's DDP after step"),
    # the reducer divides by 3 as the hook does: the rounding the lesson shows is gone
    ("13_communication_hooks", "divide_instead_of_multiply",
     "at 3 ranks fp32 mean ended bit for bit equal to the hook-less run"),
    ("14_uneven_inputs", "join_ignores_the_divisor",
     "miniddp differs from torch's DDP under join"),
    # join's final sync from another rank than the last to finish: every step matched torch
    ("14_uneven_inputs", "join_syncs_from_the_first_joiner",
     "after the join, miniddp's final model differs from torch's DDP's"),
    ("14_uneven_inputs", "join_syncs_from_rank_0",
     "after the join, miniddp's final model differs from torch's DDP's"),
    ("14_uneven_inputs", "join_skips_the_final_sync",
     "after the join, miniddp's final model differs from torch's DDP's"),
    # the reducer's record (that the trace prints) without its waits; what the trace prints is
    # checked in test_lesson_mechanisms.py
    ("06_overlap", "reducer_records_no_waits",
     "does not show the reducer's work: buckets waited for []"),
    ("06_overlap_timeline", "write_back_before_wait", "the overlapped gradients differ"),
    # the averages written into .grad before the wait: said as seen, no cause guessed
    ("07_no_sync_accumulation", "write_back_before_wait",
     "The all_reduces were launched as expected, yet the ranks' .grad do not hold their common "
     "average"),
    ("04_the_sampler", "reshard_skips_by_the_new_world_size",
     "must skip the 12 samples already read"),
    ("07_no_sync_accumulation_traps", "no_sync_exits_to_true",
     "must restore the flag it found (False here), not set it to True"),
    # at 2 ranks x / 2 == x * 0.5: the lesson's 3-rank part is where it shows
    ("08_miniddp_vs_torch_ddp_extras", "bucket_view_multiplied",
     "with gradient_as_bucket_view=True, at 3 ranks miniddp differs from torch's DDP"),
    ("08_miniddp_vs_torch_ddp_extras", "static_graph_ready_at_first_arrival",
     "with static_graph=True, at 2 ranks miniddp differs from torch's DDP"),
    ("05_buckets", "buckets_never_rebuilt",
     re.compile(r"miniddp's buckets \[.*\] differ from torch's \[")),
    ("05_buckets", "rebuilt_in_model_order",
     re.compile(r"miniddp's buckets \[.*\] differ from torch's \[")),
    ("15_sharded_optimizer", "zero_ties_reversed",
     "with equal sizes, miniddp's ZeroRedundancyOptimizer gives this rank the parameters"),
    ("15_sharded_optimizer", "zero_lr_never_forwarded",
     "with the learning rate changed every 3 steps, miniddp's ZeroRedundancyOptimizer differs"),
    # the root freed after forward: part 2 of lesson 17 sees it gathered as torch's is not
    # (the other breakages of miniddp/optim and miniddp/fsdp: test_zero_course.py and
    # test_fsdp_course.py, on the lesson's part that teaches each, in a pool of ranks)
    ("17_fsdp_options", "fsdp_root_resharded",
     "ZeRO-3: miniddp.fully_shard differs from torch's in what it gathers and reduces"),
    # shards saved as plain tensors: one copy written, and at 3 ranks the shapes no longer fit
    ("17_fsdp_checkpoints", "fsdp_checkpoint_rows_as_plain_tensors", "Size mismatch"),
    ("17_fsdp_checkpoints", "fsdp_full_state_dict_keeps_padding", "padding rows kept?"),
    ("16_compile", "buckets_launched_after_backward",
     "compiled in pieces, no all_reduce was launched before the last piece returned"),
]
# Words a failure message must not hold: a cause the lesson did not observe
NOT_SAID = {"write_back_before_wait": ["no_sync", "flag"]}




def broken_env(breakage: str, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), str(BREAKAGE_DIR)]),
               MINIDDP_BREAK=breakage, MINIDDP_RUNS=str(tmp_path / "runs"))
    return env


def run_broken(lesson: str, breakage: str, tmp_path: Path, env: dict[str, str] | None = None,
               slot: int = 0) -> subprocess.CompletedProcess:
    [path] = (REPO / "lessons").glob(f"{lesson}.py")
    command = [sys.executable, str(path), *ARGUMENTS.get(lesson, [])]
    return warm_python(LESSON_PRELOAD, slot=slot).run(
        command, env=env or broken_env(breakage, tmp_path), cwd=REPO, timeout=TIMEOUT)


def no_scaler_to_break(breakage: str) -> bool:
    return breakage == "no_grad_scaler" and not (hasattr(torch.amp, "GradScaler")
                                                 or torch.cuda.is_available())


@pytest.fixture(scope="module")
def runs_ahead(request, tmp_path_factory):
    """The selected cases' broken runs, one test ahead, two at a time
    (``tests/support/runs_ahead.py``),
    each in one of two warm interpreters."""
    for slot in (0, 1):
        warm_python(LESSON_PRELOAD, slot=slot)  # created here: it reads os.environ

    def prepared(item):
        lesson, breakage = item.callspec.params["lesson"], item.callspec.params["breakage"]
        runs = tmp_path_factory.mktemp(f"{lesson}-{breakage}")
        env = broken_env(breakage, runs)
        return lambda slot: ((lesson, breakage), run_broken(lesson, breakage, runs, env, slot))

    items = [item for item in selected(request, "test_lesson_fails_when_its_mechanism_is_broken")
             if not no_scaler_to_break(item.callspec.params["breakage"])
             and item.callspec.params["lesson"] not in CANNOT_RUN_HERE]
    ahead = RunsAhead({item.nodeid: functools.partial(prepared, item) for item in items})
    yield ahead
    ahead.close()


@pytest.mark.lesson
@pytest.mark.parametrize("lesson, breakage, message", [
    pytest.param(*case, id=f"{case[0]}-{case[1]}", marks=runnable_here(case[0])) for case in CASES])
def test_lesson_fails_when_its_mechanism_is_broken(lesson, breakage, message, runs_ahead,
                                                   request):
    if no_scaler_to_break(breakage):
        pytest.skip(f"torch {torch.__version__} has no GradScaler for the CPU: lesson 10 "
                    "skips its fp16 part, so there is no scaler to break")
    ran, done = runs_ahead.result(request.node.nodeid)
    assert ran == (lesson, breakage)
    output = done.stdout + done.stderr
    assert done.returncode != 0, f"{lesson} passed with {breakage}:\n{output[-3000:]}"
    said_it = message.search(output) if isinstance(message, re.Pattern) else message in output
    assert said_it, f"{lesson} with {breakage} failed, but not with '{message}':\n" \
                    f"{output[-3000:]}"
    assert "OK:" not in done.stdout
    said = [line for line in output.splitlines() if "CheckFailed:" in line]
    for words in NOT_SAID.get(breakage, []):
        assert not any(words in line for line in said), f"{lesson} guessed a cause: {said}"


# ----- a part of a lesson, run in a pool of ranks with the library broken -----

def broken_part(breakage: str, function, *args):
    """In a rank: ``function(*args)`` (a part of a lesson) with ``breakage`` applied, then
    mended (the pool's processes serve the next case)."""
    if str(BREAKAGE_DIR) not in sys.path:
        sys.path.insert(0, str(BREAKAGE_DIR))
    import breakages

    importlib.import_module(breakages.BREAKAGES[breakage][0])  # so it is patched now
    breakages.apply(breakage)
    try:
        return function(*args)
    finally:
        breakages.undo()


def failure_with_the_library_broken(ranks, world: int, breakage: str, function, *args) -> str:
    """What ``function(*args)``, a part of a lesson that must fail with ``breakage``, raised
    on the first rank that raised; the test fails if none did. Cheaper than the whole lesson
    (``run_broken``): no process starts, and only the part that proves the mechanism runs."""
    try:
        ranks(world).run(broken_part, breakage, function, *args)
    except RankError as error:
        return error.details
    pytest.fail(f"{function.__module__}.{function.__name__} passed with {breakage}")


student = load_lesson("08")
checkpoints = load_lesson("09")
many_machines = load_lesson("12")
stage_2 = load_lesson("15_sharded_optimizer_stage_2")
compiled = load_lesson("16")


def writers_killed_halfway(workdir: Path) -> None:
    """Lesson 09's part 1, on rank 0 only, as the lesson runs it."""
    if dist.get_rank() == 0:
        checkpoints.writers_killed_halfway(workdir)


def reduce_scatter_against_all_reduce() -> None:
    stage_2.reduce_scatter_against_all_reduce(dist.get_rank(), dist.get_world_size(),
                                              rank_device())


# lesson, what is broken, ranks, the part of the lesson that must fail, its arguments (a
# callable: made in the test), the message of its check
PARTS = [
    ("08_miniddp_vs_torch_ddp", "divide_instead_of_multiply", 3, student.at_three_ranks,
     lambda tmp_path: (), "at 3 ranks miniddp differs from torch's DDP"),
    ("08_miniddp_vs_torch_ddp", "buckets_never_rebuilt", 2, student.on_every_rank,
     lambda tmp_path: (), "the buckets changed at step None, torch rebuilds at step 1"),
    ("09_checkpoints_and_restarts", "write_not_atomic", 2, writers_killed_halfway,
     lambda tmp_path: (tmp_path,), "should still hold the previous snapshot"),
    ("12_many_machines", "averages_not_written_back", 2, many_machines.train_and_check,
     lambda tmp_path: (torch.device("cpu"),), "the workers ended with different parameters"),
    # the reference broken, not the ring by hand: the comparison with all_reduce is a live one
    ("15_sharded_optimizer_stage_2", "all_reduce_does_nothing", 2,
     reduce_scatter_against_all_reduce, lambda tmp_path: (),
     "the reduce-scatter differs from all_reduce then slicing"),
    ("16_compile", "compiled_ddp_unrecognised", 2, compiled.like_torch,
     lambda tmp_path: ("aot_eager",), "differ from torch's compiled DDP's"),
]


@pytest.mark.lesson
@pytest.mark.parametrize("lesson, breakage, world, part, arguments, message", [
    pytest.param(*case, id=f"{case[0]}-{case[1]}", marks=runnable_here(case[0]))
    for case in PARTS])
def test_lessons_part_fails_when_its_mechanism_is_broken(lesson, breakage, world, part,
                                                         arguments, message, ranks, tmp_path):
    said = failure_with_the_library_broken(ranks, world, breakage, part, *arguments(tmp_path))
    assert message in said, f"{lesson} with {breakage} failed, but not with '{message}':\n" \
                            f"{said[-3000:]}"


def test_a_breakage_whose_target_is_gone_fails_loudly(tmp_path):
    sys.path.insert(0, str(BREAKAGE_DIR))
    try:
        import breakages
    finally:
        sys.path.remove(str(BREAKAGE_DIR))
    with pytest.raises(AttributeError, match="no longer exists"):
        breakages.divide_instead_of_multiply(type("module", (), {"Reducer": object})())
    with pytest.raises(KeyError, match="no breakage named"):
        breakages.apply("nothing_broken")


# What miniddp's launcher prints when ranks fail differently: the first failure in full, the
# others' first lines after it; rank 0's check blames the data, rank 1's the real cause.
FORKED_FAILURE = """step 0/40 | loss 0.52211
Traceback (most recent call last):
miniddp.launch.rank_group.RankError: rank 0 of 3 raised:
Traceback (most recent call last):
  File "lesson.py", line 3, in on_every_rank
course.report.CheckFailed: the epoch read 64 samples, 60 distinct
(then rank 1 raised: course.report.CheckFailed: the buckets differ; a; b; rank 2 died \
without reporting: exit code -9 (SIGKILL))"""


def test_course_summary_shows_the_first_line_of_every_ranks_failure():
    why = runner.why_it_failed(FORKED_FAILURE.splitlines()).splitlines()
    assert why == ["rank 0 of 3: CheckFailed: the epoch read 64 samples, 60 distinct",
                   "rank 1 of 3: CheckFailed: the buckets differ; a; b",
                   "rank 2 of 3: died without reporting: exit code -9 (SIGKILL)"]


def test_course_summary_shows_every_torchrun_workers_failure():
    lines = ["[agent 1] rank 1 of 2 raised:", "[agent 1] Traceback (most recent call last):",
             "[agent 1] course.report.CheckFailed: the workers differ",
             "[agent 0] rank 0 of 2 raised:", "[agent 0] RuntimeError: Connection closed by peer",
             "[agent 1] torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "]
    assert runner.why_it_failed(lines).splitlines() == [
        "rank 1 of 2: CheckFailed: the workers differ",
        "rank 0 of 2: RuntimeError: Connection closed by peer"]
