"""Import a numbered lesson as a module, so tests can call the mechanisms it writes out.

Lesson files start with a digit and are not a package, so they are loaded by path and kept in
``sys.modules`` under ``lesson_NN``: forked ranks (which inherit ``sys.modules``) can then
unpickle the lesson's functions by reference.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

from miniddp.torch_versions import TORCH_HAS_IS_COMPILING

LESSONS_DIR = Path(__file__).resolve().parents[2] / "lessons"



def _has_fsdp2() -> bool:
    """torch's fully_shard: public from 2.6, under ``_composable`` before."""
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        try:
            if hasattr(importlib.import_module(name), "fully_shard"):
                return True
        except ImportError:
            pass
    return False


#: Lessons the installed torch cannot run, and why: each prints ``SKIPPED: why`` and exits 0.
CANNOT_RUN_HERE = {} if TORCH_HAS_IS_COMPILING else {
    "16_compile": "lesson 16 needs torch >= 2.3 (torch.compiler.is_compiling)"}
if not _has_fsdp2():
    CANNOT_RUN_HERE.update(dict.fromkeys(("17_fsdp", "17_fsdp_options", "17_fsdp_checkpoints",
                                          "18_hsdp"),
                                         "lessons 17 and 18 need torch's FSDP2 (fully_shard)"))


def runnable_here(stem: str):
    """Skip a test of lesson ``stem`` (``16_compile``) where the installed torch cannot run it."""
    return pytest.mark.skipif(stem in CANNOT_RUN_HERE, reason=CANNOT_RUN_HERE.get(stem, ""))


def load_lesson(number: str):
    """The module of ``lessons/<number>_*.py`` (the first in sorted order: a lesson in two
    parts is ``15`` for part 1), or of ``lessons/<number>.py`` when given a whole stem; loaded
    once. The repository goes on ``sys.path``: lessons import ``course.tools``."""
    if str(LESSONS_DIR.parent) not in sys.path:
        sys.path.append(str(LESSONS_DIR.parent))
    whole_stem = "_" in number
    name = f"lesson_{number}"  # as course/tools.py names a whole stem
    if name not in sys.modules:
        path = (LESSONS_DIR / f"{number}.py" if whole_stem
                else sorted(LESSONS_DIR.glob(f"{number}_*.py"))[0])
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
