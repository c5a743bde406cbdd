"""Files only this user can have written: a private 0700 directory and 0600 files in it.

Engines write their stack dumps where the kernel reads them back and trusts what they say (release
or interrupt a rank, and the text the notebook shows). A predictable name in the shared /tmp would
let another local user plant that text, or plant a symlink that makes an engine truncate any file
this user can write. So the files live in a directory that is ours alone (under `$XDG_RUNTIME_DIR`
when that is ours, else `/tmp/mpnb-<uid>`), are created with O_EXCL|O_NOFOLLOW and mode 0600, and
are read only after checking that the file and its directory belong to us. Standard library only:
the kernel and the engines both import it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

_OPEN_FLAGS = os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_cached: tuple[int, Path] | None = None  # (pid, directory): checked once per process


class UnsafePathError(OSError):
    """A path that another user could have made or changed: not ours, a symlink, or open to others."""


def _uid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else -1


def problem(st: os.stat_result, kind: str) -> str | None:
    """Why an lstat result is not this user's private `kind` ("dir" or "file"), or None if it is."""
    is_kind = stat.S_ISDIR(st.st_mode) if kind == "dir" else stat.S_ISREG(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not is_kind:
        return "is not a directory" if kind == "dir" else "is not a regular file"
    if _uid() >= 0 and st.st_uid != _uid():
        return f"is owned by uid {st.st_uid}, not {_uid()}"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}, open to other users"
    return None


def _ensure_dir(path: Path) -> None:
    """Create `path` 0700, or accept it only if it is already our own directory (its mode made 0700)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == _uid() and st.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours (nobody else can replace an entry we own in sticky /tmp): tighten it
        st = os.lstat(path)
    why = problem(st, "dir")
    if why:
        raise UnsafePathError(f"{path} {why}")


def _candidates() -> list[Path]:
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    found = []
    if os.path.isabs(runtime):
        with contextlib.suppress(OSError):
            if problem(os.lstat(runtime), "dir") is None:
                found.append(Path(runtime) / "mpnb")
    found.append(Path(tempfile.gettempdir()) / f"mpnb-{_uid()}")
    return found


def private_dir() -> Path:
    """This user's 0700 directory for mpnb's runtime files (`find_private_dir`, once per process)."""
    global _cached
    if _cached is None or _cached[0] != os.getpid():
        _cached = (os.getpid(), find_private_dir())
    return _cached[1]


def find_private_dir() -> Path:
    """Create or check this user's 0700 directory: `$XDG_RUNTIME_DIR/mpnb`, else `/tmp/mpnb-<uid>`.

    A name someone else took (their directory, a symlink) is never used: a fresh random directory
    (`tempfile.mkdtemp`, 0700) replaces it, so squatting the name only costs a new directory.
    """
    for path in _candidates():
        try:
            _ensure_dir(path)
        except OSError:
            continue
        return path
    return Path(tempfile.mkdtemp(prefix=f"mpnb-{_uid()}-"))


def create(path: str | os.PathLike[str]) -> int:
    """Open a new 0600 file at `path` for reading and writing; returns its fd.

    O_EXCL|O_NOFOLLOW: an entry already there (a stale file, a planted symlink) is unlinked, never
    followed or reused, and the file is made anew. The directory must be our private one.
    """
    parent = os.path.dirname(os.fspath(path)) or "."
    why = problem(os.lstat(parent), "dir")
    if why:
        raise UnsafePathError(f"{parent} {why}")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS
    try:
        return os.open(path, flags, 0o600)
    except FileExistsError:
        os.unlink(path)  # removes a symlink itself, not its target
        return os.open(path, flags, 0o600)


def read(path: str | os.PathLike[str], limit: int = 1 << 20, from_end: bool = False) -> str | None:
    """The text of `path` if it is our own 0600 regular file in our own private directory, else None.

    At most `limit` bytes: the first ones, or the last ones `from_end` (a log's tail).
    Checked on the open fd (O_NOFOLLOW), so a symlink or a file swapped in after the check is not read.
    """
    parent = os.path.dirname(os.fspath(path)) or "."
    try:
        if problem(os.lstat(parent), "dir"):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _OPEN_FLAGS)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if problem(st, "file"):
            return None
        if from_end and st.st_size > limit:
            os.lseek(fd, st.st_size - limit, os.SEEK_SET)
        return os.read(fd, limit).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def remove(path: str | os.PathLike[str]) -> bool:
    """Unlink `path` if it is our own file in our own private directory. True if it was removed."""
    parent = os.path.dirname(os.fspath(path)) or "."
    try:
        if problem(os.lstat(parent), "dir") or problem(os.lstat(path), "file"):
            return False
        os.unlink(path)
    except OSError:
        return False
    return True
