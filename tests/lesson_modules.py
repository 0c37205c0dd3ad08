"""Import a numbered lesson as a module, so tests can call the mechanisms it writes out.

Lesson files start with a digit and are not a package, so they are loaded by path and kept in
``sys.modules`` under ``lesson_NN``: forked ranks (which inherit ``sys.modules``) can then
unpickle the lesson's functions by reference.
"""

import importlib.util
import sys
from pathlib import Path

LESSONS_DIR = Path(__file__).resolve().parents[1] / "lessons"


def load_lesson(number: str):
    """The module of ``lessons/<number>_*.py``, loaded once."""
    name = f"lesson_{number}"
    if name not in sys.modules:
        path = next(LESSONS_DIR.glob(f"{number}_*.py"))
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
