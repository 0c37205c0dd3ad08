"""Accelerate and Lightning train with miniddp in torch's place, through their own entry points,
bit for bit as with torch's DDP, and every rank really builds miniddp's class.

Each test runs a real job at 2 ranks on CPU and gloo (``tests/frameworks/*_job.py``: a tiny
model made in code, no downloads), the way a user starts it: Accelerate's ``accelerate launch``
(torchrun underneath: each rank a new Python), Lightning's ``ddp`` (which runs the script again
for rank 1) and ``ddp_spawn`` (spawned workers). miniddp is put in torch's place by
``python -m miniddp.run`` or by ``miniddp.install()`` in the script; the same job run with plain
``python`` is torch's baseline, and its class shows that the class check can tell the two
apart. Lightning's two strategies train to the same bits (the ``ddp`` baseline serves both).

The frameworks come with ``pip install -e ".[frameworks]"`` (``.ci/run`` installs them).
"""

import sys
from pathlib import Path

import jobs
import pytest
import torch
from bits import all_same_bits

JOBS = Path(__file__).resolve().parent / "frameworks"
TORCHS = "torch.nn.parallel.distributed.DistributedDataParallel"
MINIDDPS = "miniddp.ddp.DistributedDataParallel"
ACCELERATE_LAUNCH = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                     "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def run_job(out: Path, *args: str) -> list[dict]:
    """``python ARGS`` to the end; what each rank wrote to ``out``."""
    out.mkdir()
    code, output = jobs.run([sys.executable, *args], out / "job.log", timeout=300, cwd=out,
                            env=jobs.clean_env(PYTHONPATH=str(jobs.REPO)))
    assert code == 0, output[-6000:]
    ranks = [out / f"rank{r}.pt" for r in range(2)]
    assert all(f.exists() for f in ranks), f"a rank wrote nothing: {output[-6000:]}"
    return [torch.load(f) for f in ranks]


def assert_miniddp_trained_as_torch(ours: list[dict], torchs: list[dict]) -> None:
    for rank, (a, b) in enumerate(zip(ours, torchs)):
        assert b["class"] == TORCHS, f"rank {rank}: the baseline did not run torch's DDP"
        assert not all_same_bits(b["initial"], b["params"]), f"rank {rank}: nothing trained"
        assert a["class"] == MINIDDPS, f"rank {rank} built {a['class']}, not miniddp's"
        assert all_same_bits(a["params"], b["params"]), f"rank {rank}: parameters differ"


# ----- Accelerate -----


def accelerate(out: Path, how: str) -> list[dict]:
    job = [*ACCELERATE_LAUNCH, str(JOBS / "accelerate_job.py"), str(out)]
    if how == "miniddp.run":
        return run_job(out, "-m", "miniddp.run", *job)
    return run_job(out, *job, *(["--install"] if how == "install" else []))


@pytest.fixture(scope="module")
def accelerate_with_torch(tmp_path_factory):
    pytest.importorskip("accelerate", reason='pip install -e ".[frameworks]"')
    return accelerate(tmp_path_factory.mktemp("accelerate") / "torch", "torch")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["miniddp.run", "install"])
def test_accelerate_launch_trains_with_miniddp_as_with_torch(accelerate_with_torch, tmp_path,
                                                              how):
    assert_miniddp_trained_as_torch(accelerate(tmp_path / how, how), accelerate_with_torch)


# ----- Lightning -----


def lightning(out: Path, strategy: str, how: str) -> list[dict]:
    job = [str(JOBS / "lightning_job.py"), strategy, str(out)]
    if how == "miniddp.run":
        return run_job(out, "-m", "miniddp.run", *job)
    return run_job(out, *job, *([f"--{how}"] if how != "torch" else []))


@pytest.fixture(scope="module")
def lightning_with_torch(tmp_path_factory):
    pytest.importorskip("lightning", reason='pip install -e ".[frameworks]"')
    return lightning(tmp_path_factory.mktemp("lightning") / "torch", "ddp", "torch")


@pytest.mark.slow
@pytest.mark.parametrize("strategy, how", [("ddp", "miniddp.run"), ("ddp_spawn", "miniddp.run"),
                                           ("ddp_spawn", "install-in-main")])
def test_lightning_trains_with_miniddp_as_with_torch(lightning_with_torch, tmp_path, strategy,
                                                     how):
    ours = lightning(tmp_path / f"{strategy}-{how}", strategy, how)
    assert_miniddp_trained_as_torch(ours, lightning_with_torch)
