"""Lesson 18 (HSDP by hand; the library beside torch's on a 2-D mesh): what it proves holds,
and fails when it should not.

The lesson's hand-written mistakes at 2 x 3, where one division by W differs too (the lesson's
own run checks 2 x 2). Then miniddp's HSDP broken from outside (``tests/breakage/sharding.py``,
the same breakages ``tests/test_hsdp.py`` takes as negative controls), one at a time: the part
of the lesson that proves the mechanism must fail with its check's message. (The lesson's plain
run is ``tests/test_lessons.py``'s.)
"""

import pytest
import torch
import torch.distributed as dist
from lesson_modules import load_lesson
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
FP16, MICRO, CLIP = list(hsdp.PATHS)
#: breakage -> (ranks, the part of lesson 18 that must fail, its argument, the message)
LIBRARY = {
    "hsdp_replicas_first": (4, part_1, 2, BITS),
    "hsdp_no_all_reduce": (4, part_1, 2, BITS),
    "hsdp_one_division": (6, part_1, 3, BITS),  # / 2 / 2 is / 4 exactly: 3 ranks per node
    "hsdp_fp16_post_before_all_reduce": (4, a_path, FP16, f"{FP16}: {BITS}"),
    "hsdp_all_reduce_each_micro_batch": (4, a_path, MICRO, f"{MICRO}: {BITS}"),
    "hsdp_norms_over_every_rank": (4, a_path, CLIP, f"{CLIP}: {BITS}"),
}


@pytest.mark.slow
@pytest.mark.parametrize("breakage", sorted(LIBRARY))
def test_lesson_18_fails_where_it_teaches_what_the_library_broke(ranks, breakage):
    world, part, argument, message = LIBRARY[breakage]
    said = failure_with_the_library_broken(ranks, world, breakage, part, argument)
    assert message in said, said[-3000:]
