"""miniddp's ``fully_shard`` in torch's place (``miniddp.run.fsdp_names``): every name torch
exports it by, a framework's module that imported it before the install, and training through
torch's name, bit for bit as torch's own.

As in ``test_install.py``, the functions run in long-lived ranks that other tests share, so every
install is undone (``with installed()``), and torch's function is reached only through
``fsdp_names.TORCH_FULLY_SHARD``: a global of this module holding it would be pointed at
miniddp's by the install itself. (Whole jobs, ``python -m miniddp.run`` and Lightning:
``tests/operations/test_frameworks.py``.)
"""

import contextlib
import importlib
import sys
import types

import pytest
import torch
import torch.distributed as dist
from test_fsdp import Case, Net, count_differences, device_mesh, make_optimizer, shard_model
from torch import nn

import miniddp
from miniddp.run import fsdp_names

pytestmark = pytest.mark.skipif(fsdp_names.TORCH_FULLY_SHARD is None,
                                reason="this torch has no FSDP2 (fully_shard)")

FRAMEWORK = """
from torch.distributed.fsdp import fully_shard as shard_it


def shard(model):
    return shard_it(model)
"""


def homes() -> dict[str, object]:
    """What each of torch's names for ``fully_shard`` that this torch has holds now."""
    found = {}
    for name in fsdp_names.HOMES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        found[name] = vars(module)["fully_shard"]
    return found


def test_install_points_every_fully_shard_name_at_miniddps_and_uninstall_puts_them_back():
    torchs = fsdp_names.TORCH_FULLY_SHARD
    assert set(homes().values()) == {torchs} and len(homes()) >= 4, homes()
    before = types.ModuleType("fsdp_framework_imported_before")
    exec(FRAMEWORK, vars(before))
    sys.modules[before.__name__] = before
    try:
        with miniddp.installed():
            assert set(homes().values()) == {fsdp_names.in_torchs_place}, homes()
            assert fsdp_names.in_torchs_place.__wrapped__ is miniddp.fully_shard
            assert torch.distributed.fsdp.fully_shard is fsdp_names.in_torchs_place
            assert before.shard_it is fsdp_names.in_torchs_place
        assert set(homes().values()) == {torchs} and before.shard_it is torchs
    finally:
        miniddp.uninstall()
        sys.modules.pop(before.__name__, None)


def train_through_torchs_name(installed: bool) -> dict:
    """Net sharded through ``torch.distributed.fsdp.fully_shard``, looked up when called, with
    or without the install, beside torch's own function: which class, and the differences."""
    models = []
    for through_the_name in (True, False):
        torch.manual_seed(0)
        if through_the_name:
            with miniddp.installed() if installed else contextlib.nullcontext():
                model = shard_model(Net(), torch.distributed.fsdp.fully_shard,
                                    torch.distributed.fsdp.MixedPrecisionPolicy(), Case())
        else:
            model = shard_model(Net(), fsdp_names.TORCH_FULLY_SHARD,
                                torch.distributed.fsdp.MixedPrecisionPolicy(), Case(),
                                mesh=device_mesh("cpu"))
        models.append(model)
    optimizers = [make_optimizer(m, "adam") for m in models]
    problems: list[str] = []
    for step in range(2):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(10 * step
                                                                         + dist.get_rank()))
        for model, optimizer in zip(models, optimizers):
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        count_differences(f"step {step}", list(models[0].named_parameters()),
                          list(models[1].named_parameters()), problems)
    return {"class": type(models[0]).__module__,
            "fsdp_module": isinstance(models[0], torch.distributed.fsdp.FSDPModule),
            "problems": problems}


def test_torchs_name_shards_with_miniddp_when_installed_bit_for_bit_as_torchs(ranks):
    for f in ranks(2).run(train_through_torchs_name, True):
        assert f == {"class": "miniddp.fsdp.api", "fsdp_module": True, "problems": []}, f
    for f in ranks(2).run(train_through_torchs_name, False):  # without it: torch's own
        assert f["class"].startswith("torch.distributed.fsdp"), f


def unit_facts() -> tuple:
    with miniddp.installed():
        model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
        torch.distributed.fsdp.fully_shard(model)
    return isinstance(model, torch.distributed.fsdp.FSDPModule), type(model[0:1]).__name__


def test_a_unit_made_by_the_installed_name_is_torchs_fsdp_module_and_slices_as_torchs(ranks):
    for f in ranks(2).run(unit_facts):
        assert f == (True, "Sequential"), f
