"""miniddp in torch's place (``miniddp.run``): torch's names, torch's own consumers, frameworks.

Without ``install()``, code that recognises DDP by torch's class does not see miniddp's, some of
it silently: ``torch.distributed.checkpoint``'s state dicts keep the ``module.`` prefixes, and
Accelerate's ``trigger_sync_in_backward`` does nothing. Each test shows the behaviour with the
install beside the behaviour without it (the negative control) and, where it trains, beside
torch's own DDP bit for bit. Accelerate and Lightning come with the ``frameworks`` extra
(skipped when absent; ``tests/operations/test_frameworks.py`` runs whole jobs through them); a
stand-in
written the way Accelerate's code is written runs everywhere.

The functions run in long-lived ranks that other tests share, so every install here is undone
(``with installed()``), and torch's class is reached only through ``run.TORCH_DDP``: a global
of this module holding it would be pointed at miniddp's class by the install itself.
"""

import contextlib
import os
import runpy
import subprocess
import sys
import textwrap
import types
import warnings

import jobs
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_cases import MLP
from torch import nn

import miniddp
from miniddp import run, sync
from miniddp.run import children

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FRAMEWORK = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

WRAPPERS = (DDP, torch.nn.DataParallel)


def is_ddp(model):
    return isinstance(model, DDP)


def unwrap(model):
    while isinstance(model, WRAPPERS):
        model = model.module
    return model
"""


def framework(name: str) -> types.ModuleType:
    """A module written the way frameworks are: torch's class imported under its own name and
    kept in a tuple, both at import time."""
    module = types.ModuleType(name)
    exec(FRAMEWORK, module.__dict__)
    sys.modules[name] = module
    return module


# ----- torch's names -----


def test_install_points_every_name_at_miniddps_class_and_uninstall_puts_them_back():
    try:  # torch's own consumer of the class, imported before (torch 2.2 and later)
        import torch.distributed.checkpoint.state_dict as torch_state_dict
    except ImportError:
        torch_state_dict = None

    torchs = run.TORCH_DDP
    before = framework("framework_imported_before")
    try:
        with miniddp.installed() as cls:
            assert cls is miniddp.DistributedDataParallel and run.is_installed()
            assert torch.nn.parallel.DistributedDataParallel is cls
            assert torch.nn.parallel.distributed.DistributedDataParallel is cls
            assert torch_state_dict is None or torch_state_dict.DDP is cls
            assert before.DDP is cls and before.WRAPPERS == (cls, nn.DataParallel)
            after = framework("framework_imported_during")
            assert after.DDP is cls
            assert run.TORCH_DDP is torchs  # miniddp's own reference is kept
        assert not run.is_installed()
        assert torch.nn.parallel.DistributedDataParallel is torchs
        assert torch.nn.parallel.distributed.DistributedDataParallel is torchs
        assert torch_state_dict is None or torch_state_dict.DDP is torchs
        assert before.DDP is torchs and before.WRAPPERS == (torchs, nn.DataParallel)
        assert after.DDP is miniddp.DistributedDataParallel  # documented: kept what it imported
    finally:
        miniddp.uninstall()
        sys.modules.pop("framework_imported_before", None)
        sys.modules.pop("framework_imported_during", None)


def test_installed_nested_in_install_leaves_the_outer_install_in_place():
    try:
        miniddp.install()
        with miniddp.installed():
            pass
        assert torch.nn.parallel.DistributedDataParallel is miniddp.DistributedDataParallel
    finally:
        miniddp.uninstall()
    assert torch.nn.parallel.DistributedDataParallel is run.TORCH_DDP


def test_torchs_compiler_keeps_torchs_class():
    import torch._dynamo.convert_frame as convert_frame

    with miniddp.installed():
        held = [v for v in vars(convert_frame).values() if v is miniddp.DistributedDataParallel]
    assert held == []


FIRST_IMPORTED_WHILE_INSTALLED = """
import sys
import tempfile

import torch
import torch.distributed as dist

import miniddp
from miniddp.run import torch_names

assert "torch._dynamo" not in sys.modules, "this check needs a process without dynamo yet"
miniddp.install()
if sys.argv[1] == "without_the_hook":  # the negative control
    sys.meta_path.remove(torch_names._KEEPER)
import torch._dynamo.convert_frame
import torch._dynamo.eval_frame

# The dynamo modules that import the class by name (convert_frame in new torch, eval_frame in 2.1)
holders = [m for m in (torch._dynamo.convert_frame, torch._dynamo.eval_frame)
           if hasattr(m, "DistributedDataParallel")]
assert holders, "no dynamo module holds the class: this check tests nothing"
print("torch's class kept:", all(m.DistributedDataParallel is torch_names.TORCH_DDP
                                 for m in holders))
if sys.argv[1] == "compile":
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0,
                            world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    torch.compile(model, backend="eager")(torch.randn(3, 4)).sum().backward()
    print("compiled and trained:", type(model).__module__)
"""


def test_torchs_compiler_first_imported_while_installed_still_gets_torchs_class(tmp_path):
    """torch._dynamo is imported on the first torch.compile, often after the install: an
    import hook gives it torch's class back, or compiling any DDP fails (it asks the class for
    ``_get_active_ddp_module``)."""
    script = tmp_path / "first_import.py"
    script.write_text(FIRST_IMPORTED_WHILE_INSTALLED)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    runs = {how: subprocess.run([sys.executable, str(script), how], env=env, timeout=240,
                                capture_output=True, text=True)
            for how in ("compile", "without_the_hook")}
    done = runs["compile"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "torch's class kept: True" in done.stdout
    assert "compiled and trained: miniddp.ddp" in done.stdout
    assert "torch's class kept: False" in runs["without_the_hook"].stdout, (
        runs["without_the_hook"].stderr[-3000:])


# ----- torch's own consumers -----


def model_state_dict_keys(how: str) -> dict:
    """Keys of ``get_model_state_dict`` for a DDP model: torch's DDP, miniddp's built through
    torch's name while installed, or miniddp's without the install."""
    state_dict = pytest.importorskip("torch.distributed.checkpoint.state_dict")
    torch.manual_seed(0)
    module = MLP()
    with miniddp.installed() if how == "installed" else contextlib.nullcontext():
        if how == "torch":
            ddp = run.TORCH_DDP(module)
        elif how == "installed":
            ddp = torch.nn.parallel.DistributedDataParallel(module)
        else:
            ddp = miniddp.DistributedDataParallel(module)
        keys = list(state_dict.get_model_state_dict(ddp))
        zeros = {k: torch.zeros_like(v) for k, v in module.state_dict().items()}
        try:  # a state dict without the prefixes, as a checkpoint written without DDP
            state_dict.set_model_state_dict(ddp, zeros)
        except RuntimeError:  # without the install: "Missing key(s) ... module.0.weight"
            pass
        loaded = all(p.abs().sum() == 0 for p in module.parameters())
        return {"type": type(ddp).__module__, "keys": keys, "loaded": loaded,
                "plain": list(module.state_dict())}


def test_distributed_checkpoint_state_dicts_drop_the_module_prefix_when_installed(ranks):
    pytest.importorskip("torch.distributed.checkpoint.state_dict")
    group = ranks(2)
    torchs = group.run(model_state_dict_keys, "torch")
    for ours, theirs in zip(group.run(model_state_dict_keys, "installed"), torchs):
        assert ours["type"] == "miniddp.ddp" and theirs["keys"] == theirs["plain"]
        assert ours["keys"] == theirs["keys"] and ours["loaded"] and theirs["loaded"]
    for without in group.run(model_state_dict_keys, "without"):  # what happens without it
        assert without["keys"] == [f"module.{k}" for k in without["plain"]]
        assert not without["loaded"]


def isinstance_answers() -> dict:
    torch.manual_seed(0)
    ddp = miniddp.DistributedDataParallel(MLP())
    before = isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
    with miniddp.installed():
        during = isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
    return {"before": before, "during": during}


def test_isinstance_against_torchs_name_sees_miniddp_only_when_installed(ranks):
    for answers in ranks(2).run(isinstance_answers):
        assert answers == {"before": False, "during": True}


# ----- Accelerate: its gradient-sync trigger and its unwrapping -----


@contextlib.contextmanager
def trigger_sync_in_backward(model):
    """A stand-in for Accelerate's ``Accelerator.trigger_sync_in_backward``, written the way
    it is: torch's class looked up when called, the flags set, the reducer told to expect a
    backward."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        yield
        return
    old = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = old


def the_trigger(source: str):
    if source == "accelerate":
        from accelerate import Accelerator

        return Accelerator.trigger_sync_in_backward
    return trigger_sync_in_backward


def two_forwards_then_triggered_backward(ddp_kind: str, source: str, steps: int = 2) -> dict:
    """Accelerate's documented pattern: two forwards under ``no_sync``, the first backward local,
    the second inside the trigger, synchronized. Returns every gradient and whether the ranks
    agree on them."""
    trigger = the_trigger(source)
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = MLP()
    with miniddp.installed() if ddp_kind == "installed" else contextlib.nullcontext():
        cls = {"torch": run.TORCH_DDP, "without": miniddp.DistributedDataParallel,
               "installed": torch.nn.parallel.DistributedDataParallel}[ddp_kind]
        ddp = cls(module, bucket_cap_mb=0.001)
        grads, agree = [], []
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            a, b, y = (torch.randn(6, 16, generator=g) for _ in range(3))
            y = y[:, :4]
            ddp.zero_grad()
            with ddp.no_sync():
                loss_a = F.mse_loss(ddp(a), y)
                loss_b = F.mse_loss(ddp(b), y)
            loss_a.backward()
            with trigger(ddp):
                loss_b.backward()
            flat = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
            everyone = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, flat)
            agree.append(all(torch.equal(everyone[0], x) for x in everyone))
            grads.append(flat)
    return {"grads": grads, "agree": agree}


@pytest.mark.parametrize("source", ["stand_in", "accelerate"])
def test_accelerates_sync_trigger_synchronizes_miniddp_as_torch_when_installed(ranks, source):
    if source == "accelerate":
        pytest.importorskip("accelerate")
    group = ranks(3)
    torchs = group.run(two_forwards_then_triggered_backward, "torch", source)
    ours = group.run(two_forwards_then_triggered_backward, "installed", source)
    for rank, (a, b) in enumerate(zip(ours, torchs)):
        assert all(b["agree"]) and all(a["agree"]), f"rank {rank}: the trigger did not sync"
        assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"])), f"rank {rank}"
    without = group.run(two_forwards_then_triggered_backward, "without", source)
    assert not any(any(r["agree"]) for r in without), (
        "negative control: without the install the trigger does nothing and ranks differ")


def unwrapped(source: str) -> dict:
    if source == "accelerate":
        from accelerate.utils import extract_model_from_parallel as unwrap
    else:
        unwrap = framework("framework_for_unwrap").unwrap  # imported before the install
    torch.manual_seed(0)
    module = MLP()
    without = unwrap(miniddp.DistributedDataParallel(module)) is module
    with miniddp.installed():
        installed = unwrap(torch.nn.parallel.DistributedDataParallel(module)) is module
    return {"without": without, "installed": installed}


@pytest.mark.parametrize("source", ["stand_in", "accelerate"])
def test_unwrapping_finds_the_module_inside_miniddp_when_installed(ranks, source):
    if source == "accelerate":
        pytest.importorskip("accelerate")
    for answers in ranks(2).run(unwrapped, source):
        assert answers == {"without": False, "installed": True}


# ----- Lightning: its strategies import torch's class at import time -----


def test_lightnings_ddp_strategies_build_miniddp_when_installed():
    fabric_ddp = pytest.importorskip("lightning.fabric.strategies.ddp")
    trainer_ddp = pytest.importorskip("lightning.pytorch.strategies.ddp")

    with miniddp.installed() as cls:
        assert fabric_ddp.DistributedDataParallel is cls
        assert trainer_ddp.DistributedDataParallel is cls
    assert trainer_ddp.DistributedDataParallel is run.TORCH_DDP


# ----- a job that builds torch's class on some ranks and miniddp's on others -----


def build_one_class_each(classes: list[str]) -> dict:
    """Rank r builds ``classes[r]``'s DDP around the same model: what it raised, if anything."""
    cls = {"torch": run.TORCH_DDP, "miniddp": miniddp.DistributedDataParallel}
    torch.manual_seed(0)
    try:
        cls[classes[dist.get_rank()]](MLP())
    except Exception as e:  # noqa: BLE001  (the verdict is the test's)
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None, "message": ""}


@pytest.mark.parametrize("classes", [["miniddp", "torch"], ["torch", "miniddp"]])
def test_a_job_mixing_torchs_ddp_and_miniddps_stops_at_construction_naming_the_mix(ranks,
                                                                                    classes):
    group = ranks(2)
    results = group.run(build_one_class_each, classes)
    torchs = classes.index("torch")
    ours, theirs = results[classes.index("miniddp")], results[torchs]
    assert ours["raised"] == "MixedDDPClasses", ours
    assert f"rank(s) [{torchs}] of this job built torch's DistributedDataParallel" in (
        ours["message"])
    assert "python -m miniddp.run" in ours["message"]
    # the likely cause under miniddp.run, and its two fixes
    assert "started with an environment of its own" in ours["message"]
    assert "call miniddp.install() in the child's code" in ours["message"]
    assert "pass os.environ on (env={**os.environ, ...})" in ours["message"]
    # torch's rank stops at once, on its own parameter-count check, on miniddp's number
    assert theirs["raised"] == "RuntimeError", theirs
    assert "DDP expects same model across all ranks" in theirs["message"]
    assert f"inconsistent {sync.MINIDDP_SAYS} params" in theirs["message"]
    for same in (["miniddp", "miniddp"], ["torch", "torch"]):  # no mix, no error
        assert group.run(build_one_class_each, same) == [{"raised": None, "message": ""}] * 2


# ----- python -m miniddp.run script.py -----

SCRIPT = """
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import miniddp

# one write per line: two workers share the pipe, and print writes each piece on its own
sys.stdout.write(f"name {__name__} argv {sys.argv[1:]} miniddp "
                 f"{DDP is miniddp.DistributedDataParallel}\\n")
if "--train" in sys.argv:
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())  # different on each rank: DDP broadcasts rank 0's
    model = DDP(torch.nn.Linear(4, 2))
    model(torch.randn(3, 4) + dist.get_rank()).sum().backward()
    grad = model.module.weight.grad
    everyone = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, grad)
    sys.stdout.write(f"rank {dist.get_rank()} {type(model).__module__} agree "
                     f"{all(torch.equal(everyone[0], g) for g in everyone)}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
"""


def run_python(args, tmp_path, timeout=120):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    command = [sys.executable, *[str(script) if a == "SCRIPT" else a for a in args]]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_in_this_process(args, tmp_path, monkeypatch, capsys) -> tuple[int, str, str]:
    """``python ARGS`` with ``tmp_path`` as current directory, in this process: what it exits
    with, writes to stdout and to stderr. For ``-m miniddp.run ...`` and ``SCRIPT``: their
    imports are this process's already, and ``main`` undoes its install."""
    from miniddp.run.__main__ import main

    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])  # as python puts the cwd
    capsys.readouterr()
    code = 0
    try:
        if args[:2] == ["-m", "miniddp.run"]:
            main(args[2:])
        else:
            sys.argv = ["train.py", *args[1:]]
            runpy.run_path("train.py", run_name="__main__")
    except SystemExit as exit:  # as Python reports it: a code, or a message and 1
        code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
        if not isinstance(exit.code, (int, type(None))):
            print(exit.code, file=sys.stderr)
    out, err = capsys.readouterr()
    return code, out, err


def test_run_installs_before_the_script_which_runs_as_main_with_its_arguments(
        tmp_path, monkeypatch, capsys):
    """A new ``python -m miniddp.run`` once; the module form and the plain script (torch's
    class: the negative control) run in this process."""
    done = run_python(["-m", "miniddp.run", "SCRIPT", "--lr", "3"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "name __main__ argv ['--lr', '3'] miniddp True" in done.stdout
    code, out, err = run_in_this_process(["SCRIPT"], tmp_path, monkeypatch, capsys)
    assert code == 0 and "miniddp False" in out, err[-2000:]  # without it: torch's class
    code, out, err = run_in_this_process(["-m", "miniddp.run", "-m", "train", "--lr", "3"],
                                         tmp_path, monkeypatch, capsys)
    assert code == 0 and "name __main__ argv ['--lr', '3'] miniddp True" in out, err[-2000:]
    assert torch.nn.parallel.DistributedDataParallel is run.TORCH_DDP  # undone at the end


def test_run_without_a_script_says_how_to_use_it(tmp_path, monkeypatch, capsys):
    """``main`` is ``python -m miniddp.run``'s whole body (the test above runs one)."""
    code, out, _ = run_in_this_process(["-m", "miniddp.run"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "usage: python -m miniddp.run script.py" in out
    code, _, err = run_in_this_process(["-m", "miniddp.run", "nowhere.py"], tmp_path,
                                       monkeypatch, capsys)
    assert code != 0 and "no such script: nowhere.py" in err


WHERE = """
import os, sys
here = os.path.dirname(__file__)
os.chdir(os.sep)
os.environ["MINIDDP_TEST_WHERE"] = f"{__file__} {os.path.exists(os.path.join(here, 'where.py'))}"
print(os.environ["MINIDDP_TEST_WHERE"])
"""


@pytest.mark.parametrize("how", ["script", "module"])
def test_the_script_gets_the_file_name_plain_python_gives_it(tmp_path, monkeypatch, how):
    """``__file__`` is absolute, as ``python where.py`` / ``python -m where`` make it, so that
    ``os.path.dirname(__file__)`` names the script's directory after a ``chdir``."""
    from miniddp.run.__main__ import main

    (tmp_path / "where.py").write_text(WHERE)
    args = ["where.py"] if how == "script" else ["-m", "where"]
    plain = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60, env=jobs.clean_env())
    assert plain.returncode == 0, plain.stderr[-2000:]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])  # as python -m puts the cwd
    monkeypatch.delenv("MINIDDP_TEST_WHERE", raising=False)
    main(args)
    ours = os.environ.pop("MINIDDP_TEST_WHERE")
    assert ours == plain.stdout.strip() and ours.endswith("where.py True"), (ours, plain.stdout)
    assert os.path.isabs(ours.split()[0])


@pytest.mark.slow
def test_torchrun_runs_each_worker_through_miniddp_run(tmp_path):
    """torchrun's agent is forked from this process (``jobs.Job``'s ``fork``); each worker is
    a new ``python -m miniddp.run train.py``."""
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    code, output = jobs.run([*jobs.torchrun("--standalone", "--nproc_per_node=2"), "-m",
                             "miniddp.run", "train.py", "--train"], tmp_path / "torchrun.log",
                            timeout=240, cwd=tmp_path, env=jobs.clean_env(PYTHONPATH=REPO),
                            fork=True)
    assert code == 0, output[-4000:]
    for rank in range(2):
        assert f"rank {rank} miniddp.ddp agree True" in output, output[-4000:]


# ----- the processes a script starts -----


PEEK = """
import os
from miniddp.run import children, is_installed
os.environ["MINIDDP_TEST_PEEK"] = f"{is_installed()} {children.reaches()}"
"""


def test_run_undoes_the_install_and_its_marks_when_the_script_ends(tmp_path, monkeypatch):
    from miniddp.run.__main__ import main

    script = tmp_path / "peek.py"
    script.write_text(PEEK)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("MINIDDP_TEST_PEEK", raising=False)
    before = dict(os.environ)
    main([str(script)])
    assert os.environ.pop("MINIDDP_TEST_PEEK") == "True True"  # while the script ran
    assert dict(os.environ) == before and not run.is_installed()
    assert torch.nn.parallel.DistributedDataParallel is run.TORCH_DDP


def test_install_marks_the_environment_for_children_and_uninstall_leaves_nothing(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/a", "/b"]))
    before = dict(os.environ)
    with miniddp.installed():
        assert os.environ[children.MARKER] == children.ROOT and children.reaches()
        assert os.environ["PYTHONPATH"] == os.pathsep.join([children.STARTUP, "/a", "/b"])
    assert dict(os.environ) == before and not children.reaches()
    monkeypatch.delenv("PYTHONPATH")
    with miniddp.installed():
        assert os.environ["PYTHONPATH"] == children.STARTUP
    assert "PYTHONPATH" not in os.environ and children.MARKER not in os.environ


FLAGS = types.SimpleNamespace(ignore_environment=1, isolated=0, no_site=0)


@pytest.mark.parametrize("why", ["-E", "forkserver"])
def test_install_warns_where_it_can_tell_that_workers_will_not_see_it(monkeypatch, why):
    if children.unreachable() is None:  # the negative control: nothing to warn about
        with warnings.catch_warnings():
            warnings.simplefilter("error", run.WorkersMissTheInstall)
            with miniddp.installed():
                pass
    if why == "-E":
        monkeypatch.setattr(children, "sys", types.SimpleNamespace(flags=FLAGS,
                                                                   modules=sys.modules))
    else:
        server = types.SimpleNamespace(_forkserver=types.SimpleNamespace(_forkserver_pid=1))
        monkeypatch.setitem(sys.modules, "multiprocessing.forkserver", server)
    with pytest.warns(run.WorkersMissTheInstall, match=why):
        with miniddp.installed():
            pass


SHOW_MARKS = ("import os; print(os.environ.get('MINIDDP_IN_TORCHS_PLACE'), "
              "os.environ.get('PYTHONPATH'))")


def marks_a_child_sees(env) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SHOW_MARKS], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_a_child_given_an_environment_of_its_own_is_reached():
    """``Popen(..., env={...})`` inherits nothing: the install adds its two entries to the
    dict as the child starts (an audit hook); an environment already pointing elsewhere keeps
    its entries after miniddp's."""
    own = {"PATH": os.environ.get("PATH", "")}
    assert marks_a_child_sees(dict(own)) == ["None", "None"]  # the environment alone
    with miniddp.installed():
        assert marks_a_child_sees(dict(own)) == [children.ROOT, children.STARTUP]
        elsewhere = {**own, "PYTHONPATH": "/elsewhere"}
        assert marks_a_child_sees(elsewhere) == [
            children.ROOT, os.pathsep.join([children.STARTUP, "/elsewhere"])]
    assert marks_a_child_sees(dict(own)) == ["None", "None"]  # uninstalled: left alone


def test_an_environment_miniddp_cannot_change_warns_once(monkeypatch):
    monkeypatch.setattr(children, "_warned", False)
    frozen = types.MappingProxyType({"PATH": os.environ.get("PATH", "")})
    with miniddp.installed(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = [marks_a_child_sees(frozen) for _ in range(2)]
    assert seen == [["None", "None"]] * 2
    said = [str(w.message) for w in caught if w.category is run.WorkersMissTheInstall]
    assert len(said) == 1 and "environment of its own (a mappingproxy" in said[0], said
    assert "pass os.environ on" in said[0].lower() and "miniddp.install() in the child" in said[0]


HIDDEN_SITECUSTOMIZE = "import os\nos.environ['HIDDEN_SITECUSTOMIZE_RAN'] = '1'\n"

CHILD = """
import os, sys
print("before torch:", "torch" in sys.modules, "miniddp" in sys.modules,
      os.environ.get("HIDDEN_SITECUSTOMIZE_RAN"), any(p.endswith("startup") for p in sys.path))
import torch
print("after torch:", torch.nn.parallel.DistributedDataParallel.__module__)
"""


@pytest.mark.slow
def test_a_child_python_installs_once_it_imports_torch_and_runs_the_sitecustomize_it_hides(
        tmp_path):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text(HIDDEN_SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hidden), REPO])}
    with miniddp.installed():
        reached = {**os.environ, "PYTHONPATH": os.pathsep.join([children.STARTUP, str(hidden),
                                                                 REPO])}
    outputs = {}
    for name, child_env in (("reached", reached), ("plain", env)):
        done = subprocess.run([sys.executable, "-c", CHILD], env=child_env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs[name] = done.stdout
    assert "before torch: False False 1 False" in outputs["reached"]
    assert "after torch: miniddp.ddp" in outputs["reached"]
    assert "before torch: False False 1 False" in outputs["plain"]
    assert "after torch: torch.nn.parallel.distributed" in outputs["plain"]


WORKERS = """
import os
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank, world_size, init):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 2))
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
        model(x).sum().backward()
        result = f"{type(model).__module__} grad {model.module.weight.grad.numpy().tobytes().hex()}"
    except Exception as e:
        result = f"{type(e).__name__}: {e}"
    sys.stdout.write(f"rank {rank}: {result}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    how, init = sys.argv[1:]
    if how == "spawn":  # the seeds' multigpu.py, Lightning's ddp_spawn
        mp.spawn(train, args=(2, init), nprocs=2)
    elif how in ("run_again", "own_env"):  # Lightning's ddp: the other rank runs this again
        env = None if how == "run_again" else {  # own_env: an environment made by hand
            k: os.environ[k] for k in ("PATH", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")
            if k in os.environ}
        other = subprocess.Popen([sys.executable, os.path.abspath(sys.argv[0]), "rank1", init],
                                 env=env)
        train(0, 2, init)
        other.wait()
    else:
        train(1, 2, init)
"""

#: ``python -m miniddp.run`` with its children left unreached: the negative control.
UNREACHED = ("import sys; from miniddp.run import children; children.reach = lambda: None; "
             "from miniddp.run.__main__ import main; main(sys.argv[1:])")
#: ``python -m miniddp.run`` reaching children that inherit its environment, but not the ones
#: given an environment of their own: no audit hook, and none inherited either (a process forked
#: from one that watched already has the hook, which calls ``started_with_env``).
UNWATCHED = UNREACHED.replace("children.reach = lambda: None",
                              "children.watch = children.started_with_env = lambda *args: None")


def start_workers(tmp_path, how: str, reach: bool, unreached: str = UNREACHED,
                  fork: bool = True) -> str:
    """``python -m miniddp.run workers.py HOW`` (or the ``unreached`` runner) to the end.

    ``fork``: that first process is forked from this one (``jobs.Job``'s ``fork``: it would
    import torch and miniddp before the install all the same), which is not installed; the
    workers it starts are new interpreters. Not where the audit hook is what reaches a worker:
    a forked process inherits the hook of any earlier install here, and would reach it whether
    or not its own install watched.
    """
    assert not run.is_installed(), "a test left miniddp installed in this process"
    script = tmp_path / "workers.py"
    script.write_text(WORKERS)
    init = f"file://{tmp_path / f'{how}-{reach}.store'}"
    runner = ["-m", "miniddp.run"] if reach else ["-c", unreached]
    code, output = jobs.run([sys.executable, *runner, str(script), how, init],
                            tmp_path / f"{how}-{reach}.log", timeout=240, cwd=tmp_path,
                            env=jobs.clean_env(PYTHONPATH=REPO), fork=fork)
    assert code == 0, output[-4000:]
    return output


def reported(output: str, rank: int) -> tuple[str, str]:
    """What a worker said: (its DDP class's module, its gradient's bits in hex)."""
    lines = [line for line in output.splitlines() if line.startswith(f"rank {rank}: ")]
    assert len(lines) == 1, f"rank {rank} did not report once:\n{output[-4000:]}"
    module, _, grad = lines[0].removeprefix(f"rank {rank}: ").partition(" grad ")
    return module, grad


@pytest.mark.slow
def test_run_reaches_the_workers_mp_spawn_starts(tmp_path):
    """Every spawned rank builds miniddp's class and gets torch's gradient bits; unreached (the
    negative control), they build torch's."""
    ours = start_workers(tmp_path, "spawn", reach=True)
    torchs = start_workers(tmp_path, "spawn", reach=False)
    for rank in range(2):
        (our_class, our_grad), (their_class, their_grad) = (reported(ours, rank),
                                                            reported(torchs, rank))
        assert (our_class, their_class) == ("miniddp.ddp", "torch.nn.parallel.distributed")
        assert our_grad == their_grad and len(our_grad) == 2 * 4 * 4 * 2, rank


@pytest.mark.slow
def test_run_reaches_a_script_run_again_for_the_other_rank(tmp_path):
    output = start_workers(tmp_path, "run_again", reach=True)
    assert [reported(output, rank)[0] for rank in range(2)] == ["miniddp.ddp"] * 2
    unreached = start_workers(tmp_path, "run_again", reach=False)  # rank 1 builds torch's
    assert "rank 0: MixedDDPClasses: rank(s) [1] of this job built torch's" in unreached, (
        unreached[-4000:])
    assert "rank 1: RuntimeError: DDP expects same model" in unreached, unreached[-4000:]


@pytest.mark.slow
def test_run_reaches_a_rank_started_with_an_environment_of_its_own(tmp_path):
    """``Popen(..., env={...})`` without miniddp's entries: reached all the same; unwatched (the
    negative control), that rank builds torch's and the message names the likely cause."""
    output = start_workers(tmp_path, "own_env", reach=True, fork=False)  # the hook's own doing
    assert [reported(output, rank)[0] for rank in range(2)] == ["miniddp.ddp"] * 2
    unwatched = start_workers(tmp_path, "own_env", reach=False, unreached=UNWATCHED)
    assert "rank 0: MixedDDPClasses: rank(s) [1] of this job built torch's" in unwatched, (
        unwatched[-4000:])
    assert "started with an environment of its own" in unwatched, unwatched[-4000:]
