"""Put a finished checkpoint directory in place in one step, so readers see the old one or the new one."""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the kernel or libc lacks it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(finished: Path, target: Path) -> None:
    """Move directory `finished` to `target`, replacing an older checkpoint there.

    With renameat2 the swap is atomic: a reader, or a crash, sees the old
    checkpoint or the new one, never a mix. The old one is deleted after.
    """
    if not target.exists():
        os.rename(finished, target)
    elif _exchange(finished, target):
        shutil.rmtree(finished, ignore_errors=True)  # `finished` now holds the old checkpoint
    else:  # no atomic swap: a crash between these two renames leaves the old one at `aside`
        aside = finished.with_name(finished.name + "-old")
        os.rename(target, aside)
        os.rename(finished, target)
        shutil.rmtree(aside, ignore_errors=True)
    fsync_dir(target.parent)
