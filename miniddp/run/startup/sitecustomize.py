"""Run at start-up by every Python whose ``PYTHONPATH`` holds this directory
(``miniddp.run.children`` puts it there): installs miniddp in torch's place as soon as torch is
imported, if the environment still asks for it.

It imports nothing but the standard library, so a child that never imports torch pays nothing.
It takes its directory off ``sys.path`` and runs the ``sitecustomize`` that it hides (a
distribution's or a virtual environment's), so that the child starts as it would without it.
"""

import importlib
import os
import sys

MARKER = "MINIDDP_IN_TORCHS_PLACE"  # miniddp.run.children.MARKER
HERE = os.path.dirname(os.path.abspath(__file__))


def install_miniddp() -> None:
    root = os.environ.get(MARKER)
    if not root:  # unset since start-up (miniddp.uninstall() in this process)
        return
    if root not in sys.path:  # the miniddp the parent imported, if none other is importable
        sys.path.append(root)
    from miniddp.run.torch_names import install

    install()


class InstallOnceImported:
    """Finds nothing itself: wraps the loader that the other finders return for ``torch`` and
    for ``miniddp`` so that miniddp is installed once both are imported (miniddp imports torch
    first thing: when torch is done inside miniddp's import, miniddp's end installs)."""

    def find_spec(self, name, path, target=None):
        if name not in ("torch", "miniddp"):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = ThenInstall(spec.loader)
        return spec


class ThenInstall:
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader  # torch sees its own loader
        self.loader.exec_module(module)
        if module.__name__ == "torch" and "miniddp" in sys.modules:
            return  # inside miniddp's import: installed when it ends
        if FINDER in sys.meta_path:
            sys.meta_path.remove(FINDER)
        install_miniddp()

    def __getattr__(self, name):
        return getattr(self.loader, name)


def run_the_hidden_sitecustomize() -> None:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    mine = sys.modules.pop("sitecustomize", None)
    try:
        importlib.import_module("sitecustomize")
    except ImportError as e:
        if e.name != "sitecustomize":
            raise
        sys.modules["sitecustomize"] = mine


FINDER = InstallOnceImported()
if __name__ == "sitecustomize":  # at start-up, not imported as miniddp.run.startup.sitecustomize
    if os.environ.get(MARKER):
        if "torch" in sys.modules:  # imported by a .pth file, before this
            install_miniddp()
        else:
            sys.meta_path.insert(0, FINDER)
    run_the_hidden_sitecustomize()
