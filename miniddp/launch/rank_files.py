"""What forked ranks leave for their parent to read or remove: stderr, and a directory.

A rank that dies inside C++ (gloo's ``abort()`` on a collective mismatch, a segfault) sends no
report: its exit code says only "-6". Its explanation went to stderr. So each rank's stderr is a
pipe; :class:`StderrTail` reads it without blocking while the parent waits, passes every byte on
to the parent's own stderr (the user still sees it as it comes) and keeps the last few kilobytes
to quote when the rank dies.

A group's files (the store, the stack dumps) live in ``$TMPDIR/miniddp-<parent pid>-*``, removed
when the group closes, also on SIGTERM or SIGHUP (``miniddp.launch.stop_on_signals``). Nothing
runs after SIGKILL; the pid in the name lets :func:`remove_stale_group_dirs` find and remove the
directories of dead parents the next time a group starts.
"""

from __future__ import annotations

import codecs
import os
import re
import shutil
import sys
import tempfile


class StderrTail:
    """One rank's stderr, read from a pipe without blocking: passed on, its last lines kept."""

    KEEP_BYTES = 8192

    def __init__(self, read_fd: int):
        self.fd = read_fd
        os.set_blocking(read_fd, False)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._tail = b""

    def drain(self) -> None:
        """Read what is there now; pass it on to this process's stderr."""
        while self.fd is not None:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            if not data:  # every writer has gone: nothing more will come
                os.close(self.fd)
                self.fd = None
                return
            self._tail = (self._tail + data)[-self.KEEP_BYTES:]
            sys.stderr.write(self._decoder.decode(data))
            sys.stderr.flush()

    def last_lines(self, count: int = 30) -> str:
        self.drain()
        lines = self._tail.decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-count:])

    def close(self) -> None:
        self.drain()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


_GROUP_DIR = re.compile(r"miniddp-(\d+)-")


def remove_stale_group_dirs(directory: str | None = None) -> list[str]:
    """Remove ``miniddp-<pid>-*`` directories whose parent process no longer exists.

    A parent killed by SIGKILL leaves its group's directory (a store file, stack dumps: small and
    harmless); its name carries the pid, so the next group can tell it is stale.
    """
    directory = directory or tempfile.gettempdir()
    removed = []
    for name in os.listdir(directory):
        match = _GROUP_DIR.match(name)
        if match and not _pid_alive(int(match.group(1))):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            removed.append(name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
