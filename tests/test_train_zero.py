"""The reference job with ``--zero``: Adam's state sharded over the ranks, a snapshot that holds
it whole, and a resume that changes nothing.

Sharding changes where Adam's state lives, not the arithmetic: each element is stepped by the
same operations on whichever rank owns it. So a ``--zero`` run ends with the same weights, bit
for bit, as the plain run, and its snapshot's optimizer state is the plain run's, key for key.
"""

import pytest
import torch
from jobs import run_job, same_weights, weights

from miniddp.launch import RankError
from miniddp.optim import ZeroRedundancyOptimizer

# 2 ranks x 256 samples per epoch / 16 per batch: 16 steps an epoch, 32 in all.
JOB = ["--epochs", "2", "--dataset-size", "512", "--batch-size", "16", "--save-every-steps", "5"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict:
    """The job without --zero, uninterrupted: its final weights and its last snapshot."""
    out = tmp_path_factory.mktemp("plain")
    run_job([*JOB, "--snapshot", str(out / "snap.pt"), "--out", str(out / "final.pt")])
    return {"weights": weights(out / "final.pt"), "snapshot": weights(out / "snap.pt")}


def zero_run(tmp_path, fault: str | None = None) -> dict:
    argv = [*JOB, "--zero", "--snapshot", str(tmp_path / "snap.pt"),
            "--out", str(tmp_path / "final.pt")]
    if fault:
        with pytest.raises(RankError):
            run_job([*argv, "--fault", fault])
    run_job(argv)
    return {"weights": weights(tmp_path / "final.pt"), "snapshot": weights(tmp_path / "snap.pt")}


def same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_state(a[k], b[k])
                                                                    for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_state, a, b))
    return a == b


def test_zero_snapshot_holds_the_whole_state_of_plain_adam(tmp_path, plain):
    run = zero_run(tmp_path)
    assert same_weights(run["weights"], plain["weights"])
    state = run["snapshot"]["optimizer"]
    assert len(state["state"]) == len(plain["weights"]), "every parameter's moments"
    assert same_state(state, plain["snapshot"]["optimizer"])


def test_zero_killed_mid_epoch_and_resumed_ends_with_the_same_weights(tmp_path, plain, capfd):
    # Step 22 is the 7th step of epoch 1; the last snapshot before it is step 20.
    run = zero_run(tmp_path, "exit:1:22")
    out = capfd.readouterr().out
    assert "Adam's state sharded (ZeRO-1)" in out and "resuming from" in out
    assert same_weights(run["weights"], plain["weights"])


def test_without_the_optimizer_state_a_zero_resume_diverges(tmp_path, plain, monkeypatch):
    """The negative control: the consolidated state is what keeps Adam's moments."""
    monkeypatch.setattr(ZeroRedundancyOptimizer, "load_state_dict", lambda self, state: None)
    run = zero_run(tmp_path, "exit:1:22")
    assert not same_weights(run["weights"], plain["weights"])
