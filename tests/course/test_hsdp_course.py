"""Lesson 18 (HSDP by hand; the library beside torch's on a 2-D mesh): what it proves holds,
and fails when it should not.

The lesson's hand-written mistakes at 2 x 3, where one division by W differs too (the lesson's
own run checks 2 x 2). Then miniddp's HSDP broken from outside
(``tests/support/breakage/sharding.py``,
the same breakages ``tests/fsdp/test_hsdp.py`` takes as negative controls), one at a time: the part
of the lesson that proves the mechanism must fail with its check's message. (The lesson's plain
run is ``tests/course/test_lessons.py``'s.)
"""

import pytest
import torch
import torch.distributed as dist
from lesson_modules import load_lesson
from test_grade import problems_in_one_run
from test_lesson_breakage import failure_with_the_library_broken

hsdp = load_lesson("18")
pytestmark = pytest.mark.skipif(hsdp.TorchPolicy is None,
                                reason=f"torch {torch.__version__} has no FSDP2 (fully_shard)")


def broken_counts(per_node: int) -> dict:
    ours, theirs = hsdp.meshes(dist.get_world_size() // per_node, per_node)
    return hsdp.broken_details(ours, theirs)


@pytest.mark.slow
def test_every_hand_written_mistake_differs_at_3_ranks_per_node(ranks):
    counts = ranks(6).run(broken_counts, 3)[0]
    assert sorted(counts) == sorted(hsdp.Broken.MISTAKES)
    assert all(count > 0 for count in counts.values()), counts


# ----- the library broken: the part of lesson 18 that teaches the mechanism fails -----

def part_1(per_node: int) -> None:
    hsdp.side_by_side(*hsdp.meshes(dist.get_world_size() // per_node, per_node))


def a_path(path: str) -> None:
    hsdp.prove_path(path, *hsdp.meshes(2, dist.get_world_size() // 2))


BITS = "miniddp.fully_shard differs from torch's fully_shard in"
FP16, MICRO, CLIP, DEVICE_MESH = list(hsdp.PATHS)
#: breakage -> (ranks, the part of lesson 18 that must fail, its argument, the message)
LIBRARY = {
    "hsdp_replicas_first": (4, part_1, 2, BITS),
    "hsdp_no_all_reduce": (4, part_1, 2, BITS),
    "hsdp_one_division": (6, part_1, 3, BITS),  # / 2 / 2 is / 4 exactly: 3 ranks per node
    "hsdp_fp16_post_before_all_reduce": (4, a_path, FP16, f"{FP16}: {BITS}"),
    "hsdp_all_reduce_each_micro_batch": (4, a_path, MICRO, f"{MICRO}: {BITS}"),
    "hsdp_partial_replaced": (4, a_path, MICRO, f"{MICRO}: {BITS}"),
    "hsdp_mesh_dims_swapped": (4, a_path, DEVICE_MESH, f"{DEVICE_MESH}: {BITS}"),
}


@pytest.mark.slow
@pytest.mark.parametrize("breakage", sorted(LIBRARY))
def test_lesson_18_fails_where_it_teaches_what_the_library_broke(ranks, breakage):
    world, part, argument, message = LIBRARY[breakage]
    said = failure_with_the_library_broken(ranks, world, breakage, part, argument)
    assert message in said, said[-3000:]


# ----- exercise 18: the gradient path across the two groups -----

DIVISIONS = "divisions: torch's places for the averaging"
SHARDS = "every rank's gradient shards equal torch's fully_shard on the 2-D mesh bit for bit"
AVERAGED = "        return 1, shard_size, replicate_size\n"
SCATTER = "    reduce_scatter(out, buffer, shard_group)\n    out.div_(after_scatter)\n"
ACROSS = "    all_reduce(out, replicate_group)\n    out.div_(after_all_reduce)\n"
CAST = "    buffer = layout(grads, world).to(reduce_dtype)\n    buffer.div_(before)\n"
WRONG_18 = {
    "one division by W": ("18", [(AVERAGED, "        return 1, 1, shard_size * replicate_size\n")],
                          DIVISIONS, ["one division by every rank's count"], []),
    "the shard group's size only": ("18", [(AVERAGED, "        return 1, shard_size, 1\n")],
                                    DIVISIONS, ["the shard group's size only"], []),
    "the sizes swapped": ("18", [(AVERAGED, "        return 1, replicate_size, shard_size\n")],
                          DIVISIONS, ["the two sizes swapped"], []),
    "fp16 split of S": (
        "18", [("    world = shard_size * replicate_size\n", "    world = shard_size\n"),
               ("    return before, 1, world / before\n",
                "    return before, 1, world / before * replicate_size\n")],
        DIVISIONS, ["fp16 split from the shard group's size only"], []),
    "both divisions after the all-reduce": (
        "18", [(SCATTER, "    reduce_scatter(out, buffer, shard_group)\n"),
               (ACROSS, "    all_reduce(out, replicate_group)\n"
                        "    out.div_(after_scatter * after_all_reduce)\n")],
        SHARDS, ["2 nodes of 3", "nothing was divided between the two sums",
                 "by 3 there"], []),
    "W after the reduce-scatter": (
        "18", [(SCATTER, "    reduce_scatter(out, buffer, shard_group)\n"
                         "    out.div_(world * dist.get_world_size(replicate_group))\n")],
        SHARDS, ["you divided by every rank's count W after the reduce-scatter"], []),
    "across nodes first": (
        "18", [(CAST, CAST + "    all_reduce(buffer, replicate_group)\n"
                             "    buffer.div_(after_all_reduce)\n"), (ACROSS, "")],
        SHARDS, ["the groups in the other order", "S times the bytes"], []),
    "the groups swapped": (
        "18", [(SCATTER + ACROSS, "    reduce_scatter(out, buffer, replicate_group)\n"
                                  "    out.div_(after_scatter)\n"
                                  "    all_reduce(out, shard_group)\n"
                                  "    out.div_(after_all_reduce)\n")],
        SHARDS, ["the groups swapped"], []),
    "no all-reduce across the replicas": (
        "18", [(ACROSS, "    out.div_(after_all_reduce)\n")],
        SHARDS, ["no all-reduce across the replicate group", "drift apart"], []),
    "an all-reduce over every rank": (
        "18", [(ACROSS, "    all_reduce(out, None)\n    out.div_(after_all_reduce)\n")],
        SHARDS, ["a collective over every rank"], []),
    "nothing divided after the all-reduce": (
        "18", [(ACROSS, "    all_reduce(out, replicate_group)\n")],
        SHARDS, ["nothing was divided after the all-reduce"], []),
    # right in fp32, where the cast does nothing: the grader must go on to bf16 to see it
    "never cast to reduce_dtype": (
        "18", [("    buffer = layout(grads, world).to(reduce_dtype)\n",
                "    buffer = layout(grads, world)\n")],
        SHARDS, ["2 nodes of 3 ranks, bf16 reduction", "not the layout cast to reduce_dtype"], []),
}
RIGHT_18 = {
    "AVG in both groups for fp32 and bf16": ("18", [(SCATTER + ACROSS, (
        "    if reduce_dtype == torch.float16:\n"
        "        reduce_scatter(out, buffer, shard_group)\n"
        "        all_reduce(out, replicate_group)\n"
        "        out.div_(after_all_reduce)\n    else:\n"
        "        dist.reduce_scatter_single(out, buffer, op=dist.ReduceOp.AVG, group=shard_group)\n"
        "        dist.all_reduce(out, op=dist.ReduceOp.AVG, group=replicate_group)\n"))]),
    "divided out of place": ("18", [("    out.div_(after_all_reduce)\n",
                                     "    out = out / after_all_reduce\n")]),
}

#: Mistakes no diagnosis was written for: the first line alone, the first place where the
#: learner's collectives and shards leave torch's, must locate each, and name no wrong cause
UNLISTED_18 = {
    "the global rank for shards_of": (
        "18", [("    return shards_of(out, grads, world, rank)\n",
                "    return shards_of(out, grads, world, dist.get_rank())\n")],
        SHARDS, ["your shard of parameter 0"], ["use shards_of", "all-reduce"]),
    "the replicate group's rank": (
        "18", [("dist.get_rank(shard_group)", "dist.get_rank(replicate_group)")],
        SHARDS, ["your shard of parameter 0"], ["use shards_of", "all-reduce"]),
    "a reduce-scatter over every rank": (
        "18", [(CAST + "    out = buffer.new_empty(buffer.numel() // world)\n"
                "    reduce_scatter(out, buffer, shard_group)\n",
                "    buffer = layout(grads, dist.get_world_size()).to(reduce_dtype)\n"
                "    buffer.div_(before)\n"
                "    out = buffer.new_empty(buffer.numel() // dist.get_world_size())\n"
                "    reduce_scatter(out, buffer, None)\n")],
        SHARDS, ["your collective 1 was reduce_scatter_single over every rank",
                 "torch's reduce_scatter_single over the shard group"],
        ["no all-reduce"]),
    "the list form of reduce_scatter": (
        "18", [("    reduce_scatter(out, buffer, shard_group)\n",
                "    dist.reduce_scatter(out, list(buffer.chunk(world)), group=shard_group)\n")],
        SHARDS, ["your collective 1 was dist.reduce_scatter (the list form)",
                 "then your shard of parameter", "torch made reduce_scatter_single"],
        ["were torch's"]),
}


@pytest.mark.slow
def test_exercise_18_names_each_mistake_and_passes_other_right_solutions(tmp_path):
    problems = problems_in_one_run({**WRONG_18, **UNLISTED_18}, RIGHT_18, tmp_path)
    assert not problems, "\n\n".join(problems)
