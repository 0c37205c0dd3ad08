"""Putting miniddp in torch's place in other people's code.

``miniddp.install()`` (or ``with miniddp.installed():``) makes torch's DDP names mean miniddp's
class, where torch and frameworks look it up (``miniddp.run.torch_names``), and torch's
``fully_shard`` names miniddp's (``miniddp.run.fsdp_names``);
``python -m miniddp.run script.py [args]`` installs, then runs the script as ``__main__``
(``miniddp.run.__main__``; under torchrun: ``torchrun ... -m miniddp.run script.py``). Both
reach the Python processes started afterwards: spawned workers and scripts run again by a
launcher install miniddp too (``miniddp.run.children``).
"""

from miniddp.run.torch_names import (
    TORCH_DDP,
    WorkersMissTheInstall,
    install,
    installed,
    is_installed,
    uninstall,
)

__all__ = ["TORCH_DDP", "WorkersMissTheInstall", "install", "installed", "is_installed",
           "uninstall"]
