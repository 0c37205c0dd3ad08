"""How ranks start: forked from this process when that is safe, from a forkserver when not.

Forking is fast (tens of milliseconds: the child already has torch imported), but a fork copies
the parent's state, and two pieces of torch's state make a forked child unusable:

* **autograd's device threads.** The first backward in a process on a machine with a GPU (any
  device beside the CPU) starts one autograd thread per device, and torch registers a fork
  handler (``track_bad_autograd_forks`` in torch/csrc/autograd/engine.cpp) that marks every child
  forked afterwards: its first backward raises "Unable to handle autograd's threading in
  combination with fork-based multiprocessing". A CPU-only machine never starts these threads.
* **an initialized CUDA context**, which a forked child cannot use ("Cannot re-initialize CUDA in
  forked subprocess").

Neither can be seen from Python, so :func:`fork_is_safe` asks: it forks a child that runs one
tiny backward and reports (a few milliseconds). When forking is unsafe, the ranks start from
multiprocessing's *forkserver*: a fresh interpreter, started once per process, that imports torch
and this package once and forks each rank from its clean state. It costs one ``import torch``
the first time (seconds), not one per rank as *spawn* would.

A forkserver child has only what the server imported, so two things differ from a fork:

* the script that started it is imported again (as ``__mp_main__``, with ``__name__`` not
  ``"__main__"``): its top-level code must sit under ``if __name__ == "__main__":``, and functions
  sent to ranks must be defined at the top level of a file (not in ``python -c``, a notebook or
  an interactive session);
* modules the parent loaded by file path (the tests load the lessons so) cannot be imported by
  name: :func:`dumps_task` sends their paths along and :func:`loads_task` loads them from there.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import io
import multiprocessing as mp
import os
import pickle
import select
import signal
import sys
import types

import torch

#: torch's error in a forked child whose parent had started autograd's device threads.
AUTOGRAD_FORK_ERROR = ("Unable to handle autograd's threading in combination with fork-based "
                       "multiprocessing")

#: What a forkserver imports once, so that each rank forked from it starts in milliseconds.
#: ``torch._dynamo``: torch imports it lazily on the first DDP construction (seconds of CPU).
FORKSERVER_PRELOAD = ["__main__", "torch", "torch._dynamo", "miniddp.launch.rank_group"]

_fork_known_unsafe = False  # both conditions last as long as the process: remembered


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux only)."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def fork_is_safe(timeout: float = 30.0) -> bool:
    """Whether a child forked from this process now could run autograd (and use CUDA).

    False once CUDA is initialized here, or once a forked child's backward fails: then this
    process's autograd engine has started its device threads. A child that neither answers nor
    exits within ``timeout`` counts as unsafe too.
    """
    global _fork_known_unsafe
    if not _fork_known_unsafe:
        _fork_known_unsafe = torch.cuda.is_initialized() or not _forked_backward_works(timeout)
    return not _fork_known_unsafe


def _forked_backward_works(timeout: float) -> bool:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one backward, one byte if it worked, and out
        try:
            os.close(read_fd)
            die_with_parent()
            x = torch.ones(1, requires_grad=True)
            x.sum().backward()
            os.write(write_fd, b"1")
        finally:
            os._exit(0)
    os.close(write_fd)
    answer = b""
    try:
        if select.select([read_fd], [], [], timeout)[0]:
            answer = os.read(read_fd, 1)
    finally:
        os.close(read_fd)
        if not answer:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.waitpid(pid, 0)
    return answer == b"1"


def choose_start_method() -> str:
    """``"fork"`` where a forked rank can run autograd, ``"forkserver"`` where it cannot."""
    return "fork" if fork_is_safe() else "forkserver"


def context(start_method: str):
    """The multiprocessing context for ``start_method``, its forkserver prepared if it has one."""
    if start_method == "forkserver":
        mp.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the server starts
        _forget_inherited_forkserver_in_forked_children()
    return mp.get_context(start_method)


_registered = False


def _forget_inherited_forkserver_in_forked_children() -> None:
    """A forked child inherits multiprocessing's handle on its parent's forkserver, and cannot
    use it: the handle checks the server with ``waitpid``, which only a parent may call
    (``ChildProcessError``). Such a child (the tests fork launchers) starts a server of its own:
    its ranks then also die with it, not with the grandparent."""
    global _registered
    if not _registered:
        os.register_at_fork(after_in_child=_fresh_forkserver_handle)
        _registered = True


def _fresh_forkserver_handle() -> None:
    from multiprocessing import forkserver
    fresh = forkserver.ForkServer()
    forkserver._forkserver = fresh
    for name in ("ensure_running", "get_inherited_fds", "connect_to_new_process",
                 "set_forkserver_preload"):
        setattr(forkserver, name, getattr(fresh, name))


class _NotingPickler(pickle.Pickler):
    """A pickler that notes the module of every function and class it pickles by reference."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.modules: set[str] = set()

    def reducer_override(self, obj):
        if isinstance(obj, (type, types.FunctionType)):
            self.modules.add(getattr(obj, "__module__", None))
        return NotImplemented


def dumps_task(task, start_method: str) -> bytes:
    """Pickle ``task`` for a rank; for ranks not forked from here, with the files of the modules
    it refers to that were loaded by path (a rank cannot import those by name)."""
    if start_method == "fork":  # the ranks have every module this process has
        return pickle.dumps(({}, pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL)))
    buffer = io.BytesIO()
    pickler = _NotingPickler(buffer)
    pickler.dump(task)
    files = {}
    for name in pickler.modules - {None, "__main__"}:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            files[name] = path
    return pickle.dumps((files, buffer.getvalue()))


def loads_task(data: bytes):
    """Unpickle what :func:`dumps_task` made, loading by path each module it names that this
    process lacks and cannot import by name."""
    files, payload = pickle.loads(data)
    for name, path in files.items():
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != name:
                raise
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
    return pickle.loads(payload)
