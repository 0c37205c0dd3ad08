"""The reference job: it learns, says what it does, and a killed run resumes to the same bits.

The runs here fork their ranks from the test process, as ``python -m miniddp.train`` does (its
``main`` is called directly), minus the seconds of ``import torch`` a new interpreter costs.
The torchrun runs of the same module are in test_faults.py.
"""

import re

import pytest
import torch
from jobs import run_job, same_weights, weights

from miniddp import checkpoint, train
from miniddp.data import make_model
from miniddp.launch import RankError

# 2 ranks x 256 samples per epoch / 16 per batch: 16 steps an epoch, 64 in all.
JOB = ["--epochs", "4", "--dataset-size", "512", "--batch-size", "16", "--save-every-steps", "5"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The final weights of the job run from start to end without interruption."""
    out = tmp_path_factory.mktemp("reference")
    run_job([*JOB, "--snapshot", str(out / "snap.pt"), "--out", str(out / "final.pt")])
    return weights(out / "final.pt")


def interrupted_then_resumed(tmp_path, fault: str) -> tuple[dict, RankError]:
    """Run the job until ``fault`` stops it, then run the same command again."""
    argv = [*JOB, "--snapshot", str(tmp_path / "snap.pt"), "--out", str(tmp_path / "final.pt")]
    with pytest.raises(RankError) as failure:
        run_job([*argv, "--fault", fault])
    run_job(argv)
    return weights(tmp_path / "final.pt"), failure.value


def test_job_learns_and_reports_progress(tmp_path, capfd):
    assert train.main(["--nproc", "2", *JOB, "--out", str(tmp_path / "final.pt")]) == 0
    output = capfd.readouterr().out
    epochs = re.findall(r"epoch +(\d+)/4 \| step +(\d+) \| loss ([\d.]+) \| +([\d,]+) samples/s",
                        output)
    assert [(int(e), int(s)) for e, s, _, _ in epochs] == [(1, 16), (2, 32), (3, 48), (4, 64)]
    losses = [float(loss) for _, _, loss, _ in epochs]
    assert losses[-1] < losses[0] / 3, f"the loss should fall well below its start: {losses}"
    assert "starting from scratch: 2 ranks" in output and "held-out loss" in output
    make_model().load_state_dict(weights(tmp_path / "final.pt"))  # plain names, no prefix


def test_killed_mid_epoch_and_resumed_ends_with_the_same_weights_bit_for_bit(
        tmp_path, reference, capfd):
    # Step 21 is the 6th step of epoch 1; the last snapshot before it is step 20, 4 steps in.
    resumed, failure = interrupted_then_resumed(tmp_path, "exit:1:21")
    assert failure.rank == 1 and "died without reporting" in str(failure)
    assert "resuming from" in capfd.readouterr().out
    assert same_weights(resumed, reference)


def test_resume_restarts_mid_epoch_where_the_snapshot_stopped(tmp_path, capfd):
    with pytest.raises(RankError):
        run_job([*JOB, "--snapshot", str(tmp_path / "snap.pt"), "--fault", "raise:0:21"])
    snap = torch.load(tmp_path / "snap.pt", weights_only=True)
    assert (snap["epoch"], snap["step"], snap["sampler"]["consumed"]) == (1, 20, 64)
    capfd.readouterr()
    run_job([*JOB, "--snapshot", str(tmp_path / "snap.pt")])
    out = capfd.readouterr().out
    assert "resuming from" in out and "epoch 1, step 20, 64/256 of the epoch's samples" in out
    assert "epoch   2/4 | step     32 |" in out, "the resumed epoch must end at its usual step"


def test_save_every_counts_epochs(tmp_path):
    # Snapshots after epochs 2 and 4 only; stopped in epoch 3, the snapshot is epoch 2's end.
    argv = ["--epochs", "4", "--dataset-size", "512", "--batch-size", "16", "--save-every", "2",
            "--snapshot", str(tmp_path / "snap.pt")]
    with pytest.raises(RankError):
        run_job([*argv, "--fault", "raise:1:40"])
    snap = torch.load(tmp_path / "snap.pt", weights_only=True)
    assert (snap["epoch"], snap["step"]) == (2, 32)


def test_without_its_random_state_a_resume_diverges(tmp_path, reference, monkeypatch):
    """The negative control: the snapshot's RNG state is what keeps the noise the same."""
    monkeypatch.setattr(checkpoint, "set_rng_state", lambda state: None)
    resumed, _ = interrupted_then_resumed(tmp_path, "exit:1:21")
    assert not same_weights(resumed, reference)
