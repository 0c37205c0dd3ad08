"""``python -m miniddp.run script.py [args]``: run a training script with miniddp's DDP in
torch's place (``miniddp.run.torch_names``), installed before the script's first line.

The script runs as ``__main__`` with ``sys.argv``, ``sys.path[0]`` and ``__file__`` as
``python script.py`` would set them (``__file__`` absolute: the current directory joined to the
path as typed, so ``os.path.dirname(__file__)`` still names the script's directory after a
``chdir``); ``-m package.module`` runs a module instead, as ``python -m`` would.

Every Python process the script starts installs miniddp too, as soon as it imports torch
(``miniddp.run.children``): ``torch.multiprocessing.spawn`` and the spawn and forkserver start
methods, a launcher that runs the script again for the other ranks (Lightning's ``ddp``),
``subprocess``. When the script ends, the install and its marks in the environment are undone.
Under torchrun, either way round works::

    torchrun --standalone --nproc_per_node=2 -m miniddp.run train.py --batch-size 32
    python -m miniddp.run -m torch.distributed.run --standalone --nproc_per_node=2 train.py
"""

import os
import runpy
import sys

from miniddp.run.torch_names import install, uninstall

USAGE = "usage: python -m miniddp.run script.py [args ...]  |  python -m miniddp.run -m module"


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.strip())
        raise SystemExit(0 if argv else 2)
    if argv[0] == "-m" and len(argv) < 2:
        raise SystemExit(USAGE)
    if argv[0] != "-m" and not os.path.exists(argv[0]):
        raise SystemExit(f"miniddp.run: no such script: {argv[0]}\n{USAGE}")
    install()
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path in argv[0]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)  # as typed, as python script.py leaves it
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(os.path.join(os.getcwd(), argv[0]), run_name="__main__")
    finally:
        uninstall()


if __name__ == "__main__":
    main(sys.argv[1:])
