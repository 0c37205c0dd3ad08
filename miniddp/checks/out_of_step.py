"""Messages for ranks out of step: which rank differs, what it was doing, what to change.

When ranks disagree, the useful report names the odd rank, not the one that happened to time
out first. Every rank builds its message from the same records (read from the ledger, see
``miniddp.checks.ledger``), so every rank raises the same words. A record describes what one rank is
doing: ``forward`` (how many forwards with gradients enabled it has run), ``unsynced`` (the
forwards it ran inside ``no_sync`` since its previous synchronized forward), ``no_backward``
(synchronized forwards that no backward followed) and, for a collective, ``what``, ``bucket``,
``numel`` and ``dtype``.
"""

from __future__ import annotations

from collections import defaultdict


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _anomalies(record: dict) -> int:
    return len(record.get("unsynced", ())) + len(record.get("no_backward", ()))


def odd_ranks(records: dict[int, dict], signature) -> tuple[list[int], list[int]]:
    """Split the ranks into (odd ones, the rest) by ``signature(record)``.

    The odd ones are those outside the largest group. With no single largest group (two
    ranks, say), the group whose records show the fewest irregularities - forwards inside
    ``no_sync``, forwards without backward - and then the fewest forwards counts as normal:
    the rank that skipped something is usually the one that moved ahead.
    """
    groups: dict[object, list[int]] = defaultdict(list)
    for rank in sorted(records):
        groups[signature(records[rank])].append(rank)
    if len(groups) == 1:
        return [], sorted(records)
    size = max(len(ranks) for ranks in groups.values())
    largest = [ranks for ranks in groups.values() if len(ranks) == size]
    normal = min(largest, key=lambda ranks: (_anomalies(records[ranks[0]]),
                                            records[ranks[0]].get("forward", 0), ranks[0]))
    return [r for r in sorted(records) if r not in normal], normal


def describe(record: dict) -> str:
    """What a rank was doing, in words."""
    if "message" in record:  # its last record is the error it raised (Checks.fail)
        return f"it had stopped with this error: {record['message']}"
    if "what" in record:
        text = f"about to launch {record['what']}"
        if record.get("bucket") is not None:
            text += f" of bucket {record['bucket']}"
        text += f" ({record['numel']} x {record['dtype']}) in forward {record['forward']}"
    else:
        text = f"in synchronized forward {record['forward']}"
    if record.get("unsynced"):
        text += f", after running forward(s) {record['unsynced']} inside no_sync()"
    if record.get("no_backward"):
        text += (f", having run no backward after synchronized forward(s) "
                 f"{record['no_backward']}")
    return text


def advice(odd: list[int], normal: list[int], records: dict[int, dict]) -> str:
    """What to change, from how the odd ranks' records differ from the others'."""
    a, b = records[odd[0]], records[normal[0]]
    if a.get("unsynced") != b.get("unsynced"):
        return (f"{_ranks(odd)} and {_ranks(normal)} disagree on which forwards synchronize: "
                "use no_sync() for the same forwards on every rank (decide it from the step "
                "number, never from data or timings that differ across ranks).")
    if a.get("no_backward") != b.get("no_backward"):
        return (f"{_ranks(odd)} and {_ranks(normal)} disagree on which synchronized forwards "
                "are followed by a backward: call backward() after a synchronized forward on "
                "every rank or on none (skip a batch on every rank together; run forwards that "
                "need no backward under torch.no_grad()).")
    if a["forward"] != b["forward"]:
        return (f"{_ranks(odd)} ran a different number of forwards with gradients enabled "
                f"than {_ranks(normal)}: run the same forwards on every rank (evaluation "
                "under torch.no_grad(), the same number of batches everywhere).")
    return (f"{_ranks(odd)} launch a different collective from {_ranks(normal)}: the ranks' "
            "buckets differ (the same model, dtypes and bucket_cap_mb on every rank).")


def disagreement(records: dict[int, dict], signature, where: str) -> str | None:
    """The message for ranks whose records differ by ``signature``, or None if they agree."""
    odd, normal = odd_ranks(records, signature)
    if not odd:
        return None
    doing = "; ".join(f"rank {r}: {describe(records[r])}" for r in sorted(records))
    verb = "differs" if len(odd) == 1 else "differ"
    doing = "; ".join(f"rank {r}: {describe(records[r])}" for r in sorted(records))
    text = advice(odd, normal, records)
    return (f"ranks out of step at {where}: {_ranks(odd)} {verb} from {_ranks(normal)} "
            f"({describe(records[normal[0]])}). What each rank was doing: {doing}. "
            f"{text[0].upper()}{text[1:]}")


def missing(key_meaning: str, arrived: dict[int, dict], absent: list[int],
            last: dict[int, dict | None], waited: float) -> str:
    """The message when some ranks never wrote the record the others wait for."""
    lines = [f"{_ranks(absent)} did not reach {key_meaning} within {waited:.1f} s, where "
             f"{_ranks(sorted(arrived))} arrived"]
    if arrived:
        first = min(arrived)
        lines.append(f"(rank {first} {describe(arrived[first])})")
    for r in absent:
        lines.append(f"; rank {r}'s last record: "
                     + (describe(last[r]) if last.get(r) else "none"))
    return (" ".join(lines) + ". A rank that stops early has run fewer steps than the others, "
            "skipped a backward, or is stuck or dead: give every rank the same number of "
            "batches and steps.")


def stalled(waiting: dict[int, dict], world_size: int) -> str:
    """After a failed wait: which ranks reported waiting where, and who did not report."""
    if not waiting:
        return "No rank reported where it was waiting."
    where = "; ".join(f"rank {r} in the backward of forward {w['forward']} "
                      f"(synchronized forward {w['synced']}), bucket {w['bucket']}"
                      for r, w in sorted(waiting.items()))
    text = f"Ranks waiting for an all_reduce: {where}."
    silent = [r for r in range(world_size) if r not in waiting]
    if silent:
        who = _ranks(silent)
        text += (f" {who[0].upper()}{who[1:]} did not report waiting: "
                 f"{'it' if len(silent) == 1 else 'they'} may have run fewer steps, skipped "
                 "this backward or run it inside no_sync(), or be stuck elsewhere.")
    if len({(w["forward"], w["synced"]) for w in waiting.values()}) > 1:
        odd, _ = odd_ranks(waiting, lambda w: (w["forward"], w["synced"]))
        text += (f" The ranks are at different forwards: {_ranks(odd)} ran a forward "
                 "inside no_sync() or skipped a backward where the others synchronized.")
    return text + (" Run with TORCH_DISTRIBUTED_DEBUG=DETAIL to have miniddp compare every "
                   "collective across ranks and name the rank that differs at once.")
