"""Putting miniddp's DDP where code looks for torch's, so that other people's code uses it.

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

What it cannot reach: torch's class kept anywhere else before the install (a local variable, a
closure, a default argument, a class attribute, a list or dict), and ``type(m) is`` checks
against such a copy. Call it first, or run the script with ``python -m miniddp.run``, which
installs before the script's first line, and there is nothing before it to miss.

Left alone on purpose: miniddp's own modules (they keep torch's class to compare with it and to
talk to torch's compiler), ``torch._dynamo`` (which finds the DDP module being compiled through
torch's class, and miniddp's forward tells it there: ``miniddp.options``), and
``torch.distributed._composable`` (``replicate()`` builds torch's DDP around its own machinery).
A torch DDP built before the install, or from a reference kept, still works in eager mode; do
not mix the two in one model.

:func:`uninstall` puts back every name :func:`install` changed; :func:`installed` is the
context manager for both. Modules imported while installed keep the class they imported.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

import torch.nn.parallel
import torch.nn.parallel.distributed

from miniddp.ddp import DistributedDataParallel

#: torch's class, as it was when miniddp was imported (before any install).
TORCH_DDP = torch.nn.parallel.distributed.DistributedDataParallel

#: Where torch defines and exports the class: always replaced.
TORCH_NAMES = (torch.nn.parallel, torch.nn.parallel.distributed)

#: Modules (and their submodules) whose reference to torch's class is theirs to keep.
KEPT = ("miniddp", "torch._dynamo", "torch.distributed._composable")

_lock = threading.Lock()
_changes: list[tuple[dict, str, object]] | None = None  # (namespace, name, old value)


def is_installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _changes is not None


def install() -> None:
    """Make torch's DDP names mean miniddp's class (see the module docstring). Calling it
    again while installed does nothing."""
    global _changes
    with _lock:
        if _changes is not None:
            return
        changes = []
        for module in TORCH_NAMES:
            changes.append((module.__dict__, "DistributedDataParallel",
                            module.__dict__["DistributedDataParallel"]))
        for namespace, name, old in _holders(TORCH_DDP):
            if not any(n is namespace and k == name for n, k, _ in changes):
                changes.append((namespace, name, old))
        for namespace, name, old in changes:
            namespace[name] = _replaced(old)
        _changes = changes


def uninstall() -> None:
    """Put back every name :func:`install` changed (nothing, if it is not installed)."""
    global _changes
    with _lock:
        for namespace, name, old in reversed(_changes or []):
            namespace[name] = old
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


def _replaced(old):
    if old is TORCH_DDP:
        return DistributedDataParallel
    return tuple(DistributedDataParallel if c is TORCH_DDP else c for c in old)


def _holders(cls):
    """``(namespace, name, value)`` for each global of an imported module that is ``cls`` or a
    tuple holding it, outside the modules in :data:`KEPT`."""
    for module_name, module in list(sys.modules.items()):
        if module is None or any(module_name == k or module_name.startswith(k + ".")
                                 for k in KEPT):
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
