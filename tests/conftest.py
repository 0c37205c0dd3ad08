"""Shared fixtures: long-lived groups of forked ranks, one per world size; and the test tiers.

Importing ``torch._dynamo`` here, before any fork, matters: torch's DDP imports it lazily on
first construction (seconds of CPU in every rank otherwise).

Two tiers. ``python -m pytest -q`` runs everything (what CI runs); ``python -m pytest -q -m "not
slow"`` is the fast tier, for an answer within minutes while working: the engine against
torch's DDP at 2 and 3 ranks, the sampler, the grader, the course's runner and one lesson end to
end, and every other test that costs little. A test is slow when it says so
(``@pytest.mark.slow``) or when its node id matches a pattern of :data:`SLOW` below, which keeps
the tiers in one place instead of in every file.
"""

import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (see the module docstring)

from miniddp.launch import RankGroup, start_methods

#: ``tests/`` holds a folder per room of the library (``engine``, ``options``, ``compat``,
#: ``fsdp``, ``optim``, ``operations``, ``course``, ``torch_suites``) and ``support``, the helpers
#: they share. Every folder is importable by its modules' names (``from ddp_cases import MLP``,
#: ``from test_fsdp import Net``), whichever folder a test sits in: test module names are unique.
HERE = Path(__file__).resolve().parent
for folder in sorted(p for p in HERE.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

torch.set_num_threads(1)


class Ranks:
    """A :class:`RankGroup` that restarts itself after a failure, so one bad case costs one case."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._group = None

    def run(self, fn, *args, timeout: float = 60.0, **kwargs):
        if self._group is None or not self._group.alive:
            self._group = RankGroup(self.world_size, pg_timeout=20.0)
        return self._group.run(fn, *args, timeout=timeout, **kwargs)

    def close(self):
        if self._group is not None:
            self._group.close()


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world_size)`` returns a long-lived group of that many gloo ranks."""
    pools: dict[int, Ranks] = {}

    def get(world_size: int) -> Ranks:
        if world_size not in pools:
            pools[world_size] = Ranks(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture
def ranks_see_monkeypatches():
    """For a test that patches this process and counts on forked ranks inheriting the patch.

    Where ranks start from a forkserver instead (this process already ran a backward on a
    machine with a GPU: ``miniddp.launch.start_methods``) they would not see it: skipped there.
    """
    if not start_methods.fork_is_safe():
        pytest.skip("the ranks start from a forkserver here (a backward already ran in this "
                    "process on a machine with a GPU), so they do not inherit this test's patch")


#: The one lesson the fast tier runs end to end: the whole DDP against torch's, bit for bit.
FAST_TIER_LESSON = ("tests/course/test_lessons.py::test_lesson_runs_and_ends_with_ok"
                    "[08_miniddp_vs_torch_ddp]")

#: Node id patterns (``*`` matches anything, nothing else is special) of the tests the fast tier
#: leaves out, each group with why. They stay in the whole suite.
SLOW = {
    "a lesson or a grader run: a process of its own, seconds each (``-m lesson`` selects them)": [
        "tests/course/test_lessons.py::test_lesson_runs_and_ends_with_ok[*]",
        "tests/course/test_lessons.py::test_run_course_names_the_failed_check_and_rank_of_a_broken_*",
        "tests/course/test_lesson_breakage.py::*",
        "tests/course/test_lesson_mechanisms.py::test_lesson_0*_fails_when_*",
        "tests/course/test_lesson_mechanisms.py::test_lesson_16_fails_when_*",
        "tests/operations/test_trace.py::test_lesson_06_prints_the_trace_with_trace",
        "tests/course/test_zero_course.py::test_lesson_runs_at_3_ranks",
    ],
    "waits out a timeout on purpose, to show what a hang turns into": [
        "tests/operations/test_consistency.py::test_without_debug_*",
        "tests/operations/test_consistency.py::test_the_checks_without_detail_name_a_skipped_backward_*",
        "tests/operations/test_consistency.py::test_debug_mode_names_a_rank_that_ran_one_step_fewer",
        "tests/operations/test_launch.py::test_timeout_reports_where_each_rank_was",
        "tests/operations/test_launch.py::test_a_rank_that_stops_taking_part_is_blamed_*",
        "tests/options/test_join.py::test_without_join_the_ranks_still_training_time_out_*",
        "tests/torch_suites/test_torch_ddp_suite.py::test_torch_ddp_suite[test_ddp_model_diff_shape_across_*",
    ],
    "starts fresh interpreters, torchrun agents or a forkserver": [
        "tests/operations/test_launch.py::test_*forkserver*",
        "tests/operations/test_launch.py::test_*under_torchrun*",
        "tests/operations/test_launch.py::test_*a_device_beside_the_cpu*",
        "tests/operations/test_install.py::test_torchs_compiler_first_imported_while_installed_*",
        "tests/operations/test_install.py::test_run_*",
        "tests/operations/test_install.py::test_torchrun_*",
        "tests/operations/test_install.py::test_lightnings_*",
        "tests/operations/test_report.py::test_a_failed_check_exits_non_zero_*",
        "tests/operations/test_faults.py::*",
        "tests/operations/test_torchrun_agents.py::*",
    ],
    "the reference job, the benchmarks and torch.compile: whole runs, each seconds": [
        "tests/operations/test_train.py::*",
        "tests/operations/test_train_zero.py::*",
        "tests/operations/test_benchmarks.py::*",
        "tests/compat/test_compile.py::*",
    ],
    "beyond the fast tier's 2 and 3 ranks, or torch's own class checked against its own tests": [
        "tests/engine/test_ddp_equivalence.py::test_bit_identical_to_torch_ddp[*-4]",
        "tests/engine/test_ddp_equivalence.py::test_bit_identical_on_a_subgroup",
        "tests/torch_suites/test_torch_ddp_suite.py::test_torch_ddp_suite[*-torch]",
        "tests/torch_suites/test_torch_ddp_suite.py::test_torch_ddp_suite[test_ddp_apply_optim_in_backward*",
        "tests/engine/test_reducer_arithmetic.py::test_copying_a_bucket_then_scaling_it_gives_the_*",
        "tests/fsdp/test_fsdp_checkpoints.py::test_dcp_round_trip_at_the_same_world_size[3-*",
        "tests/fsdp/test_fsdp_checkpoints.py::test_a_sharded_parameter_its_*_dtensors[4]",
        "tests/fsdp/test_fsdp_checkpoints.py::test_meta_device_init_then_*[4-*",
        "tests/fsdp/test_fsdp_checkpoints.py::test_dcp_saved_on_a_2x2_hsdp_mesh_*",
    ],
}


#: The files that take longest, started first: pytest-xdist hands each worker a whole file at a
#: time in the collection's order (``--no-loadscope-reorder``), and one of these started last
#: would leave the other worker idle for a minute at the end of the run.
LONGEST_FIRST = [
    "tests/course/test_lessons.py",
    "tests/operations/test_frameworks.py",
    "tests/course/test_grade.py",
    "tests/operations/test_install.py",
    "tests/operations/test_benchmarks.py",
    "tests/course/test_lesson_breakage.py",
    "tests/operations/test_faults.py",
    "tests/operations/test_launch.py",
    "tests/course/test_hsdp_course.py",
]


def _pattern(glob: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in glob.split("*")))


_SLOW_PATTERNS = [_pattern(glob) for globs in SLOW.values() for glob in globs]


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark the tests :data:`SLOW` names; say which patterns matched nothing of a whole file."""
    matched = set()
    for item in items:
        hits = [p for p in _SLOW_PATTERNS if p.fullmatch(item.nodeid)]
        matched.update(p.pattern for p in hits)
        if hits and item.nodeid != FAST_TIER_LESSON:
            item.add_marker(pytest.mark.slow)
    first = {path: k for k, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))
    whole_files = {item.nodeid.split("::")[0] for item in items}
    if not any("::" in arg for arg in config.args):
        if (FAST_TIER_LESSON.split("::")[0] in whole_files
                and FAST_TIER_LESSON not in {item.nodeid for item in items}):
            warnings.warn(pytest.PytestWarning(
                f"tests/conftest.py: FAST_TIER_LESSON {FAST_TIER_LESSON!r} is no test; the "
                "fast tier runs no lesson end to end. Name another."), stacklevel=2)
        for globs in SLOW.values():
            for glob in globs:
                if glob.split("::")[0] in whole_files and _pattern(glob).pattern not in matched:
                    warnings.warn(pytest.PytestWarning(
                        f"tests/conftest.py: the slow-test pattern {glob!r} matches no test; "
                        "a test was renamed? Update SLOW, or the fast tier grows."), stacklevel=2)
