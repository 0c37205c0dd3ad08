"""Become ``python ARGS`` in a forked child: what a new interpreter would set up, without its
start-up (``import torch`` alone is seconds of CPU, paid once in the process that forks). Two
kinds of parent fork such a child: pytest itself (``jobs.ForkedPython``: the child in a session
of its own, as a shell starts a job) and an interpreter that only imported torch
(``warm_python``: the child dies with it)."""

from __future__ import annotations

import atexit
import faulthandler
import importlib.util
import logging
import os
import runpy
import signal
import sys
import threading
import traceback
import types
import warnings
import weakref


def die_with_parent() -> None:
    """SIGKILL when the parent dies (Linux): a killed test run leaves nothing running."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def become_python(args: list[str], cwd: str, env: dict[str, str], stdout: int, stderr: int,
                  own_session: bool) -> None:
    """In a forked child: ``python ARGS`` (``-m MODULE``, ``-c CODE`` or ``SCRIPT``, then its
    arguments), stdin from /dev/null, stdout and stderr to these descriptors (closed here), in a
    session of its own (``own_session``) or dying with the parent. Never returns: the exit status
    is Python's (a ``SystemExit``'s code; 1 and the traceback on stderr for an uncaught
    exception, or for a set-up that failed)."""
    code = 1
    try:
        if own_session:
            os.setsid()
        else:
            die_with_parent()
        null = os.open(os.devnull, os.O_RDONLY)
        for source, target in ((null, 0), (stdout, 1), (stderr, 2)):
            os.dup2(source, target)
        for fd in {null, stdout, stderr} - {0, 1, 2}:
            os.close(fd)
        # the parent's streams may be pytest's captures: the descriptors' own, as python opens
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        sys.stdout = sys.__stdout__ = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = sys.__stderr__ = os.fdopen(2, "w", buffering=1, closefd=False)
        _python_defaults()
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        code = _run_as_main(args)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _python_defaults() -> None:
    """Undo what the parent changed in the process-wide state a new interpreter starts with:
    pytest records warnings, captures logging and arms faulthandler; a test may leave a timer or
    signal handlers; the parent's weakref finalizers are the parent's to run, not this child's."""
    faulthandler.disable()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, 0)
    warnings.showwarning = warnings._showwarning_orig  # print warnings, and Python's filters:
    warnings.resetwarnings()
    for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning,
                     DeprecationWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    logging.root.handlers.clear()  # Python's last resort handler instead
    logging.root.setLevel(logging.WARNING)
    weakref.finalize._registry.clear()  # e.g. a TemporaryDirectory of the parent's


def _run_as_main(args: list[str]) -> int:
    """Set ``sys.argv`` and ``sys.path`` as ``python ARGS`` does (the script's directory, the
    current one for ``-m`` or ``""`` for ``-c`` in place of the parent's first entry, then
    PYTHONPATH), run the first sitecustomize on PYTHONPATH unless it is the one the parent ran,
    then ARGS as ``__main__``; at the end, as Python's exit does, wait for the threads that are
    not daemons and run the atexit functions. The exit status Python would give."""
    pythonpath = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    if args[0] in ("-m", "-c"):
        sys.argv = [args[0], *args[2:]]  # for -m, runpy puts the module's path in argv[0]
        first = os.getcwd() if args[0] == "-m" else ""
    else:
        sys.argv = list(args)
        first = os.path.dirname(os.path.realpath(args[0]))
    sys.path[:1] = [first, *pythonpath]
    _run_sitecustomize(pythonpath)
    sys.modules["__main__"] = main = types.ModuleType("__main__")
    try:
        if args[0] == "-m":
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:
            runpy.run_path(os.path.abspath(args[0]), run_name="__main__")
        code = 0
    except SystemExit as done:
        code = _exit_status(done.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    return code


def _run_sitecustomize(path_entries: list[str]) -> None:
    """Python imports the first ``sitecustomize`` on its path at start-up: do it here too, unless
    that one already ran in the parent (its effects are this child's already)."""
    for entry in path_entries:
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.exists(candidate):
            ran = getattr(sys.modules.get("sitecustomize"), "__file__", None)
            if ran is None or os.path.realpath(ran) != os.path.realpath(candidate):
                spec = importlib.util.spec_from_file_location("sitecustomize", candidate)
                sys.modules["sitecustomize"] = module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            return


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
