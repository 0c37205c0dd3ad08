"""Putting miniddp's ``fully_shard`` where FSDP2 code looks for torch's (``install`` does it
beside DDP's names, ``miniddp.run.torch_names``).

torch exports its ``fully_shard`` under several names, and which exist depends on the version:
``torch.distributed.fsdp.fully_shard`` (2.6 on), ``torch.distributed._composable.fsdp.fully_shard``
(2.4 on, the function, and the submodule of that name holds it too), and where it is defined,
``torch.distributed.fsdp._fully_shard`` and its ``_fully_shard`` submodule. Each that exists is
pointed at miniddp's, and so is every global of an imported module that holds torch's function
(``from torch.distributed.fsdp import fully_shard`` run before the install: a framework's module,
your ``__main__``). Modules imported afterwards import miniddp's through torch's names.

What the install puts there is :func:`in_torchs_place`: miniddp's ``fully_shard`` carrying
torch's ``state`` attribute (torch's own function looks itself up through its module's global,
``fully_shard.state(module)``, so a reference to torch's kept from before the install still
works). torch's ``FSDPModule`` needs no replacing: miniddp's units are instances of it
(``miniddp.fsdp.settings``). Nothing here is silently torch's: a call of torch's function through
a name the install reached is miniddp's, and torch's ``fully_shard`` kept in a local variable,
a closure or a default argument from before the install stays torch's, as for DDP.
"""

from __future__ import annotations

import functools
import importlib

from miniddp.fsdp import fully_shard

#: Where torch defines and exports its ``fully_shard``, oldest last; those this torch has.
HOMES = ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard",
         "torch.distributed.fsdp._fully_shard._fully_shard",
         "torch.distributed._composable.fsdp", "torch.distributed._composable.fsdp.fully_shard")


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


_HOMES = [m for m in map(_import, HOMES) if m is not None]

#: torch's ``fully_shard``, as it was when miniddp was imported (``None``: this torch has none).
TORCH_FULLY_SHARD = next((vars(m)["fully_shard"] for m in _HOMES
                          if callable(vars(m).get("fully_shard"))), None)


@functools.wraps(fully_shard)
def in_torchs_place(module, *args, **kwargs):
    return fully_shard(module, *args, **kwargs)


in_torchs_place.state = getattr(TORCH_FULLY_SHARD, "state", None)


def changes(holders) -> list[tuple[dict, str, object, object]]:
    """``(namespace, name, old, new)`` for each place to point at miniddp's ``fully_shard``: the
    name in every home of torch's, and every global found by ``holders(torch's function)``
    (``torch_names._holders``: outside miniddp's and torch's own machinery)."""
    if TORCH_FULLY_SHARD is None:
        return []
    places = [(vars(m), "fully_shard") for m in _HOMES
              if vars(m).get("fully_shard") is TORCH_FULLY_SHARD]
    places += [(namespace, name) for namespace, name, _ in holders(TORCH_FULLY_SHARD)
               if type(namespace.get(name)) is not tuple
               and not any(n is namespace and k == name for n, k in places)]
    return [(namespace, name, namespace[name], in_torchs_place) for namespace, name in places]
