"""``python -m miniddp.run script.py [args]``: run a training script with miniddp's DDP in
torch's place (``miniddp.run.torch_names``), installed before the script's first line.

The script runs as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as ``python script.py``
would set them; ``-m package.module`` runs a module instead, as ``python -m`` would. Under
torchrun every worker installs for itself::

    torchrun --standalone --nproc_per_node=2 -m miniddp.run train.py --batch-size 32
"""

import os
import runpy
import sys

from miniddp.run.torch_names import install

USAGE = "usage: python -m miniddp.run script.py [args ...]  |  python -m miniddp.run -m module"


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.strip())
        raise SystemExit(0 if argv else 2)
    install()
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(USAGE)
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path in argv[0]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        if not os.path.exists(script):
            raise SystemExit(f"miniddp.run: no such script: {script}\n{USAGE}")
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as python script.py
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
