"""The reducer's errors: what went wrong in a backward, and what to do about it (and the one
error the wrapper and the sampler share: no process group); and the warnings torch's C++
reducer prints, printed as it prints them (:func:`print_warning`).

Kept apart from ``miniddp.reducer`` so that the core path reads in one sitting; each function
returns the exception for the reducer to raise.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

_printed: set[str] = set()  # the once-per-process warnings already printed


class NoProcessGroupError(ValueError, RuntimeError):
    """Something that needs a process group found none initialized. torch raises ValueError
    for this now and raised RuntimeError before, so code written against either catches it."""


def no_process_group() -> NoProcessGroupError:
    return NoProcessGroupError(
        "DistributedDataParallel needs a process group: call "
        "torch.distributed.init_process_group(...) first (or start the script with "
        "miniddp.launch.launch / torchrun).")


def nothing_to_synchronize() -> RuntimeError:
    """torch's words first: code matches on them."""
    return RuntimeError(
        "DistributedDataParallel is not needed when a module doesn't have any parameter "
        "that requires a gradient: this module has no parameter that requires grad, so "
        "there is nothing to synchronize. Train it without DDP, or unfreeze a parameter.")


def logged(owner, error: BaseException) -> BaseException:
    """Record ``error`` where ``_get_ddp_logging_data()`` reports it (``has_error``, ``error``),
    as torch's DDP does; ``owner`` is the DDP module (its ``logger``) or its reducer (an
    ``error`` event, which the logger hears)."""
    logger = getattr(owner, "logger", None)
    if logger is not None:
        logger.set_error(error)
    elif hasattr(owner, "subscribe"):
        owner.error = error
        owner.emit("error", -1)
    return error


#: torch's own words for a static graph that lost a parameter (code and tests match on them).
STATIC_GRAPH_UNFINISHED = (
    "Expected to have finished reduction in the prior iteration before starting a new one. "
    "This error indicates that your training graph has changed in this iteration, e.g., one "
    "parameter is used in first iteration, but then got unused in the second iteration. this "
    "is not compatible with static_graph set to True.")


def unfinished_reduction(reducer) -> RuntimeError:
    """A forward began while the last synchronized backward never reduced every parameter.

    miniddp's sentence names the parameters; torch's phrases follow (its advice, and the
    "Parameter indices which did not receive grad for rank N: ..." line), so that code written
    against torch's message still finds them.
    """
    missing = [i for i in range(len(reducer.params)) if i not in reducer.ready]
    rank = dist.get_rank()
    names = ", ".join(reducer.names[i] for i in missing)
    if not missing:  # every gradient arrived, but that backward raised before it finished
        return RuntimeError(
            "Expected to have finished reduction in the prior iteration before starting a new "
            f"one: on rank {rank} the last synchronized backward raised an error before its "
            "gradients were averaged (see that error, e.g. a parameter marked ready twice), "
            "so the reducer is in an unknown state. Build a new DistributedDataParallel (and "
            "make sure every rank does the same) before training on.")
    if reducer.static_graph is not None:
        advice = (f"{reducer.static_graph.changed_graph_advice}\nIn torch's words: "
                  f"{STATIC_GRAPH_UNFINISHED}")
    elif reducer.unused is not None:
        advice = ("Since `find_unused_parameters=True` is enabled, this likely means that not "
                  "all `forward` outputs participate in computing loss: use them all, or return "
                  "only what the loss needs.")
    else:
        advice = ("If some parameters legitimately take no part in the loss, enable unused "
                  "parameter detection by passing the keyword argument "
                  "`find_unused_parameters=True` to DistributedDataParallel; otherwise make "
                  "sure all `forward` function outputs participate in calculating loss.")
    opening = ("Expected to have finished reduction in the prior iteration before starting a "
               "new one. ")
    if reducer.static_graph is None:  # torch's next sentence, which its users search for
        opening += ("This error indicates that your module has parameters that were not used "
                    "in producing loss. ")
    return RuntimeError(
        f"{opening}Rank {rank} got no gradient in the last backward for these parameters: "
        f"{names}. {advice}\n"
        f"Parameter indices which did not receive grad for rank {rank}: "
        f"{' '.join(map(str, missing))}\n"
        f"Parameters which did not receive grad for rank {rank}: {names} (torch's DDP lists "
        "them only if you set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO "
        "or DETAIL; miniddp always does).")


def marked_ready_twice(index: int, name: str) -> RuntimeError:
    """Opens as torch's does, and names the parameter in torch's form, for code matching them."""
    return RuntimeError(
        f"Expected to mark a variable ready only once. Parameter at index {index} with name "
        f"{name} has been marked as ready twice in one backward. Is it used outside forward, "
        "or in two reentrant backward passes (e.g. checkpointing the same layer twice)? For "
        "the latter, and if the graph is the same every iteration, pass static_graph=True.")


def print_warning(message: str, once: bool = False) -> None:
    """Print ``message`` to stderr as torch's C++ prints a warning. ``once``: only the first
    time in this process, as ``TORCH_WARN_ONCE``, unless ``torch.set_warn_always(True)``.

    Torch's reducer warns from code that runs with the GIL released (inside a backward, or a
    forward's ``prepare_for_backward``), so its warnings bypass Python's ``warnings``: c10 writes
    them to stderr. A ``warnings`` filter can neither hide them nor turn them into errors (``-W
    error`` still trains), and ``TORCH_CPP_LOG_LEVEL=ERROR`` silences them. miniddp's
    counterparts (``find_unused_parameters`` with nothing unused, ``backward(create_graph=True)``)
    behave the same, with the rank in front as in torch's lines. Warnings torch gives from
    Python stay Python warnings in miniddp.
    """
    if os.environ.get("TORCH_CPP_LOG_LEVEL", "").upper() in ("ERROR", "FATAL", "2", "3"):
        return
    if once and message in _printed and not torch.is_warn_always_enabled():
        return
    _printed.add(message)
    rank = f"[rank{dist.get_rank()}]:" if dist.is_available() and dist.is_initialized() else ""
    sys.stderr.write(f"{rank}[W miniddp reducer] Warning: {message}\n")
    sys.stderr.flush()
