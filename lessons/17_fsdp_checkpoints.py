"""Lesson 17, part 3: sharded checkpoints, saved at 2 ranks and loaded at 3.

What this adds since part 2 (``17_fsdp_options.py``): training is sharded, so a checkpoint is too.
No rank holds the model, and gathering it onto one rank to save would need the memory sharding
exists to save. So each rank writes only its own rows, and says where they sit: a sharded
parameter is a DTensor (torch.distributed's "part of a global tensor"), which knows its global
shape and its rank's offset in it. ``torch.distributed.checkpoint`` (DCP) writes each rank's rows
with that offset, one file per rank; at load, each rank reads whatever pieces overlap the rows it
holds now, so the job can come back at another world size. Here:

1. **what each rank writes**: 2 ranks train a few steps under ``miniddp.fully_shard`` and under
   torch's, and save model and Adam state with DCP: the bytes of each rank's file, beside the
   whole model's;
2. **the reshard, by hand**: which rows of which saved file each of 3 ranks needs (an overlap
   of two cuts), checked against the offsets DCP wrote;
3. **the resumed step**: 3 ranks load the checkpoint into a freshly built model and optimizer;
   every element restored, and the next step bit for bit torch's resumed step; a full state
   dict gathered there (``miniddp.fsdp.full_state_dict``: the whole model, no padding rows, though
   the cut is uneven at 3) and loaded into another model gives the same rows;
4. **what the DTensor prevents**: the same save with each rank's rows as a plain tensor. DCP
   takes a plain tensor for replicated (every rank holds the same), writes one rank's copy and
   hands it to every rank at load: the other ranks get that rank's rows back, and nothing
   raises.

Run it:

    python lessons/17_fsdp_checkpoints.py                    # saved at 2 ranks, loaded at 3
    python lessons/17_fsdp_checkpoints.py --save-at 3 --load-at 1

It forks its own ranks twice, at two world sizes (torchrun runs one world size per job). What
you will see: the bytes per rank, the rows each new rank reads, 0 elements differing, rows
wrong with plain tensors; ``OK: ...``. About 25 s. It needs torch's FSDP2 (torch 2.4 or
later): before, it prints ``SKIPPED: ...``.
"""

import argparse
import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import miniddp
from course.data import IN_FEATURES, OUT_FEATURES, make_dataset
from course.report import check, ok, print0
from miniddp.launch import launch

try:  # FSDP2 and its checkpoint helpers: public from torch 2.6, under _composable before
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
except ImportError:
    torch_fully_shard = None

WIDTHS = (IN_FEATURES, 382, 218, OUT_FEATURES)  # 382, 218 rows: even at 2 ranks, uneven at 3
STEPS, BATCH = 3, 16
SHARD = {"miniddp": miniddp.fully_shard, "torch": torch_fully_shard}


def build(impl: str, seed: int):
    """The model, each Linear a unit and the root one, under ``impl``'s ``fully_shard``."""
    torch.manual_seed(seed)
    layers = []
    for d_in, d_out in zip(WIDTHS, WIDTHS[1:]):
        layers += [nn.Linear(d_in, d_out), nn.Tanh()]
    model = nn.Sequential(*layers[:-1])
    for layer in model[::2]:
        SHARD[impl](layer)
    SHARD[impl](model)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train_step(model, optimizer, step: int) -> float:
    rank = dist.get_rank()
    x, y = make_dataset(n=BATCH * 8 * STEPS, seed=1).tensors
    start = BATCH * (8 * step + rank)  # each rank its own rows of the step's data
    loss = F.mse_loss(model(x[start:start + BATCH]), y[start:start + BATCH])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def whole(model, optimizer) -> dict:
    """Every element of the model and of Adam's state, gathered on every rank (to check)."""
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    found = {f"model {k}": v for k, v in msd.items()}
    for name, state in osd["state"].items():
        found.update({f"adam {name} {k}": v for k, v in state.items()})
    return {k: v.clone() for k, v in found.items()}


def differing(a: dict, b: dict) -> int:
    return sum(int((a[k] != b[k]).sum()) if a[k].shape == b[k].shape else b[k].numel()
               for k in b)


# ----- 1. save at 2 ranks -----

def save(path: str) -> dict:
    for impl in SHARD:
        model, optimizer = build(impl, seed=0)
        losses = [train_step(model, optimizer, step) for step in range(STEPS - 1)]
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{path}/{impl}")
        if impl == "miniddp":
            saved = whole(model, optimizer)
            plain = plain_tensors_round_trip(model, f"{path}/plain")  # (spoils the model)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = os.path.getsize(f"{path}/miniddp/__{rank}_0.distcp")
    whole_bytes = sum(t.numel() * t.element_size() for t in saved.values())
    sizes = [None] * world
    dist.all_gather_object(sizes, mine)
    print0(f"1. saved at {world} ranks, after {STEPS - 1} Adam steps (loss {losses[-1]:.4f}):")
    for r, size in enumerate(sizes):
        print0(f"   rank {r} wrote {size:>7} bytes, {size / whole_bytes:4.0%} of the model and "
               f"Adam's state ({whole_bytes} bytes of tensors)")
    return saved, plain


def plain_tensors_round_trip(model, path: str) -> tuple[list[int], bool]:
    """Each rank's rows saved as a plain tensor, then read back: what DCP does with them."""
    rows = {k: getattr(v, "to_local", lambda v=v: v)() for k, v in model.state_dict().items()}
    before = {k: v.clone() for k, v in rows.items()}
    dcp.save(rows, checkpoint_id=path)
    for t in rows.values():
        t.zero_()  # a crash: the job restarts with nothing
    dcp.load(rows, checkpoint_id=path)
    wrong = sum(int((rows[k] != before[k]).sum()) for k in rows)
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, wrong)
    copies = [None] * dist.get_world_size()
    dist.all_gather_object(copies, [t.clone() for t in rows.values()])
    alike = all(torch.equal(a, b) for other in copies[1:] for a, b in zip(copies[0], other))
    return counts, alike


# ----- 2. which saved rows each new rank reads -----

def rows_of(rank: int, world: int, n: int) -> range:
    """The rows rank ``rank`` of ``world`` holds of an ``n``-row parameter: torch.chunk's cut."""
    chunk = math.ceil(n / world)
    return range(min(rank * chunk, n), min((rank + 1) * chunk, n))


def reads(saved_world: int, rank: int, world: int, n: int) -> list[tuple[int, range]]:
    """(saved rank, rows) for every piece of a saved file that rank ``rank`` of ``world``
    needs: the overlap of its rows now with each saved rank's rows."""
    mine = rows_of(rank, world, n)
    return [(s, range(max(r.start, mine.start), min(r.stop, mine.stop)))
            for s in range(saved_world) if len(r := rows_of(s, saved_world, n))
            and max(r.start, mine.start) < min(r.stop, mine.stop)]


def check_offsets(path: str, saved_world: int, shapes: dict) -> None:
    """The rows by hand are where DCP wrote them: its metadata lists each piece's offset."""
    metadata = dcp.FileSystemReader(f"{path}/miniddp").read_metadata().state_dict_metadata
    for name, shape in shapes.items():
        written = sorted((c.offsets[0], c.offsets[0] + c.sizes[0])
                         for c in metadata[f"model.{name}"].chunks)
        by_hand = sorted((r.start, r.stop) for s in range(saved_world)
                         if len(r := rows_of(s, saved_world, shape[0])))
        check(written == by_hand, f"{name}: DCP wrote rows {written}, by hand {by_hand}")


# ----- 3. load at 3 ranks, and the next step -----

def load(path: str, saved_world: int, saved: dict) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = {}
    for impl in SHARD:
        model, optimizer = build(impl, seed=7)  # other weights: all must come from the files
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=f"{path}/{impl}")
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        restored = whole(model, optimizer)
        if impl == "miniddp":
            wrong = differing(restored, saved)
            full = miniddp.fsdp.full_state_dict(model)  # every rank: the whole model, gathered
            check(all(torch.equal(v, saved[f"model {k}"]) for k, v in full.items()),
                  "miniddp.fsdp.full_state_dict is not the gathered model (padding rows kept?)")
            fresh, _ = build(impl, seed=9)  # and cut again
            miniddp.fsdp.load_full_state_dict(fresh, full)
            wrong += sum(int((a.to_local() != b.to_local()).sum())
                         for a, b in zip(fresh.parameters(), model.parameters()))
        loss = train_step(model, optimizer, STEPS - 1)
        rows[impl] = [p.to_local() for p in model.parameters()]
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    check_offsets(path, saved_world, shapes)
    n = shapes["0.weight"][0]
    print0(f"2. loaded at {world} ranks: the rows of 0.weight ({n} rows) each rank reads")
    for r in range(world):
        pieces = ", ".join(f"rows {p.start}:{p.stop} from rank {s}'s file"
                           for s, p in reads(saved_world, r, world, n))
        print0(f"   rank {r} (rows {rows_of(r, world, n).start}:{rows_of(r, world, n).stop}): "
               f"{pieces}")
    differ = sum(int((a != b).sum()) for a, b in zip(rows["miniddp"], rows["torch"]))
    print0(f"3. restored elements wrong: {wrong} of {sum(t.numel() for t in saved.values())}; "
           f"the step after: loss {loss:.4f}, {differ} elements differ from torch's")
    check(wrong == 0, f"rank {rank}: {wrong} elements of the model or Adam's state did not come "
          "back from the checkpoint")
    check(differ == 0, f"rank {rank}: the resumed step differs from torch's resumed step in "
          f"{differ} parameter elements")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save-at", type=int, default=2, help="ranks that train and save")
    parser.add_argument("--load-at", type=int, default=3, help="ranks that load and resume")
    args = parser.parse_args()
    if torch_fully_shard is None:
        return print(f"SKIPPED: lesson 17 needs torch's FSDP2 (fully_shard), {torch.__version__} "
                     "has none")
    with tempfile.TemporaryDirectory() as path:
        saved, (counts, alike) = launch(save, args.save_at, args=(path,), backend="gloo")[0]
        launch(load, args.load_at, args=(path, args.save_at, saved), backend="gloo")
    print(f"4. at {args.save_at} ranks, each rank's rows saved as plain tensors and read back: "
          + ", ".join(f"rank {r} {n} elements wrong" for r, n in enumerate(counts))
          + ("; every rank now holds the same rows" if alike else ""))
    check(alike and (sum(counts) > 0 or args.save_at == 1),
          f"plain tensors read back with {counts} elements wrong per rank: DCP should have "
          "written one copy of each (it takes a plain tensor for replicated) and handed it to "
          "every rank")
    ok(f"saved at {args.save_at} ranks, each rank its own rows; loaded at {args.load_at}, every "
       "element restored and the next step bit for bit torch's; plain tensors came back wrong")


if __name__ == "__main__":
    main()
