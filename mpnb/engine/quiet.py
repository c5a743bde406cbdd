"""Keep a learner's cells clean: library chatter goes to the engine's log unless the cell asks for it.

What goes to the log (`mpnb.cluster.logs`, one file per engine) instead of the cell:
- everything written while `captured()` is active (DeepSpeed's setup in `mpnb.prepare`): the
  compilers and linkers its op probe starts (fd 1/2), its prints, its log records, its warnings;
- DeprecationWarning and FutureWarning from anywhere (DeepSpeed calls renamed torch.distributed
  functions on every step), and the DeepSpeed logger's records below ERROR;
- whatever a thread inside `quiet_thread()` warns or logs (the background DeepSpeed warm-up);
- transformers' logging below ERROR (its verbosity is set to "error" through TRANSFORMERS_VERBOSITY,
  which it reads when imported: GPT-2's "`loss_type=None` was set in the config" and advice lines)
  and the warnings its own code raises; a user who set TRANSFORMERS_VERBOSITY keeps theirs;
- warnings about code mpnb runs rather than the user's (`QUIET_MESSAGES`);
`%%distributed --verbose` (the kernel appends VERBOSE_MARK to the cell's first line) or
MPNB_VERBOSE=1 in the engines' environment shows it all in the cell again.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from mpnb.cluster import logs
from mpnb.engine.control import CELL_MARK

VERBOSE_MARK = "  # verbose"  # appended to a `%%distributed --verbose` cell's first line
VERBOSE_ENV = "MPNB_VERBOSE"
LOGGERS = ("DeepSpeed",)  # libraries' loggers whose records below ERROR go to the log
# libraries whose warnings (any category) go to the log: matched in the warning's file name
QUIET_LIBRARIES = (f"{os.sep}transformers{os.sep}",)
# warnings about code mpnb runs, not the user's: FSDP2 around a transformers model returns its output's
# views (TP x DP); the trainer never changes them in place, so the warning has nothing to act on
QUIET_MESSAGES = ("returned a view tensor",)
TRANSFORMERS_VERBOSITY = "TRANSFORMERS_VERBOSITY"

_cell_verbose = False
_local = threading.local()  # .depth: quiet_thread() nesting in this thread
_fd_lock = threading.Lock()
_fd_depth = 0
_saved_fds: list[int] = []
_own_transformers_verbosity = False  # mpnb set TRANSFORMERS_VERBOSITY (the user had not)


def verbose() -> bool:
    """Show library chatter in the cell: this cell was run with --verbose, or MPNB_VERBOSE is set."""
    return _cell_verbose or os.environ.get(VERBOSE_ENV, "").lower() not in ("", "0", "false", "no")


def _quiet_here() -> bool:
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def quiet_thread() -> Iterator[None]:
    """Warnings and library log records raised in this thread go to the log (other threads unaffected)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


@contextlib.contextmanager
def quiet_fds() -> Iterator[None]:
    """Point fd 1 and 2 at the log: what subprocesses (compilers, linkers) and C code write lands there.

    Process-wide, so keep it short; nested and concurrent uses share one redirection. The saved
    copies keep ipykernel's pipes open, so its output watcher carries on once they are put back."""
    global _fd_depth
    with _fd_lock:
        if _fd_depth == 0:
            target = logs.log_fd()
            _saved_fds[:] = [os.dup(1), os.dup(2)]
            os.dup2(target, 1)
            os.dup2(target, 2)
        _fd_depth += 1
    try:
        yield
    finally:
        with _fd_lock:
            _fd_depth -= 1
            if _fd_depth == 0:
                for fd, saved in zip((1, 2), _saved_fds, strict=True):
                    os.dup2(saved, fd)
                    os.close(saved)
                _saved_fds.clear()


class _LogStream(io.TextIOBase):
    """sys.stdout/sys.stderr stand-in that appends to the engine's log."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if text.strip():
            logs.write(text.rstrip("\n"))
        return len(text)


@contextlib.contextmanager
def captured() -> Iterator[None]:
    """Everything this block prints, warns, logs or starts goes to the log (unless the cell is verbose)."""
    if verbose():
        yield
        return
    stream = _LogStream()
    with quiet_thread(), quiet_fds(), contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        yield


# ---------------------------------------------------------------------------- warnings and loggers


def install_warnings() -> None:
    """Route warnings as the module docstring says, and show each deprecation once per engine.

    Once: every `warnings.catch_warnings()` anywhere clears the registries behind "default" and
    "once" (CPython bumps the filters' version), so under ZeRO-3 each rank printed 4 FutureWarnings
    a step. Deduplicating where they are shown is what holds.
    """
    show = warnings.showwarning
    if getattr(show, "mpnb_quiet", False):
        return
    shown: set[tuple[str, type, str, int]] = set()
    logged: set[tuple[str, type, str, int]] = set()

    def showwarning(message: Any, category: type, filename: str, lineno: int, *rest: Any) -> None:
        # chatter: deprecations from anywhere, and any warning a quiet library's own code raises
        chatter = (
            issubclass(category, (DeprecationWarning, FutureWarning))
            or any(lib in str(filename) for lib in QUIET_LIBRARIES)
            or any(text in str(message) for text in QUIET_MESSAGES)
        )
        key = (str(message), category, filename, lineno)
        if _quiet_here() or (chatter and not verbose()):
            if not (chatter and key in logged):
                logged.add(key)
                logs.write(warnings.formatwarning(message, category, filename, lineno))  # type: ignore[arg-type]
            return
        if chatter:
            if key in shown:
                return
            shown.add(key)
        show(message, category, filename, lineno, *rest)

    showwarning.mpnb_quiet = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning


class _ToLog(logging.Filter):
    """On a library's logger: records below ERROR go to the engine's log, unless the cell is verbose."""

    mpnb_quiet = True

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and not _quiet_here():
            return True
        if verbose() and not _quiet_here():
            return True
        logs.write(f"[{record.name} {record.levelname}] {record.getMessage()}")
        return False


def install() -> None:
    """On every engine (bootstrap.setup): warnings, library loggers, and --verbose cells."""
    global _own_transformers_verbosity
    install_warnings()
    if TRANSFORMERS_VERBOSITY not in os.environ:
        _own_transformers_verbosity = True
        _transformers_verbosity()
    for name in LOGGERS:
        logger = logging.getLogger(name)  # DeepSpeed later adds its handler to this same logger
        if not any(getattr(f, "mpnb_quiet", False) for f in logger.filters):
            logger.addFilter(_ToLog())
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and _pre_run_cell not in shell.events.callbacks["pre_run_cell"]:
        shell.events.register("pre_run_cell", _pre_run_cell)


def _pre_run_cell(info: Any) -> None:
    global _cell_verbose
    first = (getattr(info, "raw_cell", "") or "").split("\n", 1)[0]
    _cell_verbose = first.startswith(CELL_MARK) and VERBOSE_MARK in first
    if _own_transformers_verbosity:
        _transformers_verbosity()


def _transformers_verbosity() -> None:
    """transformers logs warnings in --verbose cells only (read at its import, set on its logger after)."""
    level = "warning" if verbose() else "error"
    os.environ[TRANSFORMERS_VERBOSITY] = level
    if "transformers" in sys.modules:  # already imported: its root logger took the level then
        logging.getLogger("transformers").setLevel(logging.WARNING if verbose() else logging.ERROR)
