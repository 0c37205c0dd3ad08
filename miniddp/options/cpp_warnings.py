"""The warnings torch's C++ reducer prints, printed where torch prints them.

Torch's reducer warns from code that runs with the GIL released (inside a backward, or a
forward's ``prepare_for_backward``), so its warnings bypass Python's ``warnings``: c10 writes
them to stderr. A ``warnings`` filter can neither hide them nor turn them into errors (``-W
error`` still trains), and ``TORCH_CPP_LOG_LEVEL=ERROR`` silences them. miniddp's counterparts
(``find_unused_parameters`` with nothing unused, ``backward(create_graph=True)``) behave the
same, with the rank in front as in torch's lines. Warnings torch gives from Python stay Python
warnings in miniddp.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

_printed: set[str] = set()  # the once-per-process warnings already printed


def print_warning(message: str, once: bool = False) -> None:
    """Print ``message`` to stderr as torch's C++ prints a warning. ``once``: only the first
    time in this process, as ``TORCH_WARN_ONCE``, unless ``torch.set_warn_always(True)``."""
    if os.environ.get("TORCH_CPP_LOG_LEVEL", "").upper() in ("ERROR", "FATAL", "2", "3"):
        return
    if once and message in _printed and not torch.is_warn_always_enabled():
        return
    _printed.add(message)
    rank = f"[rank{dist.get_rank()}]:" if dist.is_available() and dist.is_initialized() else ""
    sys.stderr.write(f"{rank}[W miniddp reducer] Warning: {message}\n")
    sys.stderr.flush()
