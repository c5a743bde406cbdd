"""ipyparallel's own output for this kernel (its log, and its engines' stdout/stderr) in one private file.

Inside IPython, an `ipp.Cluster` logs to the notebook, and when an engine exits with a non-zero
code (every engine does on SIGTERM) it dumps that engine's last 100 output lines there: "Handling
apply_request", "CRITICAL | received signal 15", "RuntimeError: Event loop stopped before Future
completed", compiler errors... Every stop looked like a crash. mpnb gives each Cluster `logger()`,
which writes to `path()` (this user's private directory, `mpnb.private_files`), copies each engine's
whole output there when its engine set stops (`EngineExits.collect`), and tells the notebook only
what explains a real failure (`EngineExits.problems`).

Kernel side: standard library only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mpnb import private_files
from mpnb.cluster import logs

LOGGER_NAME = "mpnb.ipyparallel"
TRIMMED_LINES = 6  # an engine's output lines shown under a failure (the rest stays in the log)

# Exit codes of an engine that mpnb stopped: 0 (it left), 1 (ipengine's SIGTERM handler stops its
# event loop mid-request), SIGTERM or SIGKILL (ipyparallel's stop, killing after its grace time).
_STOP_EXIT_CODES = {0, 1, -signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT}
# ipyparallel's own timestamped log lines (IPEngine, KernelNanny, ...): routine unless ERROR/CRITICAL.
_IPP_LINE = re.compile(r"^\d{4}-\d\d-\d\d [\d:.]+ \[[A-Za-z]+(?:\.\d+)?\] ")
_IPP_BAD = re.compile(r"\b(?:ERROR|CRITICAL) \| (?!received signal)")

_lock = threading.Lock()
_logger: logging.Logger | None = None


def path() -> str:
    """This kernel's ipyparallel log. Named like the engines' logs (`mpnb.cluster.logs`) so the
    same pruning removes old ones."""
    return os.path.join(private_files.private_dir(), f"{logs.PREFIX}set-{os.getpid()}.log")


class _NoEngineDumps(logging.Filter):
    """ipyparallel's "Output for <engine>" dumps: the last 100 lines, duplicated by `EngineExits.collect`,
    which writes each engine's whole output instead. The controller's dump stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (str(record.msg).startswith("Output for ") and args and str(args[0]).isdigit())


def logger() -> logging.Logger:
    """The logger every Cluster mpnb starts gets: INFO and up, to `path()`, never to the notebook.

    Not DEBUG: at DEBUG, ipyparallel's launchers echo every engine's output to sys.stderr (the cell)."""
    global _logger
    with _lock:
        if _logger is None:
            log = logging.getLogger(LOGGER_NAME)
            log.setLevel(logging.INFO)
            log.propagate = False  # the root logger's last-resort handler would print WARNINGs to the cell
            handler: logging.Handler
            try:
                # open for the process's lifetime: the handler writes to it until the kernel exits
                stream = open(private_files.create(path()), "a", encoding="utf-8", buffering=1)  # noqa: SIM115
                handler = logging.StreamHandler(stream)
                handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            except OSError:
                handler = logging.NullHandler()  # no private directory: nothing is written, nothing shown
            handler.addFilter(_NoEngineDumps())
            log.handlers = [handler]
            _logger = log
        return _logger


def describe(code: int | None) -> str:
    """An exit code in words: "exit code 3", "killed by SIGKILL"."""
    if code is None:
        return "an unknown exit status"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def trim(output: str, lines: int = TRIMMED_LINES) -> list[str]:
    """What in an engine's output can explain its exit: its last lines, without ipyparallel's routine log."""
    kept = [
        line.rstrip()
        for line in output.splitlines()
        if line.strip() and (not _IPP_LINE.match(line) or _IPP_BAD.search(line))
    ]
    return kept[-lines:]


@dataclass
class EngineExit:
    pid: int | None
    code: int | None
    before_stop: bool  # it had exited before mpnb stopped it: it died
    output: str


@dataclass
class EngineExits:
    """The engines of a Cluster across one stop or restart: which had died before, how each exited."""

    sets: list[tuple[str, Any]]  # (id, engine-set launcher), taken before the stop (the cluster drops them)
    dead_before: set[str] = field(default_factory=set)  # "<set id>/<engine identifier>"
    pids: dict[str, int | None] = field(default_factory=dict)  # the same keys -> the engine's pid

    @classmethod
    def before_stop(cls, cluster: Any) -> EngineExits:
        """Take the cluster's engine sets and note the engines already gone: call before stopping them."""
        watched = cls(list(getattr(cluster, "engines", {}).items()))
        for set_id, engine_set in watched.sets:
            noticed = (getattr(engine_set, "stop_data", None) or {}).get("engines", {})
            watched.dead_before |= {f"{set_id}/{ident}" for ident in noticed}
            for ident, launcher in list(getattr(engine_set, "launchers", {}).items()):
                watched.pids[f"{set_id}/{ident}"] = getattr(launcher, "pid", None)
                if not _launched_alive(launcher):
                    watched.dead_before.add(f"{set_id}/{ident}")
        return watched

    def collect(self) -> list[EngineExit]:
        """After the stop: how each engine exited; its whole output goes to the log."""
        exits = []
        log = logger()
        for set_id, engine_set in self.sets:
            outputs = getattr(engine_set, "outputs", {}) or {}
            # the exit of an engine that ended as the stop returned may not be noted yet: its output is
            stopped = (getattr(engine_set, "stop_data", None) or {}).get("engines", {})
            for ident in sorted({*outputs, *stopped}, key=str):
                key, data = f"{set_id}/{ident}", stopped.get(ident, {})
                code, pid = data.get("exit_code"), data.get("pid", self.pids.get(key))
                output = outputs.get(ident) or ""
                log.info("engine %s (pid %s) ended: %s; its output:\n%s", ident, pid, describe(code), output)
                exits.append(EngineExit(pid, code, key in self.dead_before, output))
        return exits

    def problems(self, ranks: Iterable[Any], what: str) -> list[str]:
        """Lines for the notebook: one per engine that died before `what` (a stop, a restart) or exited
        oddly during it, each with the output lines that may explain it, then where the full log is.
        `ranks`: the session's `RankInfo` rows, to name engines by rank."""
        rank_of_pid = {info.pid: info.rank for info in ranks}
        lines: list[str] = []
        for e in self.collect():
            if not e.before_stop and (e.code is None or e.code in _STOP_EXIT_CODES):
                continue
            rank = rank_of_pid.get(e.pid) if e.pid is not None else None
            who = f"rank {rank} (pid {e.pid})" if rank is not None else f"an engine (pid {e.pid})"
            when = f"had already exited before the {what}" if e.before_stop else f"exited during the {what}"
            lines.append(f"mpnb: {who} {when}: {describe(e.code)}.")
            lines.extend(f"    {line}" for line in trim(e.output))
        if lines:
            lines.append(f"mpnb: the engines' full output is in {path()}")
        return lines


def stop_cluster(cluster: Any) -> list[str]:
    """Stop the controller and engines; what went wrong goes to the log, and one line to the caller."""
    for attempt in range(2):
        try:
            cluster.stop_cluster_sync()
            return []
        except RuntimeError as exc:
            # ipyparallel's engine set iterates its launchers while an engine's exit callback removes
            # one ("dictionary changed size during iteration"); stopping again finds them stopped.
            if attempt == 0 and "changed size during iteration" in str(exc):
                logger().info("stopping the cluster raced with an engine's exit; stopping again")
                continue
            return _stop_failed(exc)
        except Exception as exc:
            return _stop_failed(exc)
    return []


def _stop_failed(exc: BaseException) -> list[str]:
    logger().error("stopping the cluster failed", exc_info=exc)
    name = getattr(exc, "ename", type(exc).__name__)
    return [
        f"mpnb: stopping the cluster failed ({name}: {exc}); some engines may still be running. "
        f"Details: {path()}"
    ]


def _launched_alive(launcher: Any) -> bool:
    process = getattr(launcher, "process", None)
    if process is None and hasattr(launcher, "ssh_sender"):  # an engine on another host: its launcher knows
        return getattr(launcher, "state", None) == "running"
    return _alive(process)


def _alive(process: Any) -> bool:
    if process is None:
        return False
    try:
        return bool(process.is_running()) and process.status() != "zombie"
    except Exception:  # psutil.NoSuchProcess and the like: gone
        return False


def print_lines(lines: Iterable[str], stream: Any = None, flush_stdout: bool = True) -> None:
    """Failures go to stderr (the notebook shows them as such), after what the cell printed so far.

    `flush_stdout=False` at kernel exit: ipykernel's stdout may then wait 10 s for its stopped thread."""
    text = "".join(f"{line}\n" for line in lines)
    stream = stream or sys.stderr
    if text and stream is not None:
        with contextlib.suppress(Exception):  # a closed stream at kernel exit
            if flush_stdout:
                sys.stdout.flush()
            stream.write(text)
            stream.flush()
