"""What lessons print and prove: checks fail loudly, losses average over ranks, figures save."""

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from course import report
from course.report import CheckFailed, Progress, check, mean_over_ranks, save_figure


def test_check_passes_silently_and_fails_with_the_message():
    check(1 + 1 == 2, "never shown")
    with pytest.raises(CheckFailed, match="loss 0.5 is not below 0.1"):
        check(0.5 < 0.1, "loss 0.5 is not below 0.1")


def test_a_failed_check_exits_non_zero_with_the_message_and_no_ok_line():
    script = ("from course.report import check, ok\n"
              "check(False, 'the weights differ on rank 1')\n"
              "ok('never printed')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    assert "OK" not in done.stdout
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.endswith("CheckFailed: the weights differ on rank 1")


def test_ok_and_print0_print_only_on_rank_zero(capsys, monkeypatch):
    report.ok("fine")
    monkeypatch.setenv("RANK", "1")  # what torchrun tells rank 1, once its group is gone
    report.ok("printed by rank 1")
    assert capsys.readouterr().out == "OK: fine\n"


def rank_mean(values):
    return mean_over_ranks(torch.tensor(values[dist.get_rank()]))


def rank_progress(per_rank_losses):
    progress = Progress(len(per_rank_losses[0]), every=2)
    for loss in per_rank_losses[dist.get_rank()]:
        progress(torch.tensor(loss))
    return progress.losses()


@pytest.mark.parametrize("world_size", [2, 3])
def test_mean_over_ranks_is_the_mean_of_every_ranks_value(ranks, world_size):
    values = [0.25 * (r + 1) ** 2 for r in range(world_size)]
    means = ranks(world_size).run(rank_mean, values)
    assert means == [pytest.approx(sum(values) / world_size, rel=1e-12)] * world_size


def test_progress_history_is_each_steps_loss_averaged_over_ranks(ranks):
    per_rank = [[1.0, 0.5, 0.25, 0.125, 0.0625], [3.0, 1.5, 0.75, 0.375, 0.1875]]
    histories = ranks(2).run(rank_progress, per_rank)
    expected = [(a + b) / 2 for a, b in zip(*per_rank)]
    assert histories == [pytest.approx(expected)] * 2


def test_progress_without_a_group_prints_steps_and_keeps_every_loss(capsys):
    progress = Progress(4, every=2)
    for loss in (4.0, 3.0, 2.0, 1.0):
        progress(torch.tensor(loss))
    assert progress.losses() == [4.0, 3.0, 2.0, 1.0]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("|")[0].strip() for line in lines] == ["step 0/4", "step 2/4", "step 3/4"]
    assert "loss 2.00000" in lines[1] and lines[1].endswith("ms/step")


def test_save_figure_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = save_figure("curve", lambda ax: ax.plot([3, 2, 1]), out_dir=tmp_path / "runs")
    assert path == tmp_path / "runs" / "curve.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_losses_goes_to_the_runs_dir_from_the_environment(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("MINIDDP_RUNS", str(tmp_path))
    path = report.plot_losses("losses", {"a": [1.0, 0.1], "b": [2.0, 0.2]})
    assert path == tmp_path / "losses.png" and path.stat().st_size > 0


def test_save_figure_without_matplotlib_skips_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert save_figure("curve", lambda ax: None, out_dir=tmp_path) is None
    assert "matplotlib is not installed: skipped" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())
