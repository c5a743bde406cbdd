"""Each engine's log file: where compiler, linker and library chatter goes instead of the notebook.

One file per engine process (so per session: a restart makes new engines, new files), in this
user's private 0700 directory (`mpnb.private_files`), opened 0600 and O_APPEND so that the
engine's Python code and the compilers it starts (writing to fd 1/2) can share it.
`bootstrap.engine_info` reports each engine's path; the session keeps it per rank (`RankInfo.log`)
and the sidebar gets it in the rank rows. Standard library only: the kernel and the engines both
import it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time

from mpnb import private_files

PREFIX = "engine-"
KEEP_DAYS = 7.0  # older logs of finished engines are removed when a new engine opens its log

_lock = threading.Lock()
_fd: tuple[int, int] | None = None  # (pid, fd): the file this process writes, opened once


def engine_log_path(pid: int | None = None) -> str:
    """This engine's (or engine `pid`'s, on this host) log file."""
    return os.path.join(private_files.private_dir(), f"{PREFIX}{pid or os.getpid()}.log")


def log_fd() -> int:
    """The fd of this process's log, created (0600, O_APPEND) on first use."""
    global _fd
    with _lock:
        if _fd is None or _fd[0] != os.getpid():
            _prune_old()
            fd = private_files.create(engine_log_path())
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
            _fd = (os.getpid(), fd)
        return _fd[1]


def write(text: str) -> None:
    """Append `text` to this process's log (a newline added if missing); never raises."""
    if not text:
        return
    with contextlib.suppress(OSError):
        os.write(log_fd(), (text if text.endswith("\n") else text + "\n").encode("utf-8", "replace"))


def tail(path: str, lines: int = 40) -> str:
    """The last `lines` lines of a log on this host ("" if it is not ours or not there)."""
    text = private_files.read(path, limit=1 << 22, from_end=True) or ""
    return "\n".join(text.splitlines()[-lines:])


def _prune_old() -> None:
    """Remove logs untouched for KEEP_DAYS: engines that ended long ago (ours only, never followed)."""
    cutoff = time.time() - KEEP_DAYS * 86400
    with contextlib.suppress(OSError):
        directory = private_files.private_dir()
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                if name.startswith(PREFIX) and name.endswith(".log") and os.lstat(path).st_mtime < cutoff:
                    private_files.remove(path)
