"""Lesson 17 (FSDP by hand) and exercise 17 (its reduce-scatter): what they prove holds, and
fails when it should not.

The lesson's pieces against torch's ``fully_shard``: its hand-written FSDP bit for bit at 2 and
3 ranks, freeing the gathered weights after forward and gathering them again for backward; each
broken detail (1/W before the sum, the flat layout, no padding) different at 3 ranks and equal
at 2, where the lesson says every variant agrees. Then the exercise graded both ways: as shipped
it fails saying what to write, the solution passes, and each plausible wrong solution fails the
check that names its mistake. Last, the lesson run with miniddp's averaging or layout broken
from outside (``tests/breakage``): it must fail on miniddp's shards. (The lesson's plain run at
3 ranks is ``tests/test_lessons.py``'s, found by its name.)
"""

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lesson_modules import load_lesson
from test_grade import (
    first_failure,
    grade,
    grades_ahead,
    sections,
    solution_lines,
    solution_with_mistake,
)
from test_lesson_breakage import run_broken
from test_lessons import last_line, run

fsdp = load_lesson("17")
needs_fsdp2 = pytest.mark.skipif(fsdp.torch_fully_shard is None,
                                 reason=f"torch {torch.__version__} has no FSDP2 (fully_shard)")
pytestmark = needs_fsdp2


# ----- the lesson's FSDP by hand -----

def by_hand_against_torch(steps: int = 3) -> tuple[int, bool, list[int]]:
    """Elements of gradient and parameter shards that differ from torch's over ``steps`` Adam
    steps; whether every unit had freed its gathered weights after each forward; the gathers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, units = fsdp.by_hand(fsdp.make_model())
    ours = [s for u in units for s in u.shards]
    theirs_model = fsdp.shard_with(fsdp.torch_fully_shard, fsdp.make_model())
    theirs = list(theirs_model.parameters())
    optimizers = [torch.optim.Adam(p, **fsdp.ADAM) for p in (ours, theirs)]
    differ, freed = 0, True
    for x, y in fsdp.batches(rank, world, steps):
        for m, optimizer in zip((model, theirs_model), optimizers):
            optimizer.zero_grad()
            loss = F.mse_loss(m(x), y)
            freed &= all(u.full is None for u in units)
            loss.backward()
        differ += fsdp.differing([p.grad for p in ours], [p.grad for p in theirs])
        for optimizer in optimizers:
            optimizer.step()
        differ += fsdp.differing(ours, theirs)
    return differ, freed, [u.gathers for u in units]


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_by_hand_equals_torchs_fully_shard_bit_for_bit(ranks, world):
    for differ, freed, gathers in ranks(world).run(by_hand_against_torch):
        assert differ == 0
        assert freed, "a unit still held its gathered weights after forward"
        assert gathers == [3, 6, 6], gathers  # forward, and backward where it needs the weights


def broken_counts():
    return fsdp.broken_details(dist.get_rank(), dist.get_world_size())


def test_each_broken_detail_differs_from_torch_at_3_ranks(ranks):
    counts = ranks(3).run(broken_counts)[0]
    assert sorted(counts) == sorted(fsdp.Broken.MISTAKES)
    assert all(count > 0 for count in counts.values()), counts


def test_every_broken_detail_still_agrees_at_2_ranks(ranks):
    counts = ranks(2).run(broken_counts)[0]
    assert all(count == 0 for count in counts.values()), counts


# ----- the lesson, whole -----

@pytest.mark.lesson
@pytest.mark.slow
def test_lesson_runs_at_2_ranks_where_every_mistake_agrees(tmp_path):
    done = run([sys.executable, fsdp.__file__, "--nproc", "2"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    counts = {line.split()[-1] for line in done.stdout.splitlines()
              for mistake in fsdp.Broken.MISTAKES if mistake in line}
    assert counts == {"0"}, done.stdout
    assert last_line(done).startswith("OK: on 2 ranks"), done.stdout[-3000:]


# ----- exercise 17, graded -----

@pytest.mark.slow
def test_exercise_as_shipped_fails_saying_what_to_write():
    done = grade("17")
    assert done.returncode == 1, done.stdout + done.stderr
    text = sections(done.stdout)["17"]
    assert "TODO  not written yet: exercise 17" in text and "--hint 17" in text, text
    assert "PASS" not in text
    for line in solution_lines("17"):
        assert line not in text, f"the instruction dictates {line!r}"


@pytest.mark.slow
def test_exercise_solution_passes_every_check():
    done = grade("17", "--solutions")
    assert done.returncode == 0, done.stdout + done.stderr
    text = sections(done.stdout)["17"]
    assert text.count("PASS") == 4 and "FAIL" not in text, text


# Each: (text in the solution, the mistake put in its place, the first check that must fail,
# words its message must hold)
MISTAKES = {
    "1/W before the sum": (
        "    buffer.div_(before)\n", "    buffer.mul_(1 / world_size)\n",
        "torch's averaging", "multiplied by 1/W before the sum"),
    "divided by W after the sum only, in fp16 too": (
        "    if reduce_dtype != torch.float16:\n        return 1, world_size\n",
        "    return 1, world_size\n",
        "divide_factors: torch's (before, after)", "that is AVG's arithmetic"),
    "AVG in fp16": (
        "    reduce_scatter(out, buffer)\n    out.div_(after)\n",
        "    reduce_scatter(out, buffer, op=dist.ReduceOp.AVG)\n",
        "torch's averaging", "ReduceOp.AVG in fp16"),
    "the flat layout": (
        "    buffer = torch.cat([p.reshape(-1) for p in pieces]).to(reduce_dtype)\n",
        "    buffer = torch.cat([g.reshape(-1) for g in grads]).to(reduce_dtype)\n"
        "    buffer = torch.cat([buffer, buffer.new_zeros(-len(buffer) % world_size)])\n",
        "of torch's layout", "the gradients whole, one after another"),
    "no padding": (
        "            pieces.append(torch.cat([piece, piece.new_zeros(n - len(piece), "
        "*g.shape[1:])]))\n",
        "            pieces.append(piece)\n"
        "        pieces.append(g.new_zeros(sum(n * g[0].numel() for g, n in zip(grads, rows))\n"
        "                                  - sum(chunk(g, world_size, r).numel() for g in grads)))"
        "\n",
        "of torch's layout", "each rank's chunks unpadded"),
    "reduced in the gradients' dtype": (
        ".to(reduce_dtype)\n", "\n", "of torch's layout", "torch reduces in reduce_dtype"),
    "the padded shard kept": (
        "    return [part[:s.numel()].view_as(s).to(g.dtype)\n",
        "    return [part.view(-1, *s.shape[1:]).to(g.dtype)\n",
        "equal torch's fully_shard bit for bit", "unpadded"),
}


def with_mistake(case: str, directory) -> list:
    right, wrong, _, _ = MISTAKES[case]
    return solution_with_mistake("17", right, wrong, directory)


@pytest.fixture(scope="module")
def graded_ahead(request, tmp_path_factory):
    ahead = grades_ahead(request, tmp_path_factory, {
        "test_exercise_wrong_solution_fails_naming_its_mistake":
            lambda params, directory: with_mistake(params["case"], directory)})
    yield ahead
    ahead.close()


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_exercise_wrong_solution_fails_naming_its_mistake(graded_ahead, request, case):
    _, _, check, words = MISTAKES[case]
    done = graded_ahead.result(request.node.nodeid)
    assert done.returncode == 1, done.stdout + done.stderr
    first_failure(sections(done.stdout)["17"], case, check, [words])


# ----- the library broken from outside: the lesson must fail -----

@pytest.mark.lesson
@pytest.mark.slow
@pytest.mark.parametrize("breakage", ["fsdp_scales_before_the_sum", "fsdp_flat_layout"])
def test_lesson_fails_when_the_librarys_averaging_or_layout_is_broken(breakage, tmp_path):
    done = run_broken("17_fsdp", breakage, tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "miniddp.fully_shard differs from torch's fully_shard in" in output, output[-3000:]
    assert "by hand               differs from torch's fully_shard in 0 elements" in done.stdout
    assert "OK:" not in done.stdout
