"""Lesson 17 (FSDP by hand; part 2, the library on every path) and exercises 17 (a unit's
reduce-scatter) and 17b (a unit's life): what they prove holds, and fails when it should not.

The lesson's pieces against torch's ``fully_shard``: its hand-written FSDP bit for bit at 2 and
3 ranks, freeing the gathered weights after forward and gathering them again for backward; each
broken detail (1/W before the sum, the flat layout, no padding) different at 3 ranks and equal
at 2, where the lesson says every variant agrees. Then miniddp's FSDP broken from outside
(``tests/support/breakage/sharding.py``), one small breakage at a time: the part of the lesson that
teaches the mechanism must fail. Last, the exercises' wrong solutions, each failing first the
check that names its mistake, and other right solutions passing, each exercise in one grader
run. (The lessons' plain runs are ``tests/course/test_lessons.py``'s; the shipped exercises and the
reference solutions are graded in ``tests/course/test_grade.py``.)
"""


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lesson_modules import load_lesson
from test_grade import problems_in_one_run
from test_lesson_breakage import failure_with_the_library_broken

fsdp = load_lesson("17")
options = load_lesson("17_fsdp_options")
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


# ----- the library broken: the part of lesson 17 that teaches the mechanism fails -----

def part_1() -> None:
    fsdp.side_by_side(dist.get_rank(), dist.get_world_size())


GATHERS = "miniddp.fully_shard differs from torch's in what it gathers and reduces"
BITS = "miniddp.fully_shard differs from torch's fully_shard in"
#: breakage -> (the path of part 2 that must fail, the message)
LIBRARY = {
    "fsdp_scales_before_the_sum": ("ZeRO-3", BITS),
    "fsdp_flat_layout": ("ZeRO-3", BITS),
    "fsdp_fp16_like_fp32": ("fp16 compute and reduction", BITS),
    "fsdp_root_resharded": ("ZeRO-3", GATHERS),
    "fsdp_never_frees_after_forward": ("ZeRO-3", GATHERS),
    "fsdp_zero2_ignored": ("ZeRO-2 (reshard_after_forward=False)", GATHERS),
    "fsdp_no_gather_for_backward": ("ZeRO-3", "RuntimeError"),
    "fsdp_gradient_overwritten": ("two backwards per step, both with sync", BITS),
    "fsdp_sync_always": ("two backwards, the first without sync (bf16/fp32)", GATHERS),
    "fsdp_kept_in_compute_dtype": ("two backwards, the first without sync (bf16/fp32)", BITS),
    "fsdp_reduce_dtype_ignored": ("bf16 compute, fp32 reduction", BITS),
    "fsdp_frozen_after_sharding_ignored": ("a weight frozen after fully_shard", BITS),
}


@pytest.mark.slow
@pytest.mark.parametrize("breakage", sorted(LIBRARY))
def test_part_2_fails_on_the_path_that_teaches_what_the_library_broke(ranks, breakage):
    path, message = LIBRARY[breakage]
    said = failure_with_the_library_broken(ranks, 3, breakage, options.prove_path, path)
    assert f"{path}: {message}" in said or message == "RuntimeError" and message in said, \
        said[-3000:]


def test_part_2_fails_on_fp16s_factors_wrong_only_beyond_its_ranks(ranks):
    said = failure_with_the_library_broken(ranks, 2, "fsdp_fp16_factors_halved_once",
                                           options.prove_divide_factors)
    assert "fp16's divide factors (ranks, miniddp's, torch's) differ: [(6," in said, said[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("breakage", ["fsdp_scales_before_the_sum", "fsdp_flat_layout"])
def test_part_1_fails_on_miniddps_shards_when_its_averaging_or_layout_is_broken(ranks, breakage):
    said = failure_with_the_library_broken(ranks, 3, breakage, part_1)
    assert "miniddp.fully_shard differs from torch's fully_shard in" in said, said[-3000:]


# ----- exercise 17: a unit's reduce-scatter -----

FACTORS = "divide_factors: torch's (before, after)"
SHARDS = "every rank's gradient shards equal torch's fully_shard bit for bit"
ONE = "one reduce-scatter per unit"
LOOP = ("    before = 1\n    while world_size % before == 0 and world_size / before > before:\n"
        "        before *= 2\n    return before, world_size / before\n")
PIECE = ("            pieces.append(torch.cat([piece, piece.new_zeros(n - len(piece), "
         "*g.shape[1:])]))\n")
BUFFER = "    buffer = torch.cat([p.reshape(-1) for p in pieces]).to(reduce_dtype)\n"
DIVIDE = "    before, after = divide_factors(world_size, reduce_dtype)\n    buffer.div_(before)\n"
RS = "    reduce_scatter(out, buffer)\n"
FP16 = "    if reduce_dtype != torch.float16:\n        return 1, world_size\n"


def sqrt_rule(rounding: str) -> list[tuple[str, str]]:
    return [(LOOP, f"    before = {rounding}(world_size ** 0.5)\n"
                   "    return before, world_size / before\n")]


WRONG_17 = {
    "before as round(sqrt(W))": ("17", sqrt_rule("round"), FACTORS,
                                 ["before as round(sqrt(W))", "W = 6: 1, 2, 4"], []),
    "before as int(sqrt(W))": ("17", sqrt_rule("int"), FACTORS, ["before as int(sqrt(W))"], []),
    "the factors swapped": ("17", [("    return before, world_size / before\n",
                                    "    return world_size / before, before\n")],
                            FACTORS, ["the factors swapped"], []),
    "fp16 like fp32": ("17", [(FP16, "    return 1, world_size\n")], FACTORS,
                       ["ReduceOp.AVG's arithmetic"], []),
    "fp16's split for bf16 too": ("17", [(FP16, FP16.replace("!= torch.float16",
                                                             "== torch.float32"))],
                                  FACTORS, ["you applied fp16's split to bf16"], []),
    "after as W // before": ("17", [("    return before, world_size / before\n",
                                     "    return before, world_size // before\n")],
                             FACTORS, ["after as W // before"], []),
    "a loop that doubles first": (
        "17", [(LOOP, "    before = 1\n    while world_size % (2 * before) == 0 and "
                      "world_size / (2 * before) >= 2 * before:\n        before *= 2\n"
                      "    return before, world_size / before\n")],
        FACTORS, ["your loop ends elsewhere than torch's"], []),
    "padding above the chunk": (
        "17", [(PIECE, PIECE.replace("torch.cat([piece, piece.new_zeros(n - len(piece), "
                                     "*g.shape[1:])])", "torch.cat([piece.new_zeros(n - "
                                     "len(piece), *g.shape[1:]), piece])"))],
        SHARDS, ["padded each chunk with zero rows above its rows"], []),
    "parameter-major order": (
        "17", [("    for r in range(world_size):\n        for g, n in zip(grads, rows):\n",
                "    for g, n in zip(grads, rows):\n        for r in range(world_size):\n")],
        SHARDS, ["parameter-major"], []),
    "the flat layout": (
        "17", [(BUFFER, "    buffer = torch.cat([g.reshape(-1) for g in grads]).to(reduce_dtype)\n"
                        "    buffer = torch.cat([buffer, buffer.new_zeros(-len(buffer) % "
                        "world_size)])\n")],
        SHARDS, ["the gradients whole, one after another"], []),
    "unpadded rows, the buffer padded at its end": (
        "17", [(PIECE, "            pieces.append(piece)\n"),
               (BUFFER, "    buffer = torch.cat([p.reshape(-1) for p in pieces])\n"
                        "    buffer = torch.cat([buffer, buffer.new_zeros(world_size * sum(n * "
                        "g[0].numel() for g, n in zip(grads, rows)) - len(buffer))])\n"
                        "    buffer = buffer.to(reduce_dtype)\n")],
        SHARDS, ["padded each row at its end instead of each chunk"], []),
    "no padding at all": (
        "17", [(PIECE, "            pieces.append(piece)\n")],
        SHARDS, ["your chunks are not padded"], []),
    "the list form of reduce_scatter": (
        "17", [(RS, "    dist.reduce_scatter(out, list(buffer.chunk(world_size)))\n")],
        SHARDS, ["dist.reduce_scatter, the list form"], []),
    "1/W before the sum": ("17", [("    buffer.div_(before)\n",
                                   "    buffer.mul_(1 / world_size)\n")],
                           SHARDS, ["multiplied by 1/W before the sum"], []),
    "AVG in fp16": ("17", [(RS + "    out.div_(after)\n",
                            "    reduce_scatter(out, buffer, op=dist.ReduceOp.AVG)\n")],
                    SHARDS, ["ReduceOp.AVG in fp16"], []),
    "reduced in the gradients' dtype": ("17", [(".to(reduce_dtype)\n", "\n")], SHARDS,
                                        ["torch reduces in reduce_dtype"], []),
    "the padded shard kept": ("17", [("    return [part[:s.numel()].view_as(s).to(g.dtype)\n",
                                      "    return [part.view(-1, *s.shape[1:]).to(g.dtype)\n")],
                              SHARDS, ["unpadded"], []),
    "the sum divided by W in fp16": ("17", [("    out.div_(after)\n",
                                             "    out.div_(world_size)\n")],
                                     SHARDS, ["you divided the sum by W"], []),
    "fp16 divided in fp32, then cast": (
        "17", [(BUFFER + DIVIDE, "    before, after = divide_factors(world_size, reduce_dtype)\n"
                                 "    buffer = (torch.cat([p.reshape(-1) for p in pieces]) / "
                                 "before).to(reduce_dtype)\n")],
        SHARDS, ["divided by before in fp32, then cast"], []),
    "this rank's chunk in every row": (
        "17", [("            piece = chunk(g, world_size, r)\n",
                "            piece = chunk(g, world_size, rank)\n")],
        SHARDS, ["every row of your buffer holds this rank's chunks"], []),
    "the shards left in reduce_dtype": (
        "17", [("    return [part[:s.numel()].view_as(s).to(g.dtype)\n",
                "    return [part[:s.numel()].view_as(s)\n")],
        SHARDS, ["cast each back to its gradient's dtype"], []),
    "the sum multiplied by 1 / after": ("17", [("    out.div_(after)\n",
                                                "    out.mul_(1 / after)\n")],
                                        SHARDS, ["you multiplied the sum by 1 / 3"], []),
    "an all_reduce, then this rank's part": (
        "17", [(RS, "    whole = buffer.clone()\n    dist.all_reduce(whole)\n"
                    "    out.copy_(whole.view(world_size, -1)[rank])\n")],
        ONE, ["an all_reduce of the whole buffer"], []),
}
#: Mistakes no diagnosis was written for: the first line alone, the first place where the
#: learner's collectives and shards leave torch's, must locate each
UNLISTED_17 = {
    "the rows in reverse rank order": (
        "17", [("            piece = chunk(g, world_size, r)\n",
                "            piece = chunk(g, world_size, world_size - 1 - r)\n")],
        SHARDS, ["your input of collective 1 (reduce_scatter_single) differs from torch's"], []),
    "the next rank's shard": (
        "17", [("    shards = [chunk(g, world_size, rank) for g in grads]\n",
                "    shards = [chunk(g, world_size, (rank + 1) % world_size) for g in grads]\n")],
        SHARDS, ["your shard of parameter 0 was shape (12, 16)", "torch's shape (14, 16)"], []),
    "the sum divided by W + 1": (
        "17", [("    out.div_(after)\n", "    out.div_(after + 1)\n")],
        SHARDS, ["your shard of parameter 0 differs from torch's", "torch made"], []),
}
RIGHT_17 = {
    "AVG for fp32 and bf16": ("17", [(RS + "    out.div_(after)\n",
                                      "    if reduce_dtype == torch.float16:\n"
                                      "        reduce_scatter(out, buffer)\n"
                                      "        out.div_(after)\n    else:\n"
                                      "        reduce_scatter(out, buffer, "
                                      "op=dist.ReduceOp.AVG)\n")]),
    "the sum divided out of place": ("17", [("    out.div_(after)\n",
                                             "    out = torch.div(out, after)\n")]),
    "the reduce_scatter_tensor name": ("17", [(RS, "    (getattr(dist, 'reduce_scatter_single', "
                                                   "None) or dist.reduce_scatter_tensor)(out, "
                                                   "buffer)\n")]),
    "padding with torch.nn.functional.pad": ("17", [(PIECE, (
        "            pieces.append(torch.nn.functional.pad(piece, (0, 0) * (piece.dim() - 1) "
        "+ (0, n - len(piece))))\n"))]),
}


@pytest.mark.slow
def test_exercise_17_names_each_mistake_and_passes_other_right_solutions(tmp_path):
    problems = problems_in_one_run({**WRONG_17, **UNLISTED_17}, RIGHT_17, tmp_path)
    assert not problems, "\n\n".join(problems)


# ----- exercise 17b: a unit's life -----

AFTER_FORWARD = ("        if self.reshard_after_forward and not self.is_root:\n"
                 "            self.free()\n")
BEFORE_BACKWARD = ("    def before_backward(self) -> None:\n        if not self.gathered:\n"
                   "            self.gather()\n")
ADD = ("                if shard.grad is None:\n                    shard.grad = mine\n"
       "                else:\n                    shard.grad += mine\n")
HELD = "after forward only the root holds its full parameters"
COUNTS = "all-gathers: one for a unit's forward"
UNIT_BITS = "every gradient shard and parameter shard equals torch's"
WRONG_17B = {
    "the root freed after forward": (
        "17b", [(AFTER_FORWARD, "        if self.reshard_after_forward:\n"
                                "            self.free()\n")],
        HELD, ["the root had freed its parameters", "self.is_root"], []),
    "nothing freed after forward": ("17b", [(AFTER_FORWARD, "        pass\n")], HELD,
                                    ["still held its full parameters", "after_forward frees"],
                                    []),
    "ZeRO-2 freed after forward": (
        "17b", [(AFTER_FORWARD, "        if not self.is_root:\n            self.free()\n")],
        HELD, ["reshard_after_forward False (ZeRO-2)"], []),
    "no gather for backward": (
        "17b", [(BEFORE_BACKWARD, "    def before_backward(self) -> None:\n        pass\n")],
        "gathered whenever its forward or its backward runs",
        ["backward was about to run with its parameters freed", "before_backward"], []),
    "gathered again for backward, though kept": (
        "17b", [(BEFORE_BACKWARD, "    def before_backward(self) -> None:\n"
                                  "        self.gather()\n")],
        COUNTS, ["the root was gathered 2 times", "self.gathered"], []),
    "the shard's .grad replaced": ("17b", [(ADD, "                shard.grad = mine\n")],
                                   UNIT_BITS, ["replaced what the backward before it left"],
                                   []),
    "not freed after backward": (
        "17b", [("                full.grad = None\n        self.free()\n",
                 "                full.grad = None\n")],
        HELD, ["after backward", "after_backward frees them"], []),
    "the full gradients never cleared": ("17b", [("                full.grad = None\n", "")],
                                         HELD, ["still held full-size gradients", "None"], []),
    "the full gradients zeroed, not dropped": (
        "17b", [("                full.grad = None\n", "                full.grad.zero_()\n")],
        HELD, ["still held full-size gradients", "zeroing it keeps the memory"], []),
    "the missing gradients filtered out before the reduce-scatter": (
        "17b", [("self.reduce_scatter([p.grad for p in self.full])",
                 "self.reduce_scatter([p.grad for p in self.full if p.grad is not None])")],
        "raised: RuntimeError", ["in after_backward", "shard.grad = mine"], []),
    "gathered before every forward, without asking": ("17b", [(
        "    def before_forward(self) -> None:\n        if not self.gathered:\n"
        "            self.gather()\n",
        "    def before_forward(self) -> None:\n        self.gather()\n")],
        COUNTS, ["before_forward gathered the parameters though they were gathered already",
                 "extra all-gather"], []),
    "its own reduce-scatter per parameter": (
        "17b", [("            reduced = self.reduce_scatter([p.grad for p in self.full])\n",
                 "            reduced = []\n"
                 "            for p, n in zip(self.full, self.rows):\n"
                 "                if p.grad is None:\n"
                 "                    reduced.append(None)\n"
                 "                    continue\n"
                 "                buffer = torch.cat([padded(chunk(p.grad, self.world_size, r), n)"
                 " for r in range(self.world_size)])\n"
                 "                out = buffer.new_empty(buffer.numel() // self.world_size)\n"
                 "                dist.reduce_scatter_tensor(out, buffer)\n"
                 "                rows = chunk(p.grad, self.world_size, self.rank)\n"
                 "                reduced.append(out.div_(self.world_size)[:rows.numel()]"
                 ".view_as(rows))\n")],
        COUNTS, ["made 2 reduce-scatters", "every collective counts"], []),
    "reduced without sync too": (
        "17b", [("        if self.requires_gradient_sync:\n            reduced",
                 "        if True:\n            reduced")],
        COUNTS, ["made a reduce-scatter in a backward without sync"], []),
    "the gradient without sync dropped": (
        "17b", [("                full.grad = None\n        self.free()\n",
                 "                full.grad = None\n        for p in self.full:\n"
                 "            p.grad = None\n        self.free()\n")],
        UNIT_BITS, ["the one of the backward without sync before it was lost"], []),
    "one reduce-scatter per parameter": (
        "17b", [("            reduced = self.reduce_scatter([p.grad for p in self.full])\n",
                 "            reduced = [self.reduce_scatter([p.grad])[0] for p in self.full]\n")],
        COUNTS, ["made 2 reduce-scatters in one backward"], []),
    "the reduced gradient averaged again": (
        "17b", [(ADD, "                mine = mine / self.world_size\n" + ADD)],
        UNIT_BITS, ["the reduced gradient times 1 / the world size"], []),
    "the root's shards left out of the optimizer": (
        "17b", [("    return optimizer_class([s for u in units for s in u.shards], **defaults)",
                 "    return optimizer_class([s for u in units if not u.is_root "
                 "for s in u.shards], **defaults)")],
        "make_optimizer: an optimizer over this rank's shards", ["the root's too"], []),
    "the optimizer over the full parameters": (
        "17b", [("    return optimizer_class([s for u in units for s in u.shards], **defaults)",
                 "    return optimizer_class([p for u in units for p in u.full], **defaults)")],
        "make_optimizer: an optimizer over this rank's shards", ["full parameters"], []),
}
RIGHT_17B = {
    "added with add_ into a copy": ("17b", [(ADD, (
        "                if shard.grad is None:\n                    shard.grad = mine.clone()\n"
        "                else:\n                    shard.grad.add_(mine)\n"))]),
    "the frozen shards left out of the optimizer": ("17b", [(
        "    return optimizer_class([s for u in units for s in u.shards], **defaults)",
        "    return optimizer_class([s for u in units for s in u.shards if s.requires_grad], "
        "**defaults)")]),
}


@pytest.mark.slow
def test_exercise_17b_names_each_mistake_and_passes_other_right_solutions(tmp_path):
    problems = problems_in_one_run(WRONG_17B, RIGHT_17B, tmp_path)
    assert not problems, "\n\n".join(problems)
