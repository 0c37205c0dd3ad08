"""Reaching the Python processes a process starts, so that they run miniddp in torch's place too.

Installing changes names in one interpreter. The workers a training script starts are other
interpreters: ``torch.multiprocessing.spawn`` and the spawn and forkserver start methods (the
seeds' ``multigpu.py``, Lightning's ``ddp_spawn``), a launcher that runs the script again for
the other ranks (Lightning's ``ddp`` strategy runs ``python script.py`` once per extra rank),
torchrun's workers, any ``subprocess`` running Python. Without help each of them trains with
torch's class, silently, or with miniddp's on some ranks and torch's on others.

What every one of them inherits is the environment, so :func:`reach` puts two things there:
the marker :data:`MARKER` (naming the directory miniddp is imported from) and the directory
``miniddp/run/startup`` at the front of ``PYTHONPATH``. Python imports ``sitecustomize`` at
start-up from its path, so each child runs ``miniddp/run/startup/sitecustomize.py``, which
installs miniddp the moment the child has imported torch (a child that never imports torch pays
nothing) and then runs the ``sitecustomize`` it hides, if there is one. :func:`leave` takes both
out again, and later children start as plain Python.

A child given an environment of its own (``subprocess.Popen(..., env={...})``, ``os.execve``,
``os.posix_spawn``) inherits nothing, so :func:`watch` adds an audit hook (``sys.addaudithook``)
that sees each such start before it happens and puts the two entries into the dictionary the
caller passed (which keeps them: the dict is the caller's). An environment that is not a plain
``dict`` of strings cannot be changed: that start warns, once per process.

It cannot reach a Python started with ``-E``, ``-I`` or ``-S`` (they ignore ``PYTHONPATH`` or
skip ``sitecustomize``; multiprocessing passes these flags on to its children), nor a process
started before :func:`reach` (a forkserver already running): :func:`unreachable` says which.
"""

from __future__ import annotations

import os
import sys
import warnings

#: Set in the environment while children should install miniddp: the directory to import it from.
MARKER = "MINIDDP_IN_TORCHS_PLACE"

#: The directory whose ``sitecustomize.py`` each child Python runs at start-up.
STARTUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "startup")

#: The directory holding the ``miniddp`` package this process imported.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


#: Audit events that start a process with an environment the caller gives: where in the event's
#: arguments that environment is.
STARTS_WITH_ENV = {"subprocess.Popen": 3, "os.exec": 2, "os.posix_spawn": 2, "os.spawn": 3}


class WorkersMissTheInstall(RuntimeWarning):
    """Some processes this one starts will run torch's DDP despite ``miniddp.install()``."""


_watching = False
_warned = False


def reach() -> None:
    """Make every Python process started from now on install miniddp once it imports torch."""
    os.environ[MARKER] = ROOT
    entries = _pythonpath()
    if STARTUP not in entries:
        os.environ["PYTHONPATH"] = os.pathsep.join([STARTUP, *entries])


def leave() -> None:
    """Undo :func:`reach`: processes started from now on run torch's class."""
    os.environ.pop(MARKER, None)
    entries = [e for e in _pythonpath() if e != STARTUP]
    if entries:
        os.environ["PYTHONPATH"] = os.pathsep.join(entries)
    else:
        os.environ.pop("PYTHONPATH", None)


def reaches() -> bool:
    """Whether processes started from now on will install miniddp."""
    return os.environ.get(MARKER) == ROOT and STARTUP in _pythonpath()


def watch() -> None:
    """Reach children given an environment of their own too (see the module docstring). An
    audit hook cannot be removed: it stays, and does nothing once :func:`leave` has run."""
    global _watching
    if not _watching:
        sys.addaudithook(_on_audit_event)
        _watching = True


def _on_audit_event(event: str, args: tuple) -> None:
    where = STARTS_WITH_ENV.get(event)
    if where is not None and len(args) > where and args[where] is not None:
        started_with_env(args[where])


def started_with_env(env) -> None:
    """A process is about to start with ``env`` for environment: add what :func:`reach` puts in
    ours, if this process reaches its children and ``env`` lacks it; warn once if it cannot."""
    global _warned
    if os.environ.get(MARKER) != ROOT or _has_the_marks(env):
        return
    if isinstance(env, dict) and all(type(k) is str for k in env) and isinstance(
            env.get("PYTHONPATH", ""), str):
        env[MARKER] = ROOT
        env["PYTHONPATH"] = os.pathsep.join([STARTUP, *_pythonpath(env)])
    elif not _warned:
        _warned = True
        warnings.warn(
            f"miniddp: a process is starting with an environment of its own (a "
            f"{type(env).__name__}, which miniddp cannot add {MARKER} and PYTHONPATH to): if it "
            "runs Python and builds DDP, it builds torch's DistributedDataParallel, not "
            "miniddp's. Pass os.environ on (env={**os.environ, ...}) or call "
            "miniddp.install() in the child's code.", WorkersMissTheInstall, stacklevel=3)


def _has_the_marks(env) -> bool:
    try:
        return env[MARKER] == ROOT and STARTUP in _pythonpath(env)
    except (KeyError, TypeError, AttributeError):  # not there, or not a mapping of strings
        return False


def unreachable() -> str | None:
    """Why some workers started from this process will not install miniddp, or None."""
    flags = [flag for flag, on in (("-E", sys.flags.ignore_environment),
                                   ("-I", sys.flags.isolated), ("-S", sys.flags.no_site)) if on]
    if flags:
        return (f"this Python runs with {' '.join(flags)}, which multiprocessing passes on to "
                "the workers it starts: they ignore PYTHONPATH or sitecustomize, so they will "
                "not install miniddp")
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_pid", None) is not None:
        return ("multiprocessing's forkserver was already running: the workers it starts do not "
                "see the install")
    return None


def _pythonpath(env=os.environ) -> list[str]:
    return [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e]
