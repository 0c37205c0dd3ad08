"""Putting miniddp's DDP where code looks for torch's, so that other people's code uses it
(and its ``fully_shard`` where FSDP2 code looks for torch's: ``miniddp.run.fsdp_names``).

Swapping the import in your own script is enough for your script. Frameworks and torch's own
helpers do not import miniddp: they recognise a DDP model by torch's class, and without help they
do not recognise miniddp's, some of them silently. Accelerate's ``trigger_sync_in_backward`` does
nothing (the ranks keep different gradients), ``unwrap_model`` returns the wrapper, and
``torch.distributed.checkpoint``'s ``get_model_state_dict`` keeps the ``module.`` prefixes.

:func:`install` makes torch's names mean miniddp's class:

* ``torch.nn.parallel.DistributedDataParallel`` and
  ``torch.nn.parallel.distributed.DistributedDataParallel``: code that looks the class up when
  it runs (``isinstance(m, torch.nn.parallel.DistributedDataParallel)``, Accelerate's checks and
  its ``prepare``), and every module imported afterwards (``from torch.nn.parallel import
  DistributedDataParallel as DDP``), see and build miniddp's;
* every module already imported that holds torch's class under a global name, whatever the name
  (``torch.distributed.checkpoint.state_dict``'s ``DDP``, Lightning's strategies, your own
  ``__main__``), or in a global tuple of classes: the name is pointed at miniddp's class.

It also reaches the Python processes started after it (``miniddp.run.children``): spawn and
forkserver workers, a script that a launcher runs again for the other ranks, torchrun's workers
and any Python run by ``subprocess`` install miniddp as soon as they import torch, also one
given an environment of its own (``Popen(..., env={...})``: the dict gets miniddp's two
entries). So call it anywhere before the workers start, under ``if __name__ == "__main__":``
too; it warns where it can tell that some will not see it (a Python run with ``-E``, ``-I`` or
``-S``, a forkserver already running, an environment it cannot add its entries to). Processes
started before it (a worker pool, a forkserver) run torch's class.

What it cannot reach: torch's class kept anywhere else before the install (a local variable, a
closure, a default argument, a class attribute, a list or dict), and ``type(m) is`` checks
against such a copy. Call it first, or run the script with ``python -m miniddp.run``, which
installs before the script's first line, and there is nothing before it to miss.

Left alone on purpose: miniddp's own modules (they keep torch's class to compare with it and to
talk to torch's compiler), ``torch._dynamo`` (which asks torch's class which DDP module's
forward is running, through its class attribute ``_active_ddp_module``) and
``torch.distributed._composable`` (``replicate()`` builds torch's DDP around its own machinery).
Those two keep torch's class even when first imported while installed (an import hook gives it
back to them). A torch DDP built before the install, or from a reference kept, still works in
eager mode; do not mix the two in one model.

:func:`uninstall` puts back every name :func:`install` changed and takes its marks out of the
environment; :func:`installed` is the context manager for both. Modules imported while
installed keep the class they imported.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings
from contextlib import contextmanager

import torch.nn.parallel
import torch.nn.parallel.distributed

from miniddp.ddp import DistributedDataParallel
from miniddp.run import children, fsdp_names

#: torch's class, as it was when miniddp was imported (before any install).
TORCH_DDP = torch.nn.parallel.distributed.DistributedDataParallel

#: Where torch defines and exports the class: always replaced.
TORCH_NAMES = (torch.nn.parallel, torch.nn.parallel.distributed)

#: torch's modules (and their submodules) that use torch's class for torch's own machinery:
#: they keep it, and get it back if first imported while installed.
TORCHS_OWN = ("torch._dynamo", "torch.distributed._composable")

#: Modules whose reference to torch's class is theirs to keep: those, and miniddp's own (which
#: are all imported with miniddp, before any install).
KEPT = ("miniddp", *TORCHS_OWN)

_lock = threading.Lock()
_changes: list[tuple[dict, str, object]] | None = None  # (namespace, name, old value)


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _changes is not None


WorkersMissTheInstall = children.WorkersMissTheInstall


def install() -> None:
    """Make torch's DDP names mean miniddp's class, and its ``fully_shard`` names miniddp's
    (``fsdp_names``), here and in the Python processes started from now on (see the module
    docstring). Calling it again while installed does nothing."""
    global _changes
    with _lock:
        if _changes is not None:
            return
        children.reach()
        children.watch()
        why = children.unreachable()
        if why is not None:
            warnings.warn(f"miniddp.install(): {why}. Their ranks will build torch's "
                          "DistributedDataParallel; construction stops there if they meet "
                          "miniddp's ranks. Build miniddp.DistributedDataParallel explicitly "
                          "in the code the workers run instead.", WorkersMissTheInstall,
                          stacklevel=2)
        changes = [(vars(module), "DistributedDataParallel") for module in TORCH_NAMES]
        changes += [(namespace, name) for namespace, name, _ in _holders(TORCH_DDP)
                    if not any(n is namespace and k == name for n, k in changes)]
        changes = [(namespace, name, old := namespace.get(name),
                    _replaced(old) if isinstance(old, tuple) else DistributedDataParallel)
                   for namespace, name in changes]
        changes += fsdp_names.changes(_holders)  # FSDP2's fully_shard, the same way
        for namespace, name, _, new in changes:
            namespace[name] = new
        sys.meta_path.insert(0, _KEEPER)
        _changes = [(namespace, name, old) for namespace, name, old, _ in changes]


def uninstall() -> None:
    """Put back every name :func:`install` changed (nothing, if it is not installed), and stop
    processes started from now on from installing."""
    global _changes
    with _lock:
        children.leave()
        for namespace, name, old in reversed(_changes or []):
            namespace[name] = old
        if _KEEPER in sys.meta_path:
            sys.meta_path.remove(_KEEPER)
        _changes = None


@contextmanager
def installed():
    """``with miniddp.installed():`` torch's names mean miniddp's class inside the block.
    Nested in another install (or :func:`install`), it leaves the outer one in place."""
    outer = is_installed()
    install()
    try:
        yield DistributedDataParallel
    finally:
        if not outer:
            uninstall()


def _replaced(old, new=DistributedDataParallel, was=TORCH_DDP):
    """``old`` (``was``, or a tuple holding it) with ``new`` in place of ``was``."""
    if old is was:
        return new
    return tuple(new if c is was else c for c in old)


def _kept(module_name: str, kept=KEPT) -> bool:
    return any(module_name == k or module_name.startswith(k + ".") for k in kept)


def _holders(cls, modules=None):
    """``(namespace, name, value)`` for each global of an imported module that is ``cls`` or a
    tuple holding it, outside the modules in :data:`KEPT` (or in ``modules`` only)."""
    for module_name, module in list(modules or sys.modules.items()):
        if module is None or (modules is None and _kept(module_name)):
            continue
        try:  # sys.modules may hold objects that are not modules
            namespace = vars(module)
        except TypeError:
            continue
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if value is cls or (type(value) is tuple and any(v is cls for v in value)):
                yield namespace, name, value


class _KeepTorchsClass(importlib.abc.MetaPathFinder):
    """While installed, a module of :data:`TORCHS_OWN` imported for the first time
    (``torch._dynamo`` on the first ``torch.compile``) imports miniddp's class through torch's
    name: once it has run, its globals get torch's class back. It finds nothing itself: it wraps
    the loader that the other finders return."""

    def find_spec(self, name, path, target=None):
        if not _kept(name, TORCHS_OWN):
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
            spec.loader = _GiveTorchsClassBack(spec.loader)
        return spec


class _GiveTorchsClassBack(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        for namespace, name, old in list(_holders(DistributedDataParallel,
                                                  [(module.__name__, module)])):
            namespace[name] = _replaced(old, TORCH_DDP, DistributedDataParallel)

    def __getattr__(self, name):  # get_source, is_package, ...: the real loader's
        return getattr(self.loader, name)


_KEEPER = _KeepTorchsClass()
