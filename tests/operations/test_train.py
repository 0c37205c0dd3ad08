"""The reference job: it learns, says what it does, and a killed run resumes to the same bits,
or, at another world size, to every sample of the interrupted epoch exactly once.

The runs here fork their ranks from the test process, as ``python -m miniddp.train`` does (its
``main`` is called directly), minus the seconds of ``import torch`` a new interpreter costs.
The torchrun runs of the same module are in test_faults.py.
"""

import math
import re

import pytest
import torch
from jobs import RecordingDataset, run_job, same_weights, weights
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from miniddp.launch import RankError
from miniddp.train import checkpoint
from miniddp.train import job as train
from miniddp.train.data import make_dataset, make_model

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


def test_a_job_with_bucket_cap_mb_0_trains_to_the_same_weights_as_with_the_default(tmp_path):
    """--bucket-cap-mb 0 (each parameter its own bucket, valid in torch's DDP) runs; at 2 ranks
    a sum of two gradients is the same in any bucket, so the weights match bit for bit."""
    short = ["--epochs", "1", "--dataset-size", "128", "--batch-size", "16"]
    finals = {}
    for cap in ("0", None):
        out = tmp_path / f"cap-{cap}.pt"
        results = run_job([*short, "--out", str(out), *(["--bucket-cap-mb", cap] if cap else [])])
        assert [r["steps"] for r in results] == [4, 4]
        finals[cap] = weights(out)
    assert same_weights(finals["0"], finals[None])


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


@pytest.mark.usefixtures("ranks_see_monkeypatches")
def test_without_its_random_state_a_resume_diverges(tmp_path, reference, monkeypatch):
    """The negative control: the snapshot's RNG state is what keeps the noise the same."""
    monkeypatch.setattr(checkpoint, "set_rng_state", lambda state: None)
    resumed, _ = interrupted_then_resumed(tmp_path, "exit:1:21")
    assert not same_weights(resumed, reference)


# --- resuming at another world size ---

# 2 epochs of 512 samples, 16 per batch, a snapshot every 5 steps.
SMALL = ["--epochs", "2", "--dataset-size", "512", "--batch-size", "16", "--save-every-steps", "5"]


def epoch_positions(world_size: int, epoch: int) -> list[int]:
    """What epoch ``epoch`` trains on at ``world_size`` ranks, as torch's sampler lays it out."""
    samplers = [TorchSampler(range(512), world_size, r, seed=0) for r in range(world_size)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return sorted(i for sampler in samplers for i in sampler)


@pytest.mark.usefixtures("ranks_see_monkeypatches")
@pytest.mark.parametrize("old, new, fault", [(2, 3, "exit:1:22"), (3, 2, "exit:1:17"),
                                             (2, 1, "exit:1:22")])
def test_resumed_at_another_world_size_every_sample_of_the_epoch_is_trained_once(
        tmp_path, monkeypatch, capfd, old, new, fault):
    recorder = RecordingDataset(make_dataset(512), tmp_path)
    monkeypatch.setattr(train, "make_dataset", lambda n, seed: recorder)
    argv = [*SMALL, "--snapshot", str(tmp_path / "snap.pt"), "--out", str(tmp_path / "out.pt")]
    recorder.label = "before"
    with pytest.raises(RankError):
        run_job([*argv, "--fault", fault], nproc=old)
    snap = torch.load(tmp_path / "snap.pt", weights_only=True)
    per_epoch = math.ceil(math.ceil(512 / old) / 16)  # steps: each rank's share, 16 a batch
    assert snap["epoch"] == 1 and 0 < snap["step"] - per_epoch < per_epoch, "a mid-epoch snapshot"
    kept = range(per_epoch, snap["step"])  # epoch 1's steps before the snapshot; later ones lost
    seen = [i for r in range(old) for k in kept for i in recorder.batches("before", r)[k]]

    capfd.readouterr()
    recorder.label = "after"
    run_job(argv, nproc=new)
    out = capfd.readouterr().out
    assert f"saved by {old} ranks, resumed by {new}" in out
    assert "NOT bit-identical to an uninterrupted one" in out
    after = [recorder.batches("after", r) for r in range(new)]
    assert len({len(batches) for batches in after}) == 1, "every rank took every step"
    seen += [i for batches in after for batch in batches for i in batch]
    assert sorted(seen) == epoch_positions(old, epoch=1), "each sample of the epoch once"
    make_model().load_state_dict(weights(tmp_path / "out.pt"))


# --- output paths: checked before training, the final model never thrown away ---

def bad_out_paths(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    (tmp_path / "a_dir").mkdir()
    return {"/proc": ("/proc/x", "cannot be written"),
            "a directory": (str(tmp_path / "a_dir"), "is a directory"),
            "under a file": (str(tmp_path / "a_file" / "model.pt"), "cannot be created")}


@pytest.mark.parametrize("flag", ["--out", "--snapshot"])
@pytest.mark.parametrize("case", ["/proc", "a directory", "under a file"])
def test_an_output_path_that_cannot_be_written_stops_the_job_before_training(
        tmp_path, capfd, flag, case):
    path, why = bad_out_paths(tmp_path)[case]
    assert train.main(["--nproc", "2", *JOB, flag, path]) == 2
    out, err = capfd.readouterr()
    assert f"miniddp.train: {flag} {path}" in err and why in err, err
    assert "starting from scratch" not in out, "nothing may train before the paths are checked"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "probe left"


def test_a_missing_output_directory_is_created(tmp_path):
    assert train.main(["--nproc", "2", "--epochs", "1", "--dataset-size", "64",
                       "--out", str(tmp_path / "new" / "dir" / "final.pt")]) == 0
    make_model().load_state_dict(weights(tmp_path / "new" / "dir" / "final.pt"))


@pytest.mark.usefixtures("ranks_see_monkeypatches")
def test_when_the_final_write_fails_the_model_is_written_beside_the_snapshot(
        tmp_path, monkeypatch, capfd):
    from miniddp.train import job_files
    out, snap = tmp_path / "out" / "final.pt", tmp_path / "snaps" / "snap.pt"
    real_write = job_files.write_atomic

    def disk_full_for_out(state, path, **kwargs):
        if str(path) == str(out):
            raise OSError(28, "No space left on device")
        real_write(state, path, **kwargs)

    monkeypatch.setattr(job_files, "write_atomic", disk_full_for_out)  # the forks inherit it
    assert train.main(["--nproc", "2", "--epochs", "1", "--dataset-size", "64",
                       "--out", str(out), "--snapshot", str(snap)]) == 1
    err = capfd.readouterr().err
    rescued = snap.with_name("rescued-final.pt")
    assert (f"the final model could NOT be written to {out} ({out}: No space left on device); "
            f"it was written to {rescued} instead") in err, err
    make_model().load_state_dict(weights(rescued))


def test_with_check_every_a_rank_that_drifts_stops_the_job_naming_it(tmp_path):
    """--check-every: a weight nudged on rank 1 alone is caught at the next checksum, on every
    rank, naming rank 1 and the parameter; without the flag the same job ends silently."""
    argv = [*JOB, "--out", str(tmp_path / "final.pt"), "--fault", "drift:1:5"]
    with pytest.raises(RankError) as caught:
        run_job([*argv, "--check-every", "4"])
    message = str(caught.value)
    assert "ReplicasDiverged" in message and "rank 1" in message and "0.weight" in message, message
    assert run_job(argv)  # the control: unchecked, the drift goes unnoticed


def test_with_check_every_an_honest_job_ends_as_without_it(tmp_path, reference):
    run_job([*JOB, "--check-every", "1", "--out", str(tmp_path / "final.pt")])
    assert same_weights(weights(tmp_path / "final.pt"), reference)

