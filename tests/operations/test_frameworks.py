"""Accelerate and Lightning train with miniddp in torch's place, through their own entry points,
bit for bit as with torch's DDP, and every rank really builds miniddp's class.

Each test runs a real job at 2 ranks on CPU and gloo (``tests/support/frameworks/*_job.py``: a tiny
model made in code, no downloads). miniddp is put in torch's place by ``python -m miniddp.run``
or by ``miniddp.install()`` in the script, each rank started the way a user starts it:
Accelerate's ``accelerate launch`` (torchrun underneath: each rank a new Python) under
``python -m miniddp.run``; Lightning's ``ddp`` (which runs the script again for rank 1) under
``python -m miniddp.run``, and ``ddp_spawn`` (spawned workers) with the install under
``if __name__ == "__main__":``, which only the workers' environment carries to them.

The same job with torch's DDP is the baseline, and its class shows that the class check can tell
the two apart. It runs where its ranks cost no new interpreter: Accelerate's on ranks forked
from this process with torchrun's environment (``jobs.run_like_torchrun``), Lightning's with its
``ddp_fork`` strategy; Lightning's strategies all train to the same bits. The Accelerate job with
``miniddp.install()`` on its first line runs on such forked ranks too (what ``install`` does in a
worker, ``python -m miniddp.run`` does in each of accelerate launch's). A process that only
starts the workers (``python -m miniddp.run -m accelerate.commands.launch``, the ``ddp_spawn``
job's, the ``ddp_fork`` baseline's) is forked from this one (``jobs.Job``'s ``fork``), which has
imported torch, miniddp and the framework already, as that process itself would before it
starts them: its workers are new interpreters all the same. Lightning's ``ddp`` job is not: its
first process is rank 0, and under ``python -m miniddp.run`` it imports Lightning after the
install, as a user's does.

FSDP2 the same way: an unmodified script (``mp.spawn``'s ranks) and Lightning's
``ModelParallelStrategy`` with an unmodified ``configure_model`` shard with miniddp's
``fully_shard`` under ``python -m miniddp.run``, bit for bit as with torch's (the baseline, its
class torch's). The frameworks come with ``pip install -e ".[frameworks]"`` (``.ci/run``
installs them).
"""

import sys
from pathlib import Path

import jobs
import pytest
import torch

from miniddp.checks.bits import all_same_bits

JOBS = Path(__file__).resolve().parents[1] / "support" / "frameworks"
TORCHS = "torch.nn.parallel.distributed.DistributedDataParallel"
MINIDDPS = "miniddp.ddp.DistributedDataParallel"
ACCELERATE_LAUNCH = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                     "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                     "--main_process_port", "0"]  # a free port, not 29500: others may hold it


def ranks_wrote(out: Path, output: str = "") -> list[dict]:
    ranks = [out / f"rank{r}.pt" for r in range(2)]
    assert all(f.exists() for f in ranks), f"a rank wrote nothing: {output[-6000:]}"
    return [torch.load(f) for f in ranks]


def run_job(out: Path, *args: str, fork: bool = False) -> list[dict]:
    """``python ARGS`` to the end (``fork``: forked from this process); what each rank wrote
    to ``out``."""
    out.mkdir()
    code, output = jobs.run([sys.executable, *args], out / "job.log", timeout=300, cwd=out,
                            env=jobs.clean_env(PYTHONPATH=str(jobs.REPO)), fork=fork)
    assert code == 0, output[-6000:]
    return ranks_wrote(out, output)


def assert_miniddp_trained_as_torch(ours: list[dict], torchs: list[dict]) -> None:
    for rank, (a, b) in enumerate(zip(ours, torchs)):
        assert b["class"] == TORCHS, f"rank {rank}: the baseline did not run torch's DDP"
        assert not all_same_bits(b["initial"], b["params"]), f"rank {rank}: nothing trained"
        assert a["class"] == MINIDDPS, f"rank {rank} built {a['class']}, not miniddp's"
        assert all_same_bits(a["params"], b["params"]), f"rank {rank}: parameters differ"


# ----- Accelerate -----


def accelerate(out: Path, how: str) -> list[dict]:
    job = [str(JOBS / "accelerate_job.py"), str(out)]
    if how == "miniddp.run":  # the launcher forked: its workers are accelerate launch's own
        return run_job(out, "-m", "miniddp.run", *ACCELERATE_LAUNCH, *job, fork=True)
    out.mkdir()  # torch's, or miniddp.install() first: ranks forked as torchrun's workers
    jobs.run_like_torchrun(Path(job[0]), [*job[1:], *(["--install"] if how == "install" else [])],
                           out, timeout=120)
    return ranks_wrote(out)


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
    return run_job(out, *job, *([f"--{how}"] if how != "torch" else []), fork=True)


@pytest.fixture(scope="module")
def lightning_with_torch(tmp_path_factory):
    pytest.importorskip("lightning", reason='pip install -e ".[frameworks]"')
    return lightning(tmp_path_factory.mktemp("lightning") / "torch", "ddp_fork", "torch")


@pytest.mark.slow
@pytest.mark.parametrize("strategy, how", [("ddp", "miniddp.run"),
                                           ("ddp_spawn", "install-in-main")])
def test_lightning_trains_with_miniddp_as_with_torch(lightning_with_torch, tmp_path, strategy,
                                                     how):
    ours = lightning(tmp_path / f"{strategy}-{how}", strategy, how)
    assert_miniddp_trained_as_torch(ours, lightning_with_torch)


# ----- FSDP2: an unmodified script, and Lightning's ModelParallelStrategy -----

TORCHS_FSDP = "torch.distributed.fsdp._fully_shard._fsdp_init"  # where torch's makes the class
MINIDDPS_FSDP = "miniddp.fsdp.api"


def assert_miniddp_sharded_as_torch(ours: list[dict], torchs: list[dict]) -> None:
    for rank, (a, b) in enumerate(zip(ours, torchs)):
        assert b["class"] == TORCHS_FSDP, f"rank {rank}: the baseline did not run torch's FSDP2"
        assert not all_same_bits(b["initial"], b["params"]), f"rank {rank}: nothing trained"
        assert a["class"] == MINIDDPS_FSDP, f"rank {rank} sharded with {a['class']}"
        assert a["fsdp_module"] and b["fsdp_module"], "not torch's FSDPModule to isinstance"
        assert all_same_bits(a["initial"], b["initial"]), f"rank {rank}: other shards"
        assert all_same_bits(a["params"], b["params"]), f"rank {rank}: parameters differ"


@pytest.mark.slow
def test_an_unmodified_fsdp2_script_shards_with_miniddp_under_run_as_with_torch(tmp_path):
    """Its ranks are ``mp.spawn``'s, new interpreters; the script and its workers import
    ``fully_shard`` from ``torch.distributed.fsdp`` at their top."""
    job = str(JOBS / "fsdp2_job.py")
    torchs = run_job(tmp_path / "torch", job, str(tmp_path / "torch"), fork=True)
    ours = run_job(tmp_path / "ours", "-m", "miniddp.run", job, str(tmp_path / "ours"),
                   fork=True)
    assert_miniddp_sharded_as_torch(ours, torchs)


@pytest.mark.slow
def test_lightnings_model_parallel_strategy_shards_with_miniddp_under_run_as_with_torch(
        tmp_path):
    """Lightning runs the script again for rank 1; ``configure_model`` is FSDP2's as written
    for torch, on the strategy's data-parallel mesh."""
    pytest.importorskip("lightning", reason='pip install -e ".[frameworks]"')
    job = str(JOBS / "lightning_fsdp_job.py")
    torchs = run_job(tmp_path / "torch", job, str(tmp_path / "torch"))
    ours = run_job(tmp_path / "ours", "-m", "miniddp.run", job, str(tmp_path / "ours"))
    assert_miniddp_sharded_as_torch(ours, torchs)
