"""The reference job with ``--zero``: Adam's state sharded over the ranks, a snapshot that holds
it whole, and a resume that changes nothing.

Sharding changes where Adam's state lives, not the arithmetic: each element is stepped by the
same operations on whichever rank owns it. So a ``--zero`` run ends with the same weights, bit
for bit, as the plain run, and its snapshot's optimizer state is the plain run's, key for key.
"""

import shutil

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


def zero_argv(directory) -> list[str]:
    return [*JOB, "--zero", "--snapshot", str(directory / "snap.pt"),
            "--out", str(directory / "final.pt")]


def zero_run(directory) -> dict:
    run_job(zero_argv(directory))
    return {"weights": weights(directory / "final.pt"),
            "snapshot": weights(directory / "snap.pt")}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The --zero job's files after rank 1 died at step 22, the 7th step of epoch 1 (the last
    snapshot is step 20): each resume test starts from its own copy of them."""
    out = tmp_path_factory.mktemp("killed")
    with pytest.raises(RankError):
        run_job([*zero_argv(out), "--fault", "exit:1:22"])
    return out


def resumed(tmp_path, killed) -> dict:
    shutil.copytree(killed, tmp_path, dirs_exist_ok=True)
    return zero_run(tmp_path)


def same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_state(a[k], b[k])
                                                                    for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_state, a, b))
    return a == b


def test_zero_snapshot_holds_the_whole_state_of_plain_adam(tmp_path, plain, capfd):
    run = zero_run(tmp_path)
    assert "Adam's state sharded (ZeRO-1)" in capfd.readouterr().out
    assert same_weights(run["weights"], plain["weights"])
    state = run["snapshot"]["optimizer"]
    assert len(state["state"]) == len(plain["weights"]), "every parameter's moments"
    assert same_state(state, plain["snapshot"]["optimizer"])


def test_zero_killed_mid_epoch_and_resumed_ends_with_the_same_weights(tmp_path, plain, killed,
                                                                    capfd):
    run = resumed(tmp_path, killed)
    assert "resuming from" in capfd.readouterr().out
    assert same_weights(run["weights"], plain["weights"])


def test_without_the_optimizer_state_a_zero_resume_diverges(tmp_path, plain, killed,
                                                            monkeypatch):
    """The negative control: the consolidated state is what keeps Adam's moments."""
    monkeypatch.setattr(ZeroRedundancyOptimizer, "load_state_dict", lambda self, state: None)
    run = resumed(tmp_path, killed)
    assert not same_weights(run["weights"], plain["weights"])
