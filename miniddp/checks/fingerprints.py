"""Debug mode: compare every collective across ranks before launching it.

Gloo and NCCL pair the k-th collective of each rank with the k-th of the others, whatever they
are. If one rank skipped a backward, ran ``no_sync`` alone or stopped one step early, the others
wait for the whole timeout, and the first to time out - a rank that did nothing wrong - is the
one reported. With ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (torch's switch for its own collective
checks), each collective miniddp is about to launch gets a fingerprint: its sequence number,
what it is, which bucket, how many elements of which dtype, and which forward of this rank it
belongs to. Each rank writes its fingerprint to the ledger and reads everyone's before
launching:

* fingerprints that differ raise at once, on every rank, naming the rank that differs, what it
  was doing and what the others expected (``miniddp.checks.out_of_step``);
* a rank that never writes one (it finished early, or is stuck elsewhere) makes the others raise
  after the process group's timeout, naming it and the last thing it did.

This costs a few store round trips per collective: a debugging tool, not for every run.
"""

from __future__ import annotations

import torch

from miniddp.checks import out_of_step
from miniddp.checks.ledger import RecordsMissing


def _signature(record: dict) -> tuple:
    return (record["what"], record["bucket"], record["numel"], record["dtype"],
            record["forward"], tuple(record["unsynced"]), tuple(record["no_backward"]))


class CollectiveFingerprints:
    """Fingerprints of one DDP's collectives, compared across ranks before each launch."""

    def __init__(self, checks):
        self.checks = checks  # the ConsistencyChecks that own this (for forward history)
        self.ledger = checks.ledger
        self.sequence = 0

    def before(self, what: str, bucket: int | None, tensors: list[torch.Tensor]) -> None:
        """Raise, on every rank, unless every rank is about to launch this same collective."""
        self.sequence += 1
        key = f"{self.checks.scope}collective{self.sequence}"
        record = {"sequence": self.sequence, "what": what, "bucket": bucket,
                  "numel": sum(t.numel() for t in tensors),
                  "dtype": str(tensors[0].dtype).replace("torch.", "") if tensors else "none",
                  **self.checks.now()}
        self.ledger.write(key, record)
        try:
            records = dict(enumerate(self.ledger.gather(key)))
        except RecordsMissing as gone:
            raise self.checks.fail(out_of_step.missing(
                f"collective {self.sequence} ({out_of_step.describe(record)} here)",
                gone.arrived, gone.missing, gone.last, gone.waited)) from None
        self.ledger.forget(f"{self.checks.scope}collective{self.sequence - 1}")  # all read it
        problem = out_of_step.disagreement(records, _signature, f"collective {self.sequence}")
        if problem is not None:
            raise self.checks.fail(problem)
